"""ladechat's CPU kernels against the torch ops they replace, one call at a time (medians of
--reps, microseconds): the 4-bit product (blocks.cpp q4_mm, each path this CPU has) against
torch's int4 kernel on the embedded model's shapes, and the row-wise attention (step_ops.cpp
attend) against SDPA on a step's stacked rows over a cache. Weights and keys stay in cache between
calls, so these are the kernels' compute, not a step's memory traffic (`ladechat bench step-cost`
times whole steps). Behind the tables in BENCHMARKS.md.

    python scripts/kernel_bench.py [--rows 1,8,16] [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from ladechat.engine.kernels import int4, q4, step_ops
from ladechat.paths import cache_root

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # q/o, k/v, gate/up, down
PATH_NAMES = {0: "portable", 1: "avx2", 2: "vnni"}


def median_us(call, reps: int) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def products(rows: list[int], reps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    fast = [p for p in range(q4.best_path() + 1) if p >= 1]
    print("4-bit product, fp32 rows: " + " | ".join(f"q4 {PATH_NAMES[p]}" for p in fast) + " | torch int4 (us)")
    for out, inp in SHAPES:
        codes = torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=generator)
        scales = torch.rand(out, inp // 32, generator=generator) * 0.01
        lows = -torch.rand(out, inp // 32, generator=generator) * 0.08
        ours = {p: q4.Q4Linear(*q4.layout(codes, scales, lows), path=p) for p in fast}
        theirs = int4.Int4Linear.from_codes(torch.from_numpy(int4.pack_codes(codes.numpy())), scales, lows)
        for m in rows:
            x = torch.randn(m, inp, generator=generator)
            cells = [f"{median_us(partial(layer, x), reps):7.1f}" for layer in ours.values()]
            print(f"  {out}x{inp} rows {m:3}: " + " | ".join(cells) + f" | {median_us(partial(theirs, x), reps):7.1f}")


def attention(rows: list[int], reps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    best = int(torch.ops.ladechat_step.attend_best_path())
    print(f"attention, 3 kv heads x 3 query heads, dim 64 (ours: path {best}) | SDPA (us)")
    for dtype in (torch.float32, torch.bfloat16):
        for past in (192, 1000):
            for size in rows:
                keys = past + size
                q = torch.randn(1, 3, 3 * size, 64, generator=generator).to(dtype)
                k = torch.randn(1, 3, keys + 64, 64, generator=generator).to(dtype)[:, :, :keys]
                v = torch.randn(1, 3, keys + 64, 64, generator=generator).to(dtype)[:, :, :keys]
                mask = None
                if size > 1:  # a chain of the step's rows, tiled per query head
                    mask = torch.zeros(1, 1, size, keys, dtype=dtype)
                    causal = torch.ones(size, size, dtype=torch.bool).tril()
                    mask[0, 0, :, past:].masked_fill_(~causal, torch.finfo(dtype).min)
                    mask = mask.repeat(1, 1, 3, 1)
                ours = median_us(partial(torch.ops.ladechat_step.attend, q, k, v, mask, 0.125, size, best), reps)
                theirs = median_us(partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                           scale=0.125), reps)
                print(f"  {str(dtype).removeprefix('torch.'):8} {past:4} cached, rows {size:3}: "
                      f"{ours:7.1f} | {theirs:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16", help="rows per call, comma-separated")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    for load in (q4.load, step_ops.load):
        reason = load(cache_root() / "kernels")
        if reason:
            raise SystemExit(f"kernel_bench: {reason}")
    products(rows, args.reps)
    attention(rows, args.reps)


if __name__ == "__main__":
    main()
