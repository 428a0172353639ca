"""Decoding speed on a machine that is busy with something else, with the steps' thread count
fixed (torch's) and following the other load (engine/threads.py). Behind BENCHMARKS.md's
"busy machine" figures.

    python scripts/thread_load.py [--busy 1] [--rounds 3] [--max-new-tokens 96] [--lookahead]

--busy K: K processes spinning on a core each while the answers run (0: the machine as it is).
Prints per variant the median tokens/s over the rounds (variants take turns, answer by answer)
and the thread count the governor ended at.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from ladechat import templates
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.threads import CpuThreads

PROMPTS = ["Describe how a refrigerator keeps food cold.", "Write a short poem about a lighthouse.",
           "What should I pack for a weekend of hiking?"]


def answer(loaded, prompt: str, la: LookaheadConfig, threads, max_new: int) -> float:
    ids = templates.encode(loaded.tokenizer, [{"role": "user", "content": prompt}], None)
    session = Session(loaded.model, la, threads=threads)
    start = time.perf_counter()
    done = next(e for e in generate(session, ids, SamplingConfig(max_new_tokens=max_new), loaded.eos_ids)
                if isinstance(e, Done))
    return len(done.text_tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--busy", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookahead", action="store_true")
    args = parser.parse_args()
    loaded = load(LoadSpec())
    la = LookaheadConfig(enabled=args.lookahead, store=False)
    import torch

    ceiling = torch.get_num_threads()
    governor = CpuThreads()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    speeds: dict[str, list[float]] = {"fixed": [], "following": []}
    try:
        time.sleep(1.0)
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                torch.set_num_threads(ceiling)
                speeds["fixed"].append(answer(loaded, prompt, la, None, args.max_new_tokens))
                speeds["following"].append(answer(loaded, prompt, la, governor, args.max_new_tokens))
    finally:
        for spin in spinners:
            spin.kill()
    print(f"{loaded.name} ({loaded.weights or 'as loaded'}, {loaded.dtype}), {args.busy} busy process(es), "
          f"lookahead {'on' if args.lookahead else 'off'}, {len(speeds['fixed'])} answers each")
    for name, values in speeds.items():
        print(f"  threads {name:9s}: median {statistics.median(values):6.1f} tok/s "
              f"(min {min(values):.1f}, max {max(values):.1f})")
    print(f"  the governor ended at {governor.describe()}")


if __name__ == "__main__":
    main()
