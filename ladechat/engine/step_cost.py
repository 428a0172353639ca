"""How much a forward step costs as a function of how many tokens it feeds, on this device.

Lookahead pays off only when the tokens a step accepts outweigh what the extra rows cost, and on a
CPU that cost curve is far from flat and differs between machines and weight layouts (measured:
BENCHMARKS.md; load/packing.py). The curve is measured once per model, device, dtype and weight
layout and cached, so the decoder can size its steps from it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ladechat.engine import kv, layout
from ladechat.engine import runner as runners
from ladechat.engine.kernels import attention, int4, linear, norms, q4, q6, q8, step_ops
from ladechat.engine.layout import StepLayout, build_layout
from ladechat.engine.load import packing
from ladechat.engine.load.gguf import quantized
from ladechat.engine.models import llama
from ladechat.engine.runner import default_runner, top_k
from ladechat.paths import cache_root, source_digest

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (192, 1536)  # cached tokens: a fresh question, and a conversation a few turns in
GPU_SIZES = (1, 8, 16, 32, 64, 96, 128, 160, 192, 256)  # a GPU's curve stays flat much longer
# A step that costs this many one-row steps would need that many tokens accepted to pay: the curve
# stops at the first size past it (the planner extrapolates beyond, proportionally).
AFFORDABLE = 3.0
# A step this slow (a 7B on a few cores) is timed fewer times: a spell of load is seldom shorter
# than such a step, every repetition of every size costs seconds at a model's first use, and what
# a spell overprices the envelope lowers as real steps run (cost_envelope.py).
SLOW_STEP_S = 0.05
SLOW_REPS = 2
# tokens prefill_random computes; a longer context repeats their keys and values (a step's time
# depends on how many keys it attends to, not on what they hold, and each computed token costs a
# 7B's prefill a fraction of a second on 2 cores)
PREFILLED = 8

Report = Callable[[str], None]  # a line saying how far a measurement is (a phase's update)


def time_step(runner, layout: StepLayout, past: int) -> float:
    """Seconds of one decoding step as Session.step runs it after `past` cached tokens: the
    runner's step (its inputs and mask, the forward pass, the logits of every row) and the rows'
    top-k on the host. The cache is cut back to `past` afterwards, so the step can run again.
    The one timing of a step: the measured curves, `ladechat bench step-cost` and scripts/ use it."""
    device = runner.model.device
    if device.type == "cuda":  # what is queued before is not the step's
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    top_k(runner.step(layout, past))  # its host transfer waits for the step to finish
    seconds = time.perf_counter() - start
    runner.truncate(past)
    return seconds


def prefill_random(runner, context: int, computed: int = PREFILLED) -> None:
    """Fill the runner's cache with `context` positions of random tokens (the same for every call),
    to time steps after them: `computed` of them computed, the rest their keys and values repeated
    where the cache allows (kv.repeat_to; a 7B's prefill of 1536 tokens takes a minute on 2 cores),
    else computed too."""
    vocab = runner.model.config.get_text_config().vocab_size
    tokens = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(tokens[:computed], 0, ranked=False)
    if context > computed and not kv.repeat_to(runner.cache, context):
        runner.prefill(tokens[computed:], computed, ranked=False)


def chain(size: int) -> StepLayout:
    """A step of `size` rows, each following the one before (a window of one level)."""
    return build_layout([list(range(1, size + 1))], [])


def measure(model, sizes=SIZES, context: int = 192, reps: int = 5, affordable: float | None = AFFORDABLE,
            report: Report | None = None) -> dict[int, float]:
    """Median seconds of one step feeding `s` tokens after `context` cached tokens, per size s: the
    sizes up to the first that costs `affordable` times the first (None: every size), found in a
    warm-up round (the faster of two steps of each size, one where every size is measured, and one
    after a step slower than SLOW_STEP_S); SLOW_REPS repetitions where a one-row step is that slow,
    the warm-up's among them.

    The sizes take turns (1, 2, 4, ..., then 1, 2, 4, ... again) rather than running each size's
    repetitions back to back: a busy spell of the machine then inflates one repetition of every
    size instead of all repetitions of one, and the medians keep the curve's shape, which is all
    the planner looks at. report(line): told each size tried and each round (None: nothing)."""
    tell = report or (lambda line: None)
    runner = default_runner(model)
    prefill_random(runner, context)
    layouts = {size: chain(size) for size in sizes}
    warm: dict[int, float] = {}
    trials = 1 if affordable is None else 2  # the faster of two: a busy spell must hit both to end the curve early
    for size in sizes:
        tell(f"after {context} cached tokens, a step of {size} row{'s' * (size > 1)}")
        warm[size] = min(time_step(runner, layouts[size], context) for _ in range(trials))
        if affordable is not None and size > sizes[0] and warm[size] > affordable * warm[sizes[0]]:
            break
        if warm[size] > SLOW_STEP_S:  # a spell that spares one of two such steps back to back is rare
            trials = 1
    slow = warm[sizes[0]] > SLOW_STEP_S
    if slow:  # the warm-up is one of the repetitions: a first step's one-time costs are small beside such a step
        reps = min(reps, SLOW_REPS)
    times: dict[int, list[float]] = {size: [warm[size]] if slow else [] for size in warm}
    for done in range(reps - slow):
        tell(f"after {context} cached tokens, round {done + 1} of {reps - slow} over {len(warm)} sizes")
        for size in warm:
            times[size].append(time_step(runner, layouts[size], context))
    return {size: statistics.median(times[size]) for size in warm}


def cache_path(model, name: str, *what, threads: int | None = None) -> Path:
    """The cache file of this model's step costs on this device: `what` says which (a measured
    curve's sizes and cache length, or the envelope learned from real steps). threads: the thread
    count the costs are kept for (None: torch's count now)."""
    # our code that a step runs is part of the key (the attention function, the mask, the cache,
    # this measurement), so a change to it measures afresh rather than trusting a curve of the old code
    code = source_digest(attention.__file__, layout.__file__, kv.__file__, llama.__file__, packing.__file__,
                         int4.__file__, q4.__file__, q6.__file__, q8.__file__, q4.SOURCE, runners.__file__, __file__,
                         step_ops.SOURCE, norms.__file__, linear.__file__)
    key = json.dumps([code, name, str(model.device), str(model.dtype), quantized.weight_layout(model),
                      model.config._attn_implementation, torch.__version__,
                      threads or torch.get_num_threads(), type(model).__name__, step_ops.loaded(), *what])
    return cache_root() / "step-cost" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measured_sizes(model) -> tuple[int, ...]:
    """The step sizes a curve is measured at on the model's device."""
    return GPU_SIZES if model.device.type == "cuda" else SIZES


def cached_curve(model, name: str, context: int = 192, threads: int | None = None,
                 shorter: dict[int, float] | None = None, report: Report | None = None) -> dict[int, float]:
    """The curve kept for `threads` (cache_path), else measured now, at torch's thread count now: at
    the sizes worth measuring (measure()), or from `shorter`, the curve after fewer cached tokens
    (measure_beside()). report: as measure()'s."""
    sizes = measured_sizes(model)
    path = cache_path(model, name, list(sizes), context, threads=threads)
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        pass
    curve = (measure(model, sizes, context, report=report) if shorter is None
             else measure_beside(model, shorter, context, report))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve))
    return curve


