"""Step cost of the embedded model with its Linear weights as transformers loads them against packed
for oneDNN (ladechat/engine/packing.py, what ladechat loads on an x86-64 CPU). Behind the table in
packing.py's docstring and BENCHMARKS.md.

    python scripts/packed_weights.py --dtype float32 [--cached 192]

Prints the median milliseconds of a step of 1-32 rows after --cached tokens, for each layout; the
two take turns step by step, so a busy spell of the machine hits both alike.
"""

import argparse
import statistics
import time

import torch

from ladechat.engine import kv, packing
from ladechat.engine.layout import build_layout, step_inputs
from ladechat.engine.loading import LoadSpec, load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cached", type=int, default=192)
    args = parser.parse_args()
    models = {"as loaded": load(LoadSpec(dtype=args.dtype, device="cpu", pack_weights=False)).model,
              "packed": load(LoadSpec(dtype=args.dtype, device="cpu")).model}
    assert packing.is_packed(models["packed"]) and not packing.is_packed(models["as loaded"])
    first = models["as loaded"]
    prompt = torch.randint(0, first.config.vocab_size, (1, args.cached), generator=torch.Generator().manual_seed(0))
    caches = {name: kv.new_cache() for name in models}
    cache_arg = kv.cache_argument(first)  # once, not inside the timed steps
    for name, model in models.items():
        with torch.inference_mode():
            model(input_ids=prompt, **{cache_arg: caches[name]}, use_cache=True, logits_to_keep=1)
    for size in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        layout = build_layout([list(range(1, size + 1))], [])
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(14):
            for name, model in models.items():
                start = time.perf_counter()
                ids, positions, mask = step_inputs(layout, args.cached, model.dtype, model.device)
                with torch.inference_mode():
                    model(input_ids=ids, position_ids=positions, attention_mask=mask if size > 1 else None,
                          **{cache_arg: caches[name]}, use_cache=True,
                          logits_to_keep=torch.arange(size) if size > 1 else 1)
                if i >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
                kv.truncate(caches[name], args.cached)
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(f"rows {size:3d}: " + "  ".join(f"{name} {ms:6.1f} ms" for name, ms in medians.items())
              + f"  packed/as loaded {medians['packed'] / medians['as loaded']:.2f}", flush=True)


if __name__ == "__main__":
    main()
