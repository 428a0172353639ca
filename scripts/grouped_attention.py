"""Step cost of the embedded model with transformers' SDPA against ladechat's grouped-query SDPA
(ladechat/engine/kernels/attention.py), one step of each in turn so that both see the same machine.

    python scripts/grouped_attention.py [--dtype float32] [--steps 24]

Prints, per cached length and step size, the median seconds of a step under each attention and
their ratio. A one-row step has no mask: transformers' SDPA asks for `enable_gqa` there, ladechat's
stacks the group's query heads without a mask."""

import argparse
import statistics

from ladechat.engine.kernels.attention import NAME
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.runner import DynamicRunner
from ladechat.engine.step_cost import chain, prefill_random, time_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = load(LoadSpec(model=None, dtype=args.dtype, device="cpu", pack_weights=False, own_forward=False)).model
    for cached in (192, 1536, 3072):
        runner = DynamicRunner(model)
        prefill_random(runner, cached)
        for size in (1, 4, 8, 16):
            layout = chain(size)
            times: dict[str, list[float]] = {"sdpa": [], NAME: []}
            for i in range(args.steps + 2):
                attention = ("sdpa", NAME)[i % 2]
                model.set_attn_implementation(attention)
                seconds = time_step(runner, layout, cached)
                if i >= 2:  # the first of each is a warm-up
                    times[attention].append(seconds)
            plain, grouped = statistics.median(times["sdpa"]), statistics.median(times[NAME])
            print(f"cached {cached:5d}  rows {size:3d}:  sdpa {plain * 1000:6.1f} ms  grouped {grouped * 1000:6.1f} ms"
                  f"  ratio {grouped / plain:.2f}", flush=True)


if __name__ == "__main__":
    main()
