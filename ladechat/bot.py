"""A loaded model plus its decoding session: turns a Conversation into a stream of events."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ladechat.conversation import Conversation
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done, Step
from ladechat.engine.loading import LoadedModel
from ladechat.engine.runner import StaticRunner
from ladechat.settings import Settings


@dataclass(frozen=True)
class Notice:
    """Something the user should see that is not part of the answer (e.g. turns dropped)."""

    text: str


class Bot:
    """compile: fixed-shape steps on a pre-allocated cache, compiled (see engine/runner.py); every
    lookahead step is then a full one, so it suits a GPU, where a full step costs about one token's."""

    def __init__(self, loaded: LoadedModel, settings: Settings, compile: bool = False) -> None:
        self.loaded = loaded
        self.settings = settings
        self.compiled = compile
        la = settings.lookahead_config()
        if compile:
            runner = StaticRunner(loaded.model, la, loaded.context_length, compile=True)
            self.session = Session(loaded.model, la, runner=runner)
        else:
            self.session = Session(loaded.model, la, step_cost=loaded.cost_model())

    def configure(self, settings: Settings) -> None:
        self.session.configure(settings.lookahead_config())  # first: it may refuse W/N/G
        self.settings = settings

    def warm_up(self) -> None:
        """With compile: build the step graphs for the current W/N/G now rather than mid-answer."""
        self.session.warm_up()

    def prompt_ids(self, conversation: Conversation) -> tuple[list[int], int]:
        budget = self.loaded.context_length - min(self.settings.max_new_tokens,
                                                  self.loaded.context_length // 2)
        return conversation.encode(self.loaded.tokenizer, self.settings.template, budget)

    def reply(self, conversation: Conversation) -> Iterator[Notice | Step | Done]:
        """Answer the conversation's last user message. Oldest turns are dropped (with a Notice)
        when the conversation no longer fits the context."""
        ids, dropped = self.prompt_ids(conversation)
        if dropped:
            yield Notice(f"the conversation no longer fits the model's context: dropped the oldest "
                         f"{dropped} message{'s' if dropped > 1 else ''}")
        room = self.loaded.context_length - len(ids)
        sampling = self.settings.sampling_config()
        if sampling.max_new_tokens > room:
            sampling = replace(sampling, max_new_tokens=room)
        yield from generate(self.session, ids, sampling, self.loaded.eos_ids, self.loaded.tokenizer.decode)
