"""Step cost of the embedded model with its Linear weights stored as they load (out x in) against
stored transposed (in x out, the same values seen through .t()), which sends torch's CPU matmul
to other BLAS kernels. An experiment behind a BENCHMARKS.md note; ladechat does not do this.

    python scripts/weight_layout.py

Prints the median seconds of a step of 1-16 rows after 512 cached tokens for: the weights as
loaded, the layers' weights transposed, and every weight transposed (the tied output layer and
embedding too); one step of each in turn."""

import copy
import statistics
import time

import torch

from ladechat.engine import kv
from ladechat.engine.layout import build_layout, step_inputs
from ladechat.engine.loading import LoadSpec, load

CACHED = 512


def transposed(model, output_layer: bool):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (output_layer or name != "lm_head"):
                weight = module.weight.data.t().contiguous().t()
                module.weight.data = weight
                if name == "lm_head" and model.config.tie_word_embeddings:
                    model.get_input_embeddings().weight.data = weight
    return model


def main() -> None:
    loaded = load(LoadSpec(model=None, dtype="float32", device="cpu", pack_weights=False)).model
    models = {"as loaded": loaded, "layers transposed": transposed(loaded, False),
              "all transposed": transposed(loaded, True)}
    prompt = torch.randint(0, loaded.config.vocab_size, (1, CACHED), generator=torch.Generator().manual_seed(0))
    caches = {name: kv.new_cache() for name in models}
    cache_arg = kv.cache_argument(loaded)  # the same class for all three; once, not inside the timed steps
    for name, model in models.items():
        with torch.inference_mode():
            model(input_ids=prompt, **{cache_arg: caches[name]}, use_cache=True, logits_to_keep=1)
    for size in (1, 2, 3, 4, 6, 8, 12, 16):
        layout = build_layout([list(range(1, size + 1))], [])
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(14):
            for name, model in models.items():
                start = time.perf_counter()
                ids, positions, mask = step_inputs(layout, CACHED, model.dtype, model.device)
                with torch.inference_mode():
                    model(input_ids=ids, position_ids=positions, attention_mask=mask if size > 1 else None,
                          **{cache_arg: caches[name]}, use_cache=True,
                          logits_to_keep=torch.arange(size) if size > 1 else 1)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
                kv.truncate(caches[name], CACHED)
        print(f"rows {size:3d}: " + "  ".join(f"{name} {statistics.median(t) * 1000:6.1f} ms"
                                               for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
