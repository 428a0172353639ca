"""Step cost of the embedded model with transformers' SDPA against ladechat's grouped-query SDPA
(ladechat/engine/attention.py), one step of each in turn so that both see the same machine.

    python scripts/grouped_attention.py [--dtype float32] [--steps 24]

Prints, per cached length and step size, the median seconds of a step under each attention and
their ratio. A one-row step has no mask: transformers' SDPA asks for `enable_gqa` there, ladechat's
stacks the group's query heads without a mask."""

import argparse
import statistics
import time

import torch

from ladechat.engine import kv
from ladechat.engine.attention import NAME
from ladechat.engine.layout import build_layout, step_inputs
from ladechat.engine.loading import LoadSpec, load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = load(LoadSpec(model=None, dtype=args.dtype, device="cpu", pack_weights=False)).model
    vocab = model.config.vocab_size
    cache_arg = kv.cache_argument(model)  # once, not inside the timed steps
    for cached in (192, 1536, 3072):
        prompt = torch.randint(0, vocab, (1, cached), generator=torch.Generator().manual_seed(0))
        cache = kv.new_cache()
        with torch.inference_mode():
            model(input_ids=prompt, **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
        for size in (1, 4, 8, 16):
            layout = build_layout([list(range(1, size + 1))], [])
            times: dict[str, list[float]] = {"sdpa": [], NAME: []}
            for i in range(args.steps + 2):
                attention = ("sdpa", NAME)[i % 2]
                model.set_attn_implementation(attention)
                start = time.perf_counter()
                ids, positions, mask = step_inputs(layout, cached, model.dtype, model.device)
                with torch.inference_mode():
                    model(input_ids=ids, position_ids=positions, attention_mask=mask if size > 1 else None,
                          **{cache_arg: cache}, use_cache=True,
                          logits_to_keep=torch.arange(size) if size > 1 else 1)
                if i >= 2:  # the first of each is a warm-up
                    times[attention].append(time.perf_counter() - start)
                kv.truncate(cache, cached)
            plain, grouped = statistics.median(times["sdpa"]), statistics.median(times[NAME])
            print(f"cached {cached:5d}  rows {size:3d}:  sdpa {plain * 1000:6.1f} ms  grouped {grouped * 1000:6.1f} ms"
                  f"  ratio {grouped / plain:.2f}", flush=True)


if __name__ == "__main__":
    main()
