"""The decoding loop: one forward pass per step, lookahead on or off, as a stream of events.

    step = forward(t + window + candidates)   one call, 4D mask from layout.py
           verify   -> the longest candidate prefix that equals the model's own choices, + bonus
           harvest  -> last window level's argmax: one new n-gram per column into the pool
           shift    -> window levels move down by one, the new tokens become the last level
           commit_kv-> keep t and the accepted candidate rows, drop the rest

With lookahead off (or nothing to feed but t) a step is a plain one-token forward pass, so the
chat can toggle lookahead between turns without changing anything else.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import torch

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.events import Done, Stats, Step
from ladechat.engine.layout import StepLayout, build_layout
from ladechat.engine.ngram_pool import ContextIndex, NGramPool
from ladechat.engine.runner import DynamicRunner
from ladechat.engine.sampling import Chooser
from ladechat.engine.step_cost import affordable_size, cost
from ladechat.engine.stopping import StopRule

STEP_BUDGET = 0.3  # a step may cost up to 1.3x a one-token step (see _plan)
WINDOW_SLACK = 0.15  # or 15% more than its candidates alone, to carry window columns
PROBE_EVERY = 8  # while acceptance is poor, still try candidates on every 8th step


class OutOfMemory(RuntimeError):
    """A forward pass ran out of device or host memory. The session was left consistent (the
    half-done step dropped), so the conversation can go on, e.g. after dropping old turns."""


def _is_out_of_memory(exc: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator raises a plain RuntimeError.
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


class Session:
    """Decoding state that outlives one answer: KV cache, the tokens it holds, pool and window.

    A chat keeps one Session, so later turns reuse the cached prefix of the conversation and the
    n-grams the window found earlier. The cache always holds exactly `cached` (every committed
    token but the last, which is the next step's input). The runner owns the cache and the
    forward call (runner.py); with a fixed-shape runner every lookahead step is a full one.
    """

    def __init__(self, model, lookahead: LookaheadConfig, step_cost: dict[int, float] | None = None,
                 runner=None) -> None:
        self.model = model
        self.runner = runner or DynamicRunner(model)
        self.runner.configure(lookahead)
        if self.runner.fixed:
            step_cost = None  # every step is padded to full size anyway
        self.step_cost = step_cost  # measured seconds per step size; None: always the full step
        self.budget = affordable_size(step_cost, STEP_BUDGET) if step_cost else 0  # largest affordable step
        self.gain = 1.0  # running mean of the extra tokens a step with candidates accepted
        self.skipped = 0  # candidate steps skipped in a row because acceptance was poor
        self.cached: list[int] = []
        self.context = ContextIndex()
        self.lookahead = lookahead
        self.pool = NGramPool(lookahead.ngram, lookahead.candidates)
        self.window: list[list[int]] | None = None
        self.window_age = 0  # steps since the window was filled; n-grams are harvested after N-2
        self.rng = torch.Generator().manual_seed(0)  # window fill: deterministic runs

    def configure(self, lookahead: LookaheadConfig) -> None:
        """Apply new W/N/G: the pool survives a change of W, the window a change of G only."""
        old = self.lookahead
        self.runner.configure(lookahead)  # first: it may refuse a step too large for its fixed shape
        if (old.ngram, old.candidates) != (lookahead.ngram, lookahead.candidates):
            pool = NGramPool(lookahead.ngram, lookahead.candidates)
            pool.seed(self.context.tokens)
            self.pool = pool
        if (old.window, old.ngram) != (lookahead.window, lookahead.ngram):
            self.window = None
        self.lookahead = lookahead

    def reset(self) -> None:
        """Forget the conversation (cache, context, pool, window) but keep the settings."""
        self.runner.reset()
        self.__init__(self.model, self.lookahead, self.step_cost, self.runner)

    @property
    def cache(self):
        return self.runner.cache

    def warm_up(self) -> None:
        """Compile a fixed-shape runner's step graphs now (no-op for the default runner)."""
        if self.runner.fixed:
            self.runner.warm_up(len(self.cached))

    # -- prefix reuse -------------------------------------------------------------------------
    def _sync_prompt(self, prompt: list[int]) -> tuple[int, float]:
        """Make the cache hold prompt[:-1], reusing its common prefix. Returns (prefilled, seconds)."""
        start = time.perf_counter()
        keep = _common_prefix(self.cached, prompt[:-1])
        self.runner.truncate(keep)
        self.cached = self.cached[:keep]
        todo = prompt[keep:-1]
        if todo:
            self.runner.prefill(todo, keep)
            self.cached = list(prompt[:-1])
        seen = _common_prefix(self.context.tokens, prompt)
        self.context.truncate(seen)
        self.context.extend(prompt[seen:])
        if self.lookahead.seed_pool:
            self.pool.seed(prompt[max(0, seen - self.lookahead.ngram) :])
        return len(todo), time.perf_counter() - start

    # -- the window ---------------------------------------------------------------------------
    def _window_for(self, t: int, prompt: list[int]) -> list[list[int]]:
        la = self.lookahead
        if self.window is None:
            # All N-1 levels are filled at once from prompt tokens (not with N-2 warm-up steps):
            # every step then has the same shape and cost, and the first steps already verify
            # pool candidates. Their n-grams are junk until each level has been recomputed once,
            # so harvesting waits N-2 steps (window_age).
            source = torch.tensor(prompt, dtype=torch.long)
            picks = torch.randint(len(prompt), (la.ngram - 1, la.window), generator=self.rng)
            self.window = source[picks].tolist()
            self.window_age = 0
        self.window[0][0] = t
        return self.window

    def _harvest_and_shift(self, new_tokens: list[int]) -> None:
        """Pool the n-gram of each computed column, then move those columns down one level.

        A step may carry only the first k columns (see _plan); the others keep their guesses.
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

    def _plan(self, t: int, prompt: list[int]) -> StepLayout:
        """The step's layout, sized from the measured step-cost curve.

        Candidates go in best first (context matches, longest first, then pool n-grams) while the
        step stays within the budget: the largest size that costs at most 1 + STEP_BUDGET times a
        one-token step. The first candidate always goes in (a context match is right often enough
        to pay for itself even where two tokens cost 1.3x one, as in fp32 on a small CPU). Window
        columns then ride along while the step stays within that budget, or within WINDOW_SLACK
        of the candidates' own cost. On a GPU (flat curve) everything fits; on a small CPU it is
        often a few columns or none. Columns are a prefix of the window, so the tree keeps its
        shape.
        """
        candidates = self._candidates(t)
        window = self._window_for(t, prompt)
        if self.step_cost is None:
            return build_layout(window, candidates)
        budget = self.budget
        chosen = candidates[:1]
        for cand in candidates[1:]:
            if build_layout([[t]], chosen + [cand]).size > budget:
                break
            chosen.append(cand)
        alone = build_layout([[t]], chosen)
        # Speculation must not cost more than it saves: while recent steps accepted fewer extra
        # tokens than the step's extra cost, decode plainly, re-checking every PROBE_EVERY steps.
        if chosen and self.gain < cost(self.step_cost, alone.size) / cost(self.step_cost, 1) - 1:
            self.skipped += 1
            if self.skipped % PROBE_EVERY:
                return build_layout([[t]], [])
        limit = max(cost(self.step_cost, budget), cost(self.step_cost, alone.size) * (1 + WINDOW_SLACK))
        levels = len(window)
        for columns in range(len(window[0]), 0, -1):
            if columns == 1 and levels == 1:
                break
            if cost(self.step_cost, alone.size + columns * levels - 1) <= limit:
                return build_layout([level[:columns] for level in window], chosen)
        return alone

    # -- candidates ---------------------------------------------------------------------------
    def _candidates(self, t: int) -> list[tuple[tuple[int, ...], str]]:
        la = self.lookahead
        found = [(c, "context") for c in self.context.continuations(self.context.tokens, la.context_len,
                                                                    la.context_candidates)]
        found += [(c, "pool") for c in self.pool.get(t)[: la.candidates]]
        return found


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
    generated: list[int] = []
    histogram: Counter[int] = Counter()
    by_position = [0] * max(la.ngram - 1, la.context_len)
    sources: Counter[str] = Counter()
    fed_total = 0
    steps = 0
    ttft = 0.0
    reason = "length"
    prefill_tokens, prefill_s = 0, 0.0
    try:
        prefill_tokens, prefill_s = session._sync_prompt(prompt)
        t = prompt[-1]
        while True:
            step_start = time.perf_counter()
            past = len(session.cached)
            layout = session._plan(t, prompt) if la.enabled else build_layout([[t]], [])
            rows = layout.logit_rows()
            logits = session.runner.step(layout, past, rows)
            row_at = {row: i for i, row in enumerate(rows)}
            argmax = logits.argmax(-1).tolist()  # one host sync for the whole step
            history = session.context.tokens
            if chooser.plain_argmax:
                choose = lambda row, path: argmax[row_at[row]]  # noqa: E731
            else:
                choose = lambda row, path: chooser.pick(logits[row_at[row]], history + path)  # noqa: E731
            block, matched, source = verify(layout, choose)
            if layout.size > layout.window_rows:  # the step carried candidates
                session.gain = 0.8 * session.gain + 0.2 * len(matched)
            if layout.window_rows > 1:
                # The window always advances by argmax, as in the paper, also when sampling.
                session._harvest_and_shift([argmax[row_at[r]] for r in layout.last_level])
            keep, why = stop.cut(generated, block)
            block = block[:keep]
            session.runner.commit(past, [0] + matched[: keep - 1])
            session.cached += [t] + block[:-1]
            session.context.extend(block)
            generated += block
            t = block[-1]
            steps += 1
            fed_total += layout.size
            histogram[len(block)] += 1
            guessed = tuple(i < min(len(matched), keep - 1) for i in range(len(block)))
            for depth in range(sum(guessed)):
                by_position[depth] += 1
            if sum(guessed):
                sources[source] += 1
            now = time.perf_counter()
            if steps == 1:
                ttft = now - start
            yield Step(tuple(block), guessed, source if la.enabled else "plain", layout.size, now - step_start)
            if why is not None:
                reason = why
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
    stats = Stats(
        new_tokens=len(generated), steps=steps, prompt_tokens=len(prompt), prefill_tokens=prefill_tokens,
        prefill_s=prefill_s, ttft_s=ttft, decode_s=total - prefill_s, total_s=total,
        accepted_histogram=dict(histogram), accepted_by_position=tuple(by_position),
        source_counts=dict(sources), pool_size=len(session.pool), mean_fed=fed_total / steps if steps else 0.0,
        lookahead=la.enabled, window=la.window, ngram=la.ngram, candidates=la.candidates, finish_reason=reason,
    )
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