def measure_beside(model, shorter: dict[int, float], context: int, report: Report | None = None) -> dict[int, float]:
    """The curve after `context` cached tokens at the sizes of `shorter` (measured after fewer), from
    two steps measured here, its narrowest and its widest. What more cached tokens add to a step is
    attention over more keys: reading them once, and each row's products with them, so the addition
    grows linearly with the rows, and the shape the weights give the curve (where a kernel tiles
    rows) is the shorter curve's; timing every size again would lengthen a large model's first use
    by many seconds on a few cores. A longer cache never makes a step cheaper: an addition
    measured below nothing (noise) counts as nothing, so the curve errs high rather than low."""
    sizes = sorted(shorter)
    lo, hi = sizes[0], sizes[-1]
    there = measure(model, tuple(dict.fromkeys((lo, hi))), context, affordable=None, report=report)
    at_lo, at_hi = (max(0.0, there[size] - shorter[size]) for size in (lo, hi))
    per_row = max(0.0, at_hi - at_lo) / (hi - lo) if hi > lo else 0.0
    return {size: shorter[size] + at_lo + per_row * (size - lo) for size in sizes}


@dataclass(frozen=True)
class CostModel:
    """Step cost as a function of tokens fed and tokens already cached: one measured curve per
    cache length, interpolated linearly between them (and extrapolated past the longest). Each
    extra row attends over the whole cache, so extra rows cost more in a long conversation."""

    curves: dict[int, dict[int, float]]  # cached tokens -> {tokens fed: seconds}

    @functools.cached_property
    def _sorted(self) -> tuple[list[int], dict[int, list[int]]]:
        """The cache lengths in order, and each curve's sizes in order: sorted once, not on each of
        the ~20 costs a step's planning asks for."""
        return sorted(self.curves), {context: sorted(curve) for context, curve in self.curves.items()}

    def cost(self, size: int, cached: int) -> float:
        contexts, sizes = self._sorted
        if len(contexts) == 1:
            return cost(self.curves[contexts[0]], size, sizes[contexts[0]])
        lo, hi = contexts[0], contexts[1]
        for a, b in zip(contexts, contexts[1:]):
            lo, hi = a, b
            if cached <= b:
                break
        at_lo, at_hi = cost(self.curves[lo], size, sizes[lo]), cost(self.curves[hi], size, sizes[hi])
        share = max(0.0, (cached - lo) / (hi - lo))
        return at_lo + (at_hi - at_lo) * share


def curve_paths(model, name: str, threads: int | None = None) -> list[Path]:
    """The cache files of cached_cost_model's curves, one per context length."""
    sizes = measured_sizes(model)
    return [cache_path(model, name, list(sizes), context, threads=threads) for context in CONTEXTS]


def curves_cached(model, name: str, threads: int | None = None) -> bool:
    """Whether cached_cost_model would read every curve rather than measure one."""
    return all(path.is_file() for path in curve_paths(model, name, threads))


def cached_cost_model(model, name: str, threads: int | None = None, report: Report | None = None) -> CostModel:
    """This model's cost model on this device as measured: once per context length, then cached;
    the longer contexts from the shortest (measure_beside). report: as measure()'s."""
    first = cached_curve(model, name, CONTEXTS[0], threads, report=report)
    return CostModel({CONTEXTS[0]: first} | {context: cached_curve(model, name, context, threads, first, report)
                                             for context in CONTEXTS[1:]})


def cost(curve: dict[int, float], size: int, sizes: list[int] | None = None) -> float:
    """Interpolated cost of a step of `size` tokens (`sizes`: the curve's sizes in order, if known)."""
    sizes = sizes or sorted(curve)
    if size <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if size <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (size - lo) / (hi - lo)
    return curve[sizes[-1]] * size / sizes[-1]


def affordable_size(curve: dict[int, float], slack: float) -> int:
    """The largest step size that costs at most (1 + slack) times a one-token step."""
    base = cost(curve, 1) * (1 + slack)
    return max([s for s in range(1, 257) if cost(curve, s) <= base], default=1)
