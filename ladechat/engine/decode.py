"""The decoding loop: one forward pass per step, lookahead on or off, as a stream of events.

    Session.step(t):
      plan      -> draft tree from the conversation's and the store's suffix matches, pool
                   n-grams and recycled top-k (draft.py),
                   cut to the nodes worth their cost; window columns ride along when ~free
      forward   -> one call over t + window + draft, 4D mask from layout.py
      verify    -> the longest draft path that equals the model's own choices, + bonus token
      harvest   -> every row's top-k into the successor table; the last window level's argmax
                   into the pool (one n-gram per column); acceptance statistics per draft bucket
      cut       -> the stop rules (EOS, stop strings, max_new_tokens) keep a prefix of the block
      commit_kv -> keep t and the kept accepted rows, drop the rest
    generate(): events and statistics around Session.step.

With lookahead off (or nothing worth feeding but t) a step is a plain one-token forward pass, so
the chat can toggle lookahead between turns without changing anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.cost_envelope import CostEnvelope
from ladechat.engine.draft import Acceptance, DraftTree, choose
from ladechat.engine.events import Done, OutOfMemory, Step, Tally
from ladechat.engine.layout import StepLayout, tree_layout
from ladechat.engine.ngram_pool import NGramPool
from ladechat.engine.recycle import SuccessorTable
from ladechat.engine.runner import DynamicRunner, max_step_size, top_k
from ladechat.engine.sampling import Chooser
from ladechat.engine.step_cost import CostModel
from ladechat.engine.stopping import StopRule
from ladechat.engine.store import AnswerStore
from ladechat.engine.suffix import SuffixIndex

# Window columns ride along only where the cost curve says they are (nearly) free: at most 1% more
# step cost, as on a flat curve. On a CPU (each extra row +2-5%) that is practically never, and
# rightly: allowing them 10% more step cost fed ~2 window rows most steps, whose n-grams won 3 of
# ~500 steps, and took 10-20% off tokens/s on the tuning prompts (bf16, 9 prompts x 128 tokens:
# 43-44 tok/s with, 48-53 without). Full steps (a GPU) carry the whole window regardless.
WINDOW_SLACK = 0.01
PROBE_EVERY = 8  # while no draft node looks worth its cost, still feed the likeliest every 8th step
HITS_PER_CANDIDATE = 4  # conversation hits counted into the draft per context candidate (draft.add_matches)
STORE_HITS = 8  # hits in the store of past answers counted into the draft


@dataclass(frozen=True)
class StepResult:
    """What one Session.step committed."""

    tokens: tuple[int, ...]  # accepted guesses then the model's own (bonus) token, cut by the stop rule
    guessed: tuple[bool, ...]  # per token: a verified guess
    source: str  # the source of the accepted guesses ("none" if no guess was accepted)
    fed: int  # rows in the forward pass
    stop: str | None  # why generation ends here, None if it goes on


def _is_out_of_memory(exc: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator raises a plain RuntimeError.
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


class Session:
    """Decoding state that outlives one answer: KV cache, the tokens it holds, the conversation's
    index, pool, window, recycled successors and the learned acceptance rates. `store`, the
    model's past answers, outlives the session (it is shared, and persisted by its owner); the
    session drafts from it and adds each answer to it while lookahead.store is on.

    A chat keeps one Session, so later turns reuse the cached prefix of the conversation and what
    earlier turns taught the drafts. The cache always holds exactly `cached` (every committed
    token but the last, which is the next step's input). The runner owns the cache and the
    forward call (runner.py); with a fixed-shape runner every lookahead step is a full one.
    """

    def __init__(self, model, lookahead: LookaheadConfig,
                 step_cost: CostEnvelope | CostModel | None = None, runner=None,
                 store: AnswerStore | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        """step_cost: a CostEnvelope learns from the steps it times with `clock`; a CostModel plans
        every step from the same fixed costs."""
        self.model = model
        self.clock = clock
        self.store = store
        self.runner = runner or DynamicRunner(model)
        self.runner.configure(lookahead)
        if self.runner.fixed:
            step_cost = None  # every step is padded to full size anyway
        self.step_cost: CostEnvelope | CostModel | None = step_cost  # None: every lookahead step is a full one
        self.skipped = 0  # steps in a row that fed no draft node
        self.cached: list[int] = []
        self.history: list[int] = []  # the conversation's tokens: the prompt and what was committed
        self.context = SuffixIndex()  # the same tokens, indexed for suffix matches
        self.lookahead = lookahead
        self.pool = NGramPool(lookahead.ngram, lookahead.candidates)
        self.recycled = SuccessorTable()
        self.acceptance = Acceptance()
        self.window: list[list[int]] | None = None
        self.window_age = 0  # steps since the window was filled; n-grams are harvested after N-2
        self.rng = torch.Generator().manual_seed(0)  # window fill: deterministic runs

    def configure(self, lookahead: LookaheadConfig) -> None:
        """Apply new W/N/G: the pool survives a change of W, the window a change of G only."""
        old = self.lookahead
        self.runner.configure(lookahead)  # first: it may refuse a step too large for its fixed shape
        if (old.ngram, old.candidates) != (lookahead.ngram, lookahead.candidates):
            pool = NGramPool(lookahead.ngram, lookahead.candidates)
            pool.seed(self.history)
            self.pool = pool
        if (old.window, old.ngram) != (lookahead.window, lookahead.ngram):
            self.window = None
        self.lookahead = lookahead

    def reset(self) -> None:
        """Forget the conversation (cache, context, pool, window, recycled successors) but keep the
        settings."""
        self.runner.reset()
        self.__init__(self.model, self.lookahead, self.step_cost, self.runner, self.store, self.clock)

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

    # -- prefix reuse -------------------------------------------------------------------------
    def sync_prompt(self, prompt: list[int]) -> tuple[int, float]:
        """Make the cache hold prompt[:-1], reusing its common prefix. Returns (prefilled, seconds)."""
        start = time.perf_counter()
        keep = _common_prefix(self.cached, prompt[:-1])
        self.runner.truncate(keep)
        self.cached = self.cached[:keep]
        todo = prompt[keep:-1]
        if todo:
            ranked = self.lookahead.enabled and self.lookahead.recycle > 0
            top = self.runner.prefill(todo, keep, ranked=ranked)
            self.cached = list(prompt[:-1])
            if ranked:  # the model's own ranking of what follows each prompt token
                first = len(prompt) - 1 - len(top)  # position of the first ranked token
                before = [prompt[i - 1] if i else -1 for i in range(first, len(prompt) - 1)]
                self.recycled.update(prompt[first:-1], top, before)
        seen = _common_prefix(self.history, prompt)
        self.history[seen:] = prompt[seen:]
        self.context.truncate(seen)
        self.context.extend(prompt[seen:])
        if self.lookahead.seed_pool:
            self.pool.seed(prompt[max(0, seen - self.lookahead.ngram) :])
        return len(todo), time.perf_counter() - start

    # -- the window ---------------------------------------------------------------------------
    def _window_for(self, t: int) -> list[list[int]]:
        la = self.lookahead
        if self.window is None:
            # All N-1 levels are filled at once (not with N-2 warm-up steps), so every step has
            # the same shape and the first steps already verify drafts. Level l, column j guesses
            # position p+l+j: the model's recycled top-1 chain from t where it has one (the
            # window then starts near the model's own trajectory), else conversation tokens.
            # Its n-grams are junk until each level has been recomputed once, so harvesting
            # waits N-2 steps (window_age).
            chain, prev, tok = [], self._before_t(), t
            source = self.history or [t]
            for _ in range(la.window + la.ngram - 2):
                nxt, _ = self.recycled.lookup(prev, tok)
                prev, tok = tok, nxt[0] if nxt else source[int(torch.randint(len(source), (1,), generator=self.rng))]
                chain.append(tok)
            self.window = [[t] + chain[: la.window - 1]] + [chain[level - 1 : level - 1 + la.window]
                                                            for level in range(1, la.ngram - 1)]
            self.window_age = 0
        self.window[0][0] = t
        return self.window

    def _harvest_and_shift(self, new_tokens: list[int]) -> None:
        """Pool the n-gram of each computed column, then move those columns down one level.

        A step may carry only the first k columns (see plan); the others keep their guesses.
        """
        window, k = self.window, len(new_tokens)
        if self.window_age >= len(window) - 1:
            for col, last in enumerate(new_tokens):
                gram = [level[col] for level in window] + [last]
                self.pool.add(gram[0], tuple(gram[1:]))
        for level in range(len(window) - 1):
            window[level][:k] = window[level + 1][:k]
        window[-1][:k] = new_tokens
        self.window_age += 1

    # -- planning -----------------------------------------------------------------------------
    def draft(self, t: int) -> DraftTree:
        """Every source's proposals for what follows t, merged into one priced trie."""
        la = self.lookahead
        tree = DraftTree(self.acceptance)
        hits = la.context_candidates * HITS_PER_CANDIDATE
        tree.add_matches("context", self.context.matches(self.history, la.context_len, hits))
        if self.store is not None and la.store:
            tree.add_matches("store", self.store.matches(self.history, la.context_len, STORE_HITS))
        for gram in self.pool.get(t)[: la.candidates]:
            tree.add_chain(gram, "pool", 0)
        if la.recycle:
            tree.add_recycled(t, self._before_t(), self.recycled.lookup, la.recycle)
        return tree

    def _before_t(self) -> int:
        """The token before the step's input t (history ends with t), -1 if none."""
        return self.history[-2] if len(self.history) >= 2 else -1

    def probe_size(self) -> int | None:
        """The size of step the cost envelope wants run now to test the measured costs, if any."""
        if not isinstance(self.step_cost, CostEnvelope) or not self.lookahead.enabled:
            return None
        return self.step_cost.probe_size(max_step_size(self.lookahead))

    def plan(self, t: int, probe: int | None = None) -> StepLayout:
        """The step's layout.

        Full steps (no cost model: a GPU or fixed-shape runner): the whole window and the likeliest
        draft nodes up to the step's size. Cost-sized steps (a CPU): the draft nodes that maximise
        expected tokens per second under the measured step-cost curve at the current cache length,
        and window columns only where they add (nearly) nothing to its cost (WINDOW_SLACK). On a small
        CPU that is often a handful of nodes, and a plain step when nothing is worth feeding.
        probe: a step of about this many rows instead, the likeliest nodes first (probe_size()).
        """
        la = self.lookahead
        tree = self.draft(t)
        window = self._window_for(t)
        levels = len(window)
        if self.step_cost is None:
            room = max_step_size(la) - la.window * levels
            return tree_layout(window, choose(tree, None, limit=room))
        cached = len(self.cached)
        cost = lambda size: self.step_cost.cost(size, cached)  # noqa: E731
        if probe is not None:
            return probe_layout(window, choose(tree, None, limit=probe - 1), probe)
        nodes = choose(tree, cost)
        if nodes:
            self.skipped = 0
        else:
            self.skipped += 1
            if self.skipped % PROBE_EVERY == 0:  # keep the acceptance estimates honest
                nodes = choose(tree, None, limit=1)
        alone = 1 + len(nodes)
        for columns in range(len(window[0]), 0, -1):
            if columns == 1 and levels == 1:
                break
            if cost(alone + columns * levels - 1) <= cost(alone) * (1 + WINDOW_SLACK):
                return tree_layout([level[:columns] for level in window], nodes)
        return tree_layout([[t]], nodes)

    # -- one step -----------------------------------------------------------------------------
    def step(self, t: int, chooser: Chooser, cut: Callable[[list[int]], tuple[int, str | None]]) -> StepResult:
        """Plan, run one forward pass, verify, harvest and commit. `cut(block)` says how many of
        the block's tokens to keep and whether generation stops there (stop rules)."""
        la = self.lookahead
        past = len(self.cached)
        probe = self.probe_size()
        layout = self.plan(t, probe) if la.enabled else tree_layout([[t]], [])
        start = self.clock()
        logits = self.runner.step(layout, past)
        top = top_k(logits)  # one host sync
        if isinstance(self.step_cost, CostEnvelope):  # timed as step_cost.measure times a step
            self.step_cost.observe(layout.size, past, self.clock() - start, probe)
        argmax = top[:, 0].tolist()
        history = self.history
        if chooser.plain_argmax:
            pick = lambda row, path: argmax[row]  # noqa: E731
        elif logits.device.type == "cpu":  # nothing to transfer: penalize and sample only the rows visited
            pick = lambda row, path: chooser.pick(logits[row], history + path)  # noqa: E731
        else:  # every row verify could visit at once, one transfer instead of one wait per row
            pick = batched_pick(layout, logits, chooser, history)
        block, matched, source = verify(layout, pick)
        if la.enabled:
            self._learn(layout, matched, top)
        keep, why = cut(block)
        block = block[:keep]
        self.runner.commit(past, [0] + matched[: keep - 1])
        self.cached += [t] + block[:-1]
        self.history += block
        self.context.extend(block)
        guessed = tuple(i < min(len(matched), keep - 1) for i in range(len(block)))
        return StepResult(tuple(block), guessed, source if any(guessed) else "none", layout.size, why)

    def _learn(self, layout: StepLayout, matched: list[int], top) -> None:
        """Harvest what the step computed: acceptance per draft bucket, every row's top-k into the
        successor table (accepted rows last: their context is the real one), window n-grams."""
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
        if layout.window_rows > 1:
            # The window always advances by argmax, as in the paper, also when sampling.
            self._harvest_and_shift([int(top[row, 0]) for row in layout.last_level])


def generate(session: Session, prompt: list[int], sampling: SamplingConfig, eos_ids: frozenset[int],
             decode=None) -> Iterator[Step | Done]:
    """Stream the answer to `prompt` (the full conversation's token ids) as Step events, then Done.

    KeyboardInterrupt inside a forward pass leaves the session consistent (the half-done step is
    dropped) and ends the stream with finish_reason "interrupted". Running out of memory does the
    same, then raises OutOfMemory (the tokens streamed so far stay valid).
    """
    if not prompt:
        raise ValueError("empty prompt")
    la = session.lookahead
    device = session.model.device
    chooser = Chooser(sampling)
    stop = StopRule(eos_ids, sampling.max_new_tokens, sampling.stop, decode)
    start = time.perf_counter()
    tally = Tally()
    generated = tally.tokens
    predicted_before = dict(session.acceptance.predicted)
    observed_before = dict(session.acceptance.observed)
    ttft = 0.0
    reason = "length"
    prefill_tokens, prefill_s = 0, 0.0
    try:
        session.reserve(len(prompt) + sampling.max_new_tokens)  # grow (and compile) before the clock starts
        start = time.perf_counter()
        prefill_tokens, prefill_s = session.sync_prompt(prompt)
        t = prompt[-1]
        while True:
            step_start = time.perf_counter()
            result = session.step(t, chooser, lambda block: stop.cut(generated, block))
            t = result.tokens[-1]
            now = time.perf_counter()
            step = Step(result.tokens, result.guessed, result.source if la.enabled else "plain", result.fed,
                        now - step_start)
            tally.add(step)
            if tally.steps == 1:
                ttft = now - start
            yield step
            if result.stop is not None:
                reason = result.stop
                break
    except KeyboardInterrupt:
        session.runner.truncate(len(session.cached))
        reason = "interrupted"
    except (RuntimeError, MemoryError) as exc:
        if not _is_out_of_memory(exc):
            raise
        session.runner.truncate(len(session.cached))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise OutOfMemory(f"out of memory on {device} after {len(generated)} new tokens, with "
                          f"{len(session.cached)} tokens in the KV cache") from None
    total = time.perf_counter() - start
    if isinstance(session.step_cost, CostEnvelope):
        session.step_cost.persist()
    if session.store is not None and la.store:
        session.store.add(generated)  # an answer cut short is still the model's own text
    acc = session.acceptance
    calibration = {src: (round(acc.predicted[src] - predicted_before.get(src, 0.0), 2),
                         round(acc.observed[src] - observed_before.get(src, 0.0), 2))
                   for src in acc.predicted if acc.predicted[src] != predicted_before.get(src, 0.0)}
    stats = tally.stats(
        prompt_tokens=len(prompt), prefill_tokens=prefill_tokens, prefill_s=prefill_s, ttft_s=ttft,
        decode_s=total - prefill_s, total_s=total, pool_size=len(session.pool), lookahead=la.enabled,
        window=la.window, ngram=la.ngram, candidates=la.candidates, finish_reason=reason, calibration=calibration)
    yield Done(tuple(generated), stats)


def verify(layout: StepLayout, choose) -> tuple[list[int], list[int], str]:
    """Walk the candidate trie along the model's own choices; choose(row, path) -> token.

    Returns (accepted tokens, candidate rows matched, source of the matched candidate). The last
    accepted token is the model's choice after the deepest match: the bonus token.
    """
    accepted: list[int] = []
    matched: list[int] = []
    node = 0
    while True:
        tok = choose(node, accepted)
        accepted.append(tok)
        child = layout.children[node].get(tok)
        if child is None:
            break
        matched.append(child)
        node = child
    source = layout.sources[matched[0] - layout.window_rows] if matched else "none"
    return accepted, matched, source


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


def batched_pick(layout: StepLayout, logits: torch.Tensor, chooser: Chooser, history: list[int]):
    """verify's choose(row, path) from one batched choice over the root and every draft node: a
    node's path is known before verifying (its ancestors' tokens), so every row's repetition
    penalty and draw can be settled at once, with one transfer to the host."""
    rows = [0, *range(layout.window_rows, layout.size)]
    paths: dict[int, list[int]] = {0: []}
    for row in rows[1:]:  # parents come before their children
        paths[row] = paths[layout.parents[row]] + [layout.tokens[row]]
    # a row's depth in the tree is its path's length
    picked = chooser.pick_rows(logits[rows], history, [paths[r] for r in rows], [len(paths[r]) for r in rows])
    chosen = dict(zip(rows, picked, strict=True))
    return lambda row, path: chosen[row]
