"""How much a forward step costs as a function of how many tokens it feeds, on this device.

Lookahead pays off only when the tokens a step accepts outweigh what the extra rows cost, and on a
CPU that cost curve is far from flat and differs between machines and weight layouts (the embedded
model in fp32 on a 2-core EPYC, 192 cached tokens: with the weights as transformers loads them 1
token ~58 ms, 2-8 tokens 86-120 ms; packed for oneDNN (packing.py) 43-47 ms up to 8 tokens, 57 at
16). The curve is measured once per model, device, dtype and weight layout (a second or two) and
cached, so the decoder can size its steps from it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ladechat.engine import attention, int4, kv, layout, packing
from ladechat.engine.gguf import cache_root, source_digest
from ladechat.engine.layout import build_layout, rows_device, step_inputs
from ladechat.engine.recycle import TOP_K

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (192, 1536)  # cached tokens: a fresh question, and a conversation a few turns in
GPU_SIZES = (1, 8, 16, 32, 64, 96, 128, 160, 192, 256)  # a GPU's curve stays flat much longer


def measure(model, sizes=SIZES, context: int = 192, reps: int = 5) -> dict[int, float]:
    """Median seconds of one step feeding `s` tokens after `context` cached tokens, per size s.

    The sizes take turns (1, 2, 4, ..., then 1, 2, 4, ... again) rather than running each size's
    repetitions back to back: a busy spell of the machine then inflates one repetition of every
    size instead of all repetitions of one, and the medians keep the curve's shape, which is all
    the planner looks at."""
    device, dtype = model.device, model.dtype
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    rows_at = rows_device(model)
    cache, cache_arg = kv.new_cache(), kv.cache_argument(model)
    with torch.inference_mode():
        model(input_ids=prompt.to(device), **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
    # a chain of `size` tokens per step
    layouts = {size: build_layout([list(range(1, size + 1))], []) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for rep in range(reps + 1):
        for size in sizes:
            # the timing covers what a real step does around the forward pass: building its mask,
            # the logits of every row and their top-k back on the host
            start = time.perf_counter()
            ids, positions, mask = step_inputs(layouts[size], context, dtype, device)
            with torch.inference_mode():
                out = model(input_ids=ids, position_ids=positions, attention_mask=mask if size > 1 else None,
                            **{cache_arg: cache}, use_cache=True,
                            logits_to_keep=torch.arange(size, device=rows_at) if size > 1 else 1)
                out.logits[0].topk(min(TOP_K, out.logits.shape[-1]), dim=-1).indices.cpu()
            if rep:  # the first round is a warm-up
                times[size].append(time.perf_counter() - start)
            kv.truncate(cache, context)
    return {size: statistics.median(times[size]) for size in sizes}


def cache_path(model, name: str, *what) -> Path:
    """The cache file of this model's step costs on this device: `what` says which (a measured
    curve's sizes and cache length, or the envelope learned from real steps)."""
    # our code that a step runs is part of the key (the attention function, the mask, the cache,
    # this measurement), so a change to it measures afresh rather than trusting a curve of the old code
    code = source_digest(attention.__file__, layout.__file__, kv.__file__, packing.__file__, int4.__file__,
                         __file__)
    key = json.dumps([code, name, str(model.device), str(model.dtype), int4.weight_layout(model), torch.__version__,
                      torch.get_num_threads(), *what])
    return cache_root() / "step-cost" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached_curve(model, name: str, context: int = 192) -> dict[int, float]:
    sizes = GPU_SIZES if model.device.type == "cuda" else SIZES
    path = cache_path(model, name, list(sizes), context)
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        pass
    curve = measure(model, sizes, context)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve))
    return curve


@dataclass(frozen=True)
class CostModel:
    """Step cost as a function of tokens fed and tokens already cached: one measured curve per
    cache length, interpolated linearly between them (and extrapolated past the longest). Each
    extra row attends over the whole cache, so extra rows cost more in a long conversation."""

    curves: dict[int, dict[int, float]]  # cached tokens -> {tokens fed: seconds}

    def cost(self, size: int, cached: int) -> float:
        contexts = sorted(self.curves)
        if len(contexts) == 1:
            return cost(self.curves[contexts[0]], size)
        lo, hi = contexts[0], contexts[1]
        for a, b in zip(contexts, contexts[1:]):
            lo, hi = a, b
            if cached <= b:
                break
        at_lo, at_hi = cost(self.curves[lo], size), cost(self.curves[hi], size)
        share = max(0.0, (cached - lo) / (hi - lo))
        return at_lo + (at_hi - at_lo) * share


def cached_cost_model(model, name: str) -> CostModel:
    """This model's cost model on this device as measured: once per context length, then cached."""
    return CostModel({context: cached_curve(model, name, context) for context in CONTEXTS})


def learned_cost_model(model, name: str):
    """The cost model a chat plans with: the measured one, lowered by what real steps cost on this
    machine (cost_envelope.py), saved beside it."""
    from ladechat.engine.cost_envelope import CostEnvelope

    return CostEnvelope.load(cached_cost_model(model, name), cache_path(model, name, "envelope", list(CONTEXTS)))


def cost(curve: dict[int, float], size: int) -> float:
    """Interpolated cost of a step of `size` tokens."""
    sizes = sorted(curve)
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
