"""Which thread counts give a model's CPU steps the same bits, on this machine.

The thread governor (threads.py) changes torch's count mid-answer. A greedy lookahead answer stays
plain decoding's only if a step's logits do not depend on that count, and whether they do is a fact
of a kernel on a CPU, not of the code: oneDNN's packed fp32 products give the same bits on 1 and 2
threads on one x86 CPU and other bits on another. So it is probed: the model's own steps (a prompt,
then steps of every size a CPU plan uses) at each count the governor may pick, compared bit for bit
with the full count's. Only counts that agree are used; if none but the full count does, the
governor stays off and the steps keep torch's count. The steps stop growing past the first that
costs AFFORDABLE one-row steps (step_cost.py: no plan pays for more on a CPU; a 7B's 64-row step
takes seconds on 2 cores): a wider step than the probe's widest runs on the full count. The
verdict is kept per model files, weight layout, dtype, CPU, library versions and our kernels'
sources, since the probe costs a few dozen steps.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT_TOKENS = 16  # a short prompt: its rows are computed again at every count probed
STEP_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # a CPU plan's sizes (step_cost.SIZES)


def candidate_counts(ceiling: int) -> list[int]:
    """The counts the governor may use once probed: 1, 2, 4, ... below the ceiling, and the ceiling
    (every count of a large machine would cost a probe each)."""
    counts, count = [], 1
    while count < ceiling:
        counts.append(count)
        count *= 2
    return counts + [ceiling]


def agreeing_counts(outputs: dict[int, Sequence[torch.Tensor]], ceiling: int) -> tuple[int, ...]:
    """The counts whose outputs equal the ceiling's, bit for bit (NaNs in the same places count as
    equal), in order; the ceiling always among them."""
    reference = outputs[ceiling]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)) \
            and torch.equal(a.isnan(), b.isnan())

    return tuple(count for count in sorted(outputs)
                 if count == ceiling or all(same(a, b) for a, b in zip(outputs[count], reference)))


@dataclass(frozen=True)
class Verdict:
    """The thread counts whose steps give the full count's bits (the full count among them), for
    steps of up to `widest` rows (the probe's widest)."""

    counts: tuple[int, ...]
    widest: int


# steps(sizes): (the sizes run, each one's logits); sizes None: STEP_SIZES up to the first dear one
Steps = Callable[[tuple[int, ...] | None], tuple[tuple[int, ...], list[torch.Tensor]]]


def probe(steps: Steps, ceiling: int) -> Verdict:
    """steps() at the full count, then at every other candidate count at the sizes it ran (torch's
    count set for each, restored after); the agreeing counts."""
    before = torch.get_num_threads()
    outputs = {}
    try:
        torch.set_num_threads(ceiling)
        sizes, outputs[ceiling] = steps(None)
        for count in candidate_counts(ceiling)[:-1]:
            torch.set_num_threads(count)
            outputs[count] = steps(sizes)[1]
    finally:
        torch.set_num_threads(before)
    return Verdict(agreeing_counts(outputs, ceiling), max(sizes))


def model_steps(model) -> Steps:
    """The model's steps as a chat runs them on a CPU (its default runner): a prompt's prefill,
    then a chain of each size after it (sizes None: STEP_SIZES up to and with the first that costs
    AFFORDABLE times a one-row step), each step's logits kept."""
    from ladechat.engine.runner import default_runner  # the loader's caller already has it loaded
    from ladechat.engine.step_cost import AFFORDABLE, chain, prefill_random

    def steps(sizes: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        runner = default_runner(model)
        ran, logits = [], []

        def timed(size: int) -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            out = runner.step(chain(size), PROMPT_TOKENS).float().clone()
            seconds = time.perf_counter() - start
            runner.truncate(PROMPT_TOKENS)
            return out, seconds

        with torch.inference_mode():
            prefill_random(runner, PROMPT_TOKENS, computed=PROMPT_TOKENS)  # a prompt's rows, every one computed
            # The one-row cost the probe stops by is the faster of two: a first step's one-time
            # costs would otherwise stretch the probe to sizes no plan affords.
            one_row = min(timed(1)[1], timed(1)[1]) if sizes is None else float("inf")
            for size in sizes or STEP_SIZES:
                out, seconds = timed(size)
                logits.append(out)
                ran.append(size)
                if sizes is None and size > 1 and seconds > AFFORDABLE * one_row:
                    break
        return tuple(ran), logits

    return steps


def machine_key() -> str:
    """The CPU as the kernels see it: its model name and feature flags (Linux), else what Python knows."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
        first = text.split("\n\n", 1)[0]
        fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
        return json.dumps([fields.get(k, "").strip() for k in ("vendor_id", "model name", "flags")])
    except OSError:
        return json.dumps([platform.machine(), platform.processor()])


def cached_verdict(model, what: list, ceiling: int, cache: Path | None) -> Verdict:
    """probe(model_steps(model)), kept in `cache` (a folder) under a key of `what` (the model's files
    and layout, as the caller knows them), this CPU, the ceiling, the library versions and our code
    that a step runs. cache None: probed every time."""
    path = None
    if cache is not None:
        import transformers

        from ladechat.engine import runner
        from ladechat.engine.kernels import attention, linear, norms, q4, q6, q8, step_ops
        from ladechat.engine.load import packing
        from ladechat.engine.models import llama
        from ladechat.paths import source_digest

        code = source_digest(attention.__file__, llama.__file__, runner.__file__, packing.__file__, norms.__file__,
                             q4.SOURCE, q4.__file__, q6.__file__, q8.__file__, linear.__file__, step_ops.SOURCE,
                             __file__)
        key = json.dumps(["v2", what, machine_key(), ceiling, str(model.dtype), torch.__version__,
                          transformers.__version__, code])
        path = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
        try:
            kept = json.loads(path.read_text())
            return Verdict(tuple(int(c) for c in kept["counts"]), int(kept["widest"]))
        except (OSError, ValueError, TypeError, KeyError):
            pass
    verdict = probe(model_steps(model), ceiling)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"counts": list(verdict.counts), "widest": verdict.widest}))
        except OSError:  # a read-only cache only costs the probe next time
            pass
    return verdict
