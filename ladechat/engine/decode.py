"""The decoding loop: one forward pass per step, lookahead on or off, as a stream of events.

    Session.step(t):
      window    -> the Jacobi window's levels from t (draft/window.py)
      plan      -> draft tree from the conversation's and the store's suffix matches, pool
                   n-grams and recycled top-k (draft/tree.py), cut to the nodes worth their cost;
                   window columns ride along when ~free (no side effects: the layout only)
      forward   -> one call over t + window + draft, 4D mask from layout.py; every row's top-k
      verify    -> the longest draft path that equals the model's own choices, + bonus token
      harvest   -> acceptance statistics per draft bucket, every row's top-k into the successor
                   table, the window's new guesses (one n-gram per column into the pool)
      cut       -> the stop rules (EOS, stop strings, max_new_tokens) keep a prefix of the block
      commit    -> keep the KV of t and the kept accepted rows, drop the rest
    generate(): the loop around Session.step, as Step events, then Done.

With lookahead off (or nothing worth feeding but t) a step is a plain one-token forward pass, so
the chat can toggle lookahead between turns without changing anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.cost_envelope import CostEnvelope
from ladechat.engine.draft.pool import NGramPool
from ladechat.engine.draft.recycle import SuccessorTable
from ladechat.engine.draft.store import AnswerStore
from ladechat.engine.draft.suffix import SuffixIndex
from ladechat.engine.draft.tree import Acceptance, DraftTree, worth_feeding
from ladechat.engine.draft.window import JacobiWindow
from ladechat.engine.events import Done, OutOfMemory, Step, Tally
from ladechat.engine.grammar import Matcher, constrained_pick
from ladechat.engine.layout import StepLayout, tree_layout
from ladechat.engine.runner import default_runner, max_step_size, top_k
from ladechat.engine.sampling import TokenPicker
from ladechat.engine.step_cost import CostModel
from ladechat.engine.stopping import StopRule
from ladechat.engine.threads import CpuThreads
from ladechat.engine.verify import batched_pick, verify

# Window columns ride along only where the cost curve says they are (nearly) free: at most 1% more
# step cost, as on a flat curve. On a CPU that is practically never, and rightly: with more slack
# the window rows' n-grams rarely won and cost tokens/s on the tuning prompts (measured:
# BENCHMARKS.md). Full steps (a GPU) carry the whole window regardless.
WINDOW_SLACK = 0.01
PROBE_EVERY = 8  # while no draft node looks worth its cost, still feed the likeliest every 8th step
HITS_PER_CANDIDATE = 4  # conversation hits counted into the draft per context candidate (draft.add_matches)
STORE_HITS = 8  # hits in the store of past answers counted into the draft


def _is_out_of_memory(exc: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator raises a plain RuntimeError.
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


class Session:
    """Decoding state that outlives one answer, in three parts: the conversation (the KV cache,
    which the runner owns, the tokens it holds and their suffix index), the draft sources (the
    n-gram pool and the Jacobi window that fills it, the recycled successors) and what was learned
    (acceptance rates; the step costs, when they learn). `store`, the model's past answers,
    outlives the session (it is shared, and persisted by its owner); the session drafts from it and
    adds each answer to it while lookahead.store is on.

    A chat keeps one Session, so later turns reuse the cached prefix of the conversation and what
    earlier turns taught the drafts. The cache always holds exactly `cached` (every committed
    token but the last, which is the next step's input). The runner owns the cache and the
    forward call (runner.py); with a fixed-shape runner every lookahead step is a full one.
    """

    def __init__(self, model, lookahead: LookaheadConfig,
                 step_cost: CostEnvelope | CostModel | None = None, runner=None,
                 store: AnswerStore | None = None, clock: Callable[[], float] = time.perf_counter,
                 threads: CpuThreads | None = None) -> None:
        """step_cost: a CostEnvelope learns from the steps it times with `clock`; a CostModel plans
        every step from the same fixed costs. threads: sets the CPU thread count before each
        forward pass from the machine's other load (threads.py); None leaves torch's as it is."""
        self.model = model
        self.clock = clock
        self.threads = threads
        self.store = store
        self.runner = runner or default_runner(model)
        self.runner.configure(lookahead)
        # None: every lookahead step is a full one (a fixed-shape runner pads every step anyway)
        self.step_cost: CostEnvelope | CostModel | None = None if self.runner.fixed else step_cost
        self.lookahead = lookahead
        self._new_conversation()

    def _new_conversation(self) -> None:
        la = self.lookahead
        self.cached: list[int] = []
        self.history: list[int] = []  # the conversation's tokens: the prompt and what was committed
        self.answer: list[int] = []  # the answer in progress: the end of history since the prompt
        self.context = SuffixIndex()  # the same tokens, indexed for suffix matches
        self.pool = NGramPool(la.ngram, la.candidates)
        self.window = JacobiWindow(la.window, la.ngram)
        self.recycled = SuccessorTable()
        self.acceptance = Acceptance()
        self.skipped = 0  # steps in a row that fed no draft node

    def configure(self, lookahead: LookaheadConfig) -> None:
        """Apply new W/N/G: the pool survives a change of W, the window a change of G only."""
        old = self.lookahead
        self.runner.configure(lookahead)  # first: it may refuse a step too large for its fixed shape
        if (old.ngram, old.candidates) != (lookahead.ngram, lookahead.candidates):
            pool = NGramPool(lookahead.ngram, lookahead.candidates)
            pool.seed(self.history)
            self.pool = pool
        if (old.window, old.ngram) != (lookahead.window, lookahead.ngram):
            self.window.resize(lookahead.window, lookahead.ngram)
        self.lookahead = lookahead

    def reset(self) -> None:
        """Forget the conversation (cache, context, pool, window, recycled successors, acceptance
        rates) but keep the settings, the step costs and the store."""
        self.runner.reset()
        self._new_conversation()

    def warm_up(self) -> None:
        """Compile a fixed-shape runner's step graphs now (no-op for the default runner)."""
        if self.runner.fixed:
            self.runner.warm_up(len(self.cached))

    def grows_for(self, tokens: int) -> int | None:
        """The KV cache length that reserve(tokens) would grow to, None if it needs no growing."""
        return self.runner.grows_for(tokens)

    def reserve(self, tokens: int) -> None:
        """Make room in the KV cache for a turn that ends at `tokens` tokens, before it starts
        (a fixed-shape runner grows and compiles here rather than mid-answer)."""
        self.runner.reserve(tokens, len(self.cached))

    # -- an answer's start and end ------------------------------------------------------------
    def sync_prompt(self, prompt: list[int]) -> tuple[int, float]:
        """Make the cache hold prompt[:-1], reusing its common prefix, and start an answer to it.
        Returns (prefilled, seconds)."""
        start = time.perf_counter()
        keep = _common_prefix(self.cached, prompt[:-1])
        self.runner.truncate(keep)
        self.cached = self.cached[:keep]
        todo = prompt[keep:-1]
        if todo:
            ranked = self.lookahead.enabled and self.lookahead.recycle > 0
            if self.threads:
                self.threads.adjust()
            top = self.runner.prefill(todo, keep, ranked=ranked)
            self.cached = list(prompt[:-1])
            if ranked:  # the model's own ranking of what follows each prompt token
                first = len(prompt) - 1 - len(top)  # position of the first ranked token
                before = [prompt[i - 1] if i else -1 for i in range(first, len(prompt) - 1)]
                self.recycled.update(prompt[first:-1], top, before)
        seen = _common_prefix(self.history, prompt)
        self.history[seen:] = prompt[seen:]
        self.answer = []
        self.context.truncate(seen)
        self.context.extend(prompt[seen:])
        if self.lookahead.seed_pool:
            self.pool.seed(prompt[max(0, seen - self.lookahead.ngram) :])
        return len(todo), time.perf_counter() - start

    def rollback(self) -> None:
        """Drop what a step that did not finish (Ctrl-C, out of memory) wrote into the cache: the
        session is then as it was after the last committed step."""
        self.runner.truncate(len(self.cached))

    def end_answer(self, answer: list[int]) -> None:
        """An answer ended (also one cut short: it is still the model's own text): keep what the
        step costs taught, add the answer to the store."""
        if isinstance(self.step_cost, CostEnvelope):
            self.step_cost.persist()
        if self.store is not None and self.lookahead.store:
            self.store.add(answer)

    # -- planning -----------------------------------------------------------------------------
    def draft(self, t: int, matcher: Matcher | None = None) -> DraftTree:
        """Every source's proposals for what follows t, merged into one priced trie; under a grammar
        (matcher), only what it allows, and what it forces as one more proposal."""
        la = self.lookahead
        tree = DraftTree(self.acceptance)
        if matcher is not None:
            forced = matcher.forced()
            if forced:
                tree.add_chain(tuple(forced), "grammar", 0)
        hits = la.context_candidates * HITS_PER_CANDIDATE
        tree.add_matches("context", self.context.matches(self.history, la.context_len, hits))
        if self.store is not None and la.store:
            tree.add_matches("store", self.store.matches(self.history, la.context_len, STORE_HITS))
        for gram in self.pool.get(t)[: la.candidates]:
            tree.add_chain(gram, "pool", 0)
        if la.recycle:
            tree.add_recycled(t, self._before_t(), self.recycled.lookup, la.recycle)
        if matcher is not None:
            tree.keep_valid(matcher.valid_prefix)
        return tree

    def _before_t(self) -> int:
        """The token before the step's input t (history ends with t), -1 if none."""
        return self.history[-2] if len(self.history) >= 2 else -1

    def probe_size(self) -> int | None:
        """The size of step the cost envelope wants run now to test the measured costs, if any."""
        if not isinstance(self.step_cost, CostEnvelope) or not self.lookahead.enabled:
            return None
        return self.step_cost.probe_size(max_step_size(self.lookahead))

    def plan(self, t: int, window: list[list[int]], probe: int | None = None, skipped: int = 0,
             matcher: Matcher | None = None) -> tuple[StepLayout, int]:
        """The step's layout from t and the window's levels, and how many steps in a row (skipped
        before it) will then have fed no draft node. Changes nothing.

        Full steps (no cost model: a GPU or fixed-shape runner): the whole window and the likeliest
        draft nodes up to the step's size. Cost-sized steps (a CPU): the draft nodes that maximise
        expected tokens per second under the measured step-cost curve at the current cache length,
        and window columns only where they add (nearly) nothing to its cost (WINDOW_SLACK). On a small
        CPU that is often a handful of nodes, and a plain step when nothing is worth feeding; every
        PROBE_EVERY-th such step still feeds the likeliest node, to keep the acceptance estimates honest.
        probe: a step of about this many rows instead, the likeliest nodes first (probe_size()).
        matcher: the grammar the answer is held to: the draft proposes only what it allows (draft()).
        """
        la = self.lookahead
        tree = self.draft(t, matcher)
        levels = len(window)
        if self.step_cost is None:
            room = max_step_size(la) - la.window * levels
            return tree_layout(window, worth_feeding(tree, None, limit=room)), skipped
        cached, known = len(self.cached), {}

        def cost(size: int) -> float:  # asked for ~30 times a plan, of a few sizes
            if size not in known:
                known[size] = self.step_cost.cost(size, cached)
            return known[size]
        if probe is not None:
            return probe_layout(window, worth_feeding(tree, None, limit=probe - 1), probe), skipped
        nodes = worth_feeding(tree, cost)
        skipped = 0 if nodes else skipped + 1
        if skipped and skipped % PROBE_EVERY == 0:
            nodes = worth_feeding(tree, None, limit=1)
        alone = 1 + len(nodes)
        for columns in range(len(window[0]), 0, -1):
            if columns == 1 and levels == 1:
                break
            if cost(alone + columns * levels - 1) <= cost(alone) * (1 + WINDOW_SLACK):
                return tree_layout([level[:columns] for level in window], nodes), skipped
        return tree_layout([[t]], nodes), skipped

    # -- one step -----------------------------------------------------------------------------
    def step(self, t: int, picker: TokenPicker, stop: StopRule, matcher: Matcher | None = None) -> Step:
        """One step from t, its phases in order (see the module's docstring). matcher: the grammar
        the answer is held to (engine/grammar.py), which follows the tokens the step commits."""
        la = self.lookahead
        past = len(self.cached)
        probe = self.probe_size()
        if la.enabled:
            window = self.window.fill(t, self._before_t(), self.history, self.recycled.lookup)
            layout, self.skipped = self.plan(t, window, probe, self.skipped, matcher)
        else:
            layout = tree_layout([[t]], [])
        if self.threads:
            self.threads.adjust(layout.size)
        start = self.clock()
        logits = self.runner.step(layout, past)
        top = top_k(logits)  # one host sync
        if isinstance(self.step_cost, CostEnvelope):  # timed as step_cost.time_step times a step
            self.step_cost.observe(layout.size, past, self.clock() - start, probe)
        if matcher is None:
            block, matched, source = verify(layout, self._pick(layout, logits, top, picker))
        else:
            pick, undo = constrained_pick(matcher, logits, top, picker, self.history)
            block, matched, source = verify(layout, pick)
            undo()
        if la.enabled:
            self._learn(layout, matched, top)
            if layout.window_rows > 1:  # the window advances by argmax, as in the paper, also when sampling
                self.window.advance([int(top[row, 0]) for row in layout.last_level], self.pool)
        keep, why = stop.cut(self.answer, block)
        block, matched = block[:keep], matched[: keep - 1]
        if matcher is not None:
            matcher.consume([token for token in block if token not in stop.eos_ids])
        self._commit(t, past, block, matched)
        guessed = tuple(i < len(matched) for i in range(len(block)))
        source = (source if matched else "none") if self.lookahead.enabled else "plain"
        return Step(tuple(block), guessed, source, layout.size, 0.0, why)

    def _pick(self, layout: StepLayout, logits: torch.Tensor, top, picker: TokenPicker):
        """verify's pick(row, path): the model's choice at a row, the path being the draft tokens
        verified before it."""
        history = self.history
        if picker.plain_argmax:
            argmax = top[:, 0].tolist()
            return lambda row, path: argmax[row]
        if logits.device.type == "cpu":  # nothing to transfer: penalize and sample only the rows visited
            return lambda row, path: picker.pick(logits[row], history + path)
        # every row verify could visit at once, one transfer instead of one wait per row
        return batched_pick(layout, logits, picker, history)

    def _learn(self, layout: StepLayout, matched: list[int], top) -> None:
        """Harvest what the step computed: acceptance per draft bucket, and every row's top-k into
        the successor table (accepted rows last: their context is the real one)."""
        on_path = {0, *matched}
        first = layout.window_rows
        for i, node in enumerate(layout.nodes):
            parent_row = 0 if node.parent < 0 else first + node.parent
            if parent_row in on_path:  # its parent was accepted: a fair trial of its bucket
                self.acceptance.record(node.bucket, first + i in on_path)
        order = [row for row in range(layout.size) if row not in on_path] + [0, *matched]
        tokens = layout.tokens
        before = [tokens[layout.parents[row]] if row else self._before_t() for row in order]
        self.recycled.update([tokens[row] for row in order], top[order], before)

    def _commit(self, t: int, past: int, block: list[int], matched: list[int]) -> None:
        """Keep the KV of t and of the matched rows, and the block's tokens in the conversation."""
        self.runner.commit(past, [0] + matched)
        self.cached += [t] + block[:-1]
        self.history += block
        self.answer += block
        self.context.extend(block)


def generate(session: Session, prompt: list[int], sampling: SamplingConfig, eos_ids: frozenset[int],
             decode=None, matcher: Matcher | None = None) -> Iterator[Step | Done]:
    """Stream the answer to `prompt` (the full conversation's token ids) as Step events, then Done.
    matcher: a grammar the answer is held to (engine/grammar.py), fresh for this answer.

    KeyboardInterrupt inside a forward pass leaves the session consistent (the half-done step is
    dropped) and ends the stream with finish_reason "interrupted". Running out of memory does the
    same, then raises OutOfMemory (the tokens streamed so far stay valid).
    """
    if not prompt:
        raise ValueError("empty prompt")
    la = session.lookahead
    picker = TokenPicker(sampling)
    stop = StopRule(eos_ids, sampling.max_new_tokens, sampling.stop, decode)
    tally, learned = Tally(), session.acceptance.snapshot()
    start = time.perf_counter()
    ttft, reason, prefill_tokens, prefill_s = 0.0, "length", 0, 0.0
    try:
        session.reserve(len(prompt) + sampling.max_new_tokens)  # grow (and compile) before the clock starts
        start = time.perf_counter()
        prefill_tokens, prefill_s = session.sync_prompt(prompt)
        t = prompt[-1]
        while True:
            step_start = time.perf_counter()
            step = session.step(t, picker, stop, matcher)
            t, now = step.tokens[-1], time.perf_counter()
            step = replace(step, seconds=now - step_start)
            tally.add(step)
            ttft = now - start if tally.steps == 1 else ttft
            yield step
            if step.stop is not None:
                reason = step.stop
                break
    except KeyboardInterrupt:
        session.rollback()
        reason = "interrupted"
    except (RuntimeError, MemoryError) as exc:
        if not _is_out_of_memory(exc):
            raise
        raise out_of_memory(session, len(tally.tokens)) from None
    total = time.perf_counter() - start
    session.end_answer(tally.tokens)
    yield Done(tuple(tally.tokens), tally.stats(
        prompt_tokens=len(prompt), prefill_tokens=prefill_tokens, prefill_s=prefill_s, ttft_s=ttft,
        decode_s=total - prefill_s, total_s=total, pool_size=len(session.pool), lookahead=la.enabled,
        window=la.window, ngram=la.ngram, candidates=la.candidates, finish_reason=reason,
        calibration=session.acceptance.since(learned)))


def out_of_memory(session: Session, new_tokens: int) -> OutOfMemory:
    """The session after a step that ran out of memory: rolled back, its device's cached memory
    returned; and the error that says where it happened."""
    session.rollback()
    device = session.model.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return OutOfMemory(f"out of memory on {device} after {new_tokens} new tokens, with "
                       f"{len(session.cached)} tokens in the KV cache")


def probe_layout(window: list[list[int]], nodes: list, size: int) -> StepLayout:
    """A step of about `size` rows: the draft nodes given, then as many window columns as fit."""
    levels = len(window)
    for columns in range(len(window[0]), 0, -1):
        if columns * levels + len(nodes) <= size:
            return tree_layout([level[:columns] for level in window], nodes)
    return tree_layout([window[0][:1]], nodes)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
