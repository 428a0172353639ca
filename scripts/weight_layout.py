"""Step cost of the embedded model with its Linear weights stored as they load (out x in) against
stored transposed (in x out, the same values seen through .t()), which sends torch's CPU matmul
to other BLAS kernels. An experiment behind a BENCHMARKS.md note; ladechat does not do this.

    python scripts/weight_layout.py

Prints the median seconds of a step of 1-16 rows after 512 cached tokens for: the weights as
loaded, the layers' weights transposed, and every weight transposed (the tied output layer and
embedding too); one step of each in turn."""

import copy
import statistics

import torch

from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.runner import DynamicRunner
from ladechat.engine.step_cost import chain, prefill_random, time_step

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
    loaded = load(LoadSpec(model=None, dtype="float32", device="cpu", pack_weights=False, own_forward=False)).model
    models = {"as loaded": loaded, "layers transposed": transposed(loaded, False),
              "all transposed": transposed(loaded, True)}
    runners = {name: DynamicRunner(model) for name, model in models.items()}
    for runner in runners.values():
        prefill_random(runner, CACHED)
    for size in (1, 2, 3, 4, 6, 8, 12, 16):
        layout = chain(size)
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(14):
            for name, runner in runners.items():
                seconds = time_step(runner, layout, CACHED)
                if i >= 2:
                    times[name].append(seconds)
        print(f"rows {size:3d}: " + "  ".join(f"{name} {statistics.median(t) * 1000:6.1f} ms"
                                               for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
