"""The local backend: a model loaded in this process and its decoding session (engine/), which
turns a Conversation into the events every front end consumes (its Steps become Pieces)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ladechat.backends.events import Notice, Piece
from ladechat.conversation import Conversation, dropped_notice, prompt_budget
from ladechat.engine.config import ConfigError
from ladechat.engine.events import Done
from ladechat.settings import Settings

# torch and transformers are imported only where a Bot is built.
if TYPE_CHECKING:
    from ladechat.engine.load.loading import LoadedModel


GRAMMARS_KEPT = 32  # formats whose grammar a bot keeps compiled, the most recently used


class Bot:
    """compile: fixed-shape steps on a pre-allocated cache, compiled (see engine/runner.py); every
    lookahead step is then a full one, so it suits a GPU, where a full step costs about one token's."""

    def __init__(self, loaded: LoadedModel, settings: Settings, compile: bool = False,
                 store_root: Path | None = None, step_cost=None, store=None, full_steps: bool = False) -> None:
        """store_root: the folder of the persistent answer stores (the cache folder); None keeps
        this bot's store in memory only. step_cost: the step costs to plan with (a
        step_cost.CostModel, fixed); None: the model's, as measured here and learned from its steps.
        store: the store of past answers to use while settings.store is on, instead of the model's
        (the bench's cold or warm one). full_steps: every lookahead step carries the whole window
        and all candidates, unplanned (the paper's steps, as compiled ones are)."""
        from ladechat.engine import cost_envelope
        from ladechat.engine.decode import Session
        from ladechat.engine.runner import StaticRunner, compiled_forward

        self.loaded = loaded
        self.settings = settings
        self.compiled = compile
        self.store_root = store_root
        self._given_store = store
        self._grammar_tokens = None  # the tokenizer as a grammar reads it, made at the first format
        self._grammars: dict[str, str] = {}
        self._grammar_lock = threading.Lock()
        self.notices: list[str] = []  # shown before the next answer
        from ladechat.templates import NO_CHAT_TEMPLATE, has_chat_template

        if settings.template is None and not has_chat_template(loaded.tokenizer):
            self.notices.append(NO_CHAT_TEMPLATE)
        if settings.format is not None:
            self._grammar(settings.format)  # a schema that cannot be held to: one line now
        la = settings.lookahead_config()
        store = self._open_store() if la.store else None
        if compile:
            runner = StaticRunner(loaded.model, la, loaded.context_length, compiled=compiled_forward(loaded.model))
            self.session = Session(loaded.model, la, runner=runner, store=store)  # compiled at one count
        else:
            plan = None if full_steps else step_cost or cost_envelope.cost_model(loaded)
            self.session = Session(loaded.model, la, step_cost=plan, store=store, threads=loaded.threads)

    def check_format(self, answer_format: str) -> None:
        """GrammarError (one line) where this model cannot hold answers to the format (a server
        refuses such a request before it queues it)."""
        self._grammar(answer_format)

    def _grammar(self, answer_format: str) -> str:
        """The grammar of a format (Settings.format), checked against this model's tokenizer once:
        GrammarError, one line, for a schema it cannot hold answers to."""
        from ladechat.engine.grammar import GrammarTokenizer

        with self._grammar_lock:  # a server checks a request's format while its model thread answers
            grammar = self._grammars.pop(answer_format, None)
            if grammar is None:
                if self._grammar_tokens is None:
                    config = self.loaded.model.config.get_text_config()
                    self._grammar_tokens = GrammarTokenizer.of(self.loaded.tokenizer, config.vocab_size,
                                                               self.loaded.eos_ids)
                grammar = self._grammar_tokens.grammar(answer_format)
            self._grammars[answer_format] = grammar  # the most recently used last
            while len(self._grammars) > GRAMMARS_KEPT:  # a server's clients send schemas without end
                self._grammars.pop(next(iter(self._grammars)))
            return grammar

    def _matcher(self):
        """A fresh matcher for one answer in the settings' format, or None (any text)."""
        answer_format = self.settings.format
        if answer_format is None:
            return None
        grammar = self._grammar(answer_format)  # builds the grammar's tokenizer the first time
        return self._grammar_tokens.matcher(grammar, self.loaded.eos_ids)

    def _open_store(self):
        from ladechat.engine.draft.store import AnswerStore, StoreError, store_path

        if self._given_store is not None:
            return self._given_store
        vocab = self.loaded.model.config.get_text_config().vocab_size
        if self.store_root is None:
            return AnswerStore(vocab_size=vocab)
        path = store_path(self.store_root, self.loaded.name)
        try:
            return AnswerStore.open(path, self.loaded.name, vocab)
        except StoreError as exc:
            self.notices.append(f"{exc}; answers are remembered for this session only")
            return AnswerStore(vocab_size=vocab)

    stats_reported = True
    ready = True
    host = None

    @property
    def name(self) -> str:
        return self.loaded.name

    def describe(self) -> str:
        """The model, its device and dtype, which Linear weights and kernels run (when not all as
        transformers loads them) and what runs a step when not the model's own forward, e.g.
        '... on cpu (float32; 210 Linear from Q4_1 blocks (...); steps by engine/models/llama.py)'."""
        weights = f"; {self.loaded.weights}" if self.loaded.weights else ""
        steps = f"; steps by {self.session.runner.steps}" if self.session.runner.steps else ""
        dtype = str(self.loaded.dtype).removeprefix("torch.")
        return f"{self.loaded.name} on {self.loaded.device} ({dtype}{weights}{steps})"

    def configure(self, settings: Settings) -> None:
        from ladechat.templates import TemplateError, resolve

        try:
            resolve(self.loaded.tokenizer, settings.template)
        except TemplateError as exc:
            raise ConfigError(str(exc)) from None
        if settings.format is not None:
            self._grammar(settings.format)
        self.session.configure(settings.lookahead_config())  # first to change anything: it may refuse W/N/G
        if settings.store and self.session.store is None:
            self.session.store = self._open_store()
        self.settings = settings

    def clear_store(self) -> int:
        """Forget every answer this model's store holds (on disk too). Returns how many."""
        from ladechat.engine.draft.store import clear_stores

        store = self.session.store
        forgotten = store.answers if store is not None else 0
        if self.store_root is not None:
            forgotten = max(forgotten, sum(i.answers for i in clear_stores(self.store_root, self.loaded.name)))
        if store is not None:
            self._given_store = None
            self.session.store = self._open_store()
        return forgotten

    def new_conversation(self) -> None:
        """Answer the next question as a fresh chat would: its drafts learned from nothing but the
        store of past answers (the cache, the n-gram pool, the recycled successors and the
        acceptance rates forgotten; the step costs and the store kept)."""
        self.session.reset()

    def warm_up(self) -> None:
        """With compile: build the step graphs for the current W/N/G now rather than mid-answer."""
        self.session.warm_up()

    def prompt_ids(self, conversation: Conversation) -> tuple[list[int], int]:
        budget = prompt_budget(self.loaded.context_length, self.settings.max_new_tokens)
        return conversation.encode(self.loaded.tokenizer, self.settings.template, budget)

    def reply(self, conversation: Conversation) -> Iterator[Notice | Piece | Done]:
        """Answer the conversation's last user message. Oldest turns are dropped (with a Notice)
        when the conversation no longer fits the context."""
        ids, dropped = self.prompt_ids(conversation)
        while self.notices:
            yield Notice(self.notices.pop(0))
        if dropped:
            yield Notice(dropped_notice(dropped, "model's"))
        room = self.loaded.context_length - len(ids)
        sampling = self.settings.sampling_config()
        if sampling.max_new_tokens > room:
            sampling = replace(sampling, max_new_tokens=room)
        grown = self.session.grows_for(len(ids) + sampling.max_new_tokens)
        if grown is not None:  # generate() grows it before its first step: say why that step waits
            yield Notice(f"growing the KV cache to {grown} tokens for this turn"
                         + ("; compiling its steps (once per length)" if self.compiled else ""))
        from ladechat.backends.detok import StepText
        from ladechat.engine.decode import generate

        tokenizer = self.loaded.tokenizer
        text = StepText(tokenizer)

        def with_text(done: Done) -> Done:
            return replace(done, text=tokenizer.decode(list(done.text_tokens), skip_special_tokens=True),
                           stats=replace(done.stats, context_length=self.loaded.context_length))

        run = generate(self.session, ids, sampling, self.loaded.eos_ids, tokenizer.decode, self._matcher())
        try:
            for event in run:
                if isinstance(event, Done):
                    yield with_text(event)
                else:
                    yield from text.pieces(event)
        except KeyboardInterrupt:
            # Ctrl-C between steps (the front end threw it in here, or it landed while a step's text
            # was decoded): generate ends the answer as if it had landed in a step
            yield with_text(run.throw(KeyboardInterrupt()))
