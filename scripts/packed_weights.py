"""Step cost of the embedded model with its Linear weights as transformers loads them against packed
for oneDNN (ladechat/engine/load/packing.py, what ladechat loads on an x86-64 CPU). Behind the table in
packing.py's docstring and BENCHMARKS.md.

    python scripts/packed_weights.py --dtype float32 [--cached 192]

Prints the median milliseconds of a step of 1-32 rows after --cached tokens, for each layout; the
two take turns step by step, so a busy spell of the machine hits both alike.
"""

import argparse
import statistics

from ladechat.engine.load import packing
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.runner import DynamicRunner
from ladechat.engine.step_cost import chain, prefill_random, time_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cached", type=int, default=192)
    args = parser.parse_args()
    models = {"as loaded": load(LoadSpec(dtype=args.dtype, device="cpu", pack_weights=False, own_forward=False)).model,
              "packed": load(LoadSpec(dtype=args.dtype, device="cpu", own_forward=False)).model}
    assert packing.is_packed(models["packed"]) and not packing.is_packed(models["as loaded"])
    runners = {name: DynamicRunner(model) for name, model in models.items()}
    for runner in runners.values():
        prefill_random(runner, args.cached)
    for size in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        layout = chain(size)
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(14):
            for name, runner in runners.items():
                seconds = time_step(runner, layout, args.cached)
                if i >= 2:  # two warm-up rounds
                    times[name].append(seconds)
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(f"rows {size:3d}: " + "  ".join(f"{name} {ms:6.1f} ms" for name, ms in medians.items())
              + f"  packed/as loaded {medians['packed'] / medians['as loaded']:.2f}", flush=True)


if __name__ == "__main__":
    main()
