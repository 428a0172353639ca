"""`ladechat bench --step-cost`: what one decoding step costs as it feeds more tokens.

Lookahead wins when a step of S tokens costs little more than a step of one. This measures that
curve for a loaded model or a randomly initialised one of a known shape (no download needed,
e.g. Llama-2-7B on a GPU), in up to four ways side by side:
  dynamic   a growing cache, each step exactly its size, the model's own forward, eager
  llama     the same steps through engine/models/llama.py (the default on a CPU for the Llama
            family: bitwise the same logits without the forward's framework work; measured on a
            GPU too, where it is no default yet: a failure there is the result's `llama_error`,
            the other curves stand)
  static    pre-allocated cache, fixed-shape step, eager
  compiled  the static step through torch.compile (CUDA graphs on a GPU)   [--compile]
and HF `generate` per token as the baseline. A step of size 1 is plain decoding; larger steps are
lookahead windows of N=5 (S/4 columns), the logits of every row read, as a decoding step reads them.
"""

from __future__ import annotations

import statistics
import time

import torch

from ladechat.engine.config import LookaheadConfig
from ladechat.engine.kernels.attention import use_grouped_sdpa
from ladechat.engine.layout import build_layout
from ladechat.engine.load import packing
from ladechat.engine.models import llama, transformers_model
from ladechat.engine.runner import CompiledForward, DynamicRunner, ModelRunner, StaticRunner
from ladechat.engine.step_cost import prefill_random, time_step
from ladechat.errors import UserError

SIZES = (1, 8, 16, 32, 64, 128, 256)
LEVELS = 4  # N = 5
SHAPES = {  # Llama-architecture shapes: hidden, intermediate, layers, heads, kv heads, vocab, context
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256, 8192),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 8192),
    "tiny": (64, 128, 2, 4, 2, 96, 1024),
}


class StepBenchError(UserError, ValueError):
    pass


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise StepBenchError(f"--sizes needs comma-separated whole numbers, got {text!r}") from None
    bad = [s for s in sizes if s != 1 and (s < LEVELS or s % LEVELS)]
    if not sizes or bad:
        raise StepBenchError(f"step sizes must be 1 or multiples of {LEVELS} (N=5 windows), got {text!r}")
    return sizes


def random_model(shape: str, dtype: torch.dtype, device: torch.device, pack_weights: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise StepBenchError(f"unknown --shape {shape!r} (choose {', '.join(SHAPES)})")
    hidden, inter, layers, heads, kv_heads, vocab, context = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=context, attn_implementation="sdpa")
    try:
        with torch.device(device):
            # built in its dtype: an fp32 build then a cast would need twice the memory at its peak
            # (~27 GB for a 7B model, past the memory of many GPUs)
            model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    except torch.OutOfMemoryError:
        gigabytes = _parameters(shape) * torch.finfo(dtype).bits / 8 / 2**30
        dtype_name = str(dtype).removeprefix("torch.")
        raise StepBenchError(f"out of memory building the random {shape} model on {device} "
                             f"(its weights alone take {gigabytes:.1f} GiB in {dtype_name})") from None
    model.generation_config.eos_token_id = None
    use_grouped_sdpa(model)  # as loading does: what the chat would run
    if pack_weights:  # and this too where it packs (not for --compile)
        packing.pack(model)
    return model


def _parameters(shape: str) -> int:
    """The parameter count of a Llama of this shape (untied embeddings)."""
    hidden, inter, layers, heads, kv_heads, vocab, _ = SHAPES[shape]
    kv = hidden * kv_heads // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def _layout(size: int):
    if size == 1:
        return build_layout([[1]], [])
    width = size // LEVELS
    return build_layout([[1 + (level * width + col) % 50 for col in range(width)] for level in range(LEVELS)], [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fixed_config(size: int) -> LookaheadConfig:
    """Settings whose fixed-shape step has exactly `size` rows (1, or a multiple of LEVELS): a
    window of size / LEVELS columns and nothing else (no candidates, store or recycled rows)."""
    return LookaheadConfig(window=max(1, size // LEVELS), ngram=LEVELS + 1, candidates=0, context_candidates=0,
                           store=False, recycle=0, enabled=size > 1)


def _time_steps(runner, sizes, context: int, reps: int) -> dict[int, float]:
    prefill_random(runner, context)
    out = {}
    for size in sizes:
        if runner.fixed:  # a one-row step is lookahead off: the fixed shape follows
            runner.configure(fixed_config(size))
        layout = _layout(size)
        # two warm-up calls (compilation, allocation)
        out[size] = statistics.median([time_step(runner, layout, context) for _ in range(reps + 2)][2:])
    return out


def _hf_per_token(model, context: int, tokens: int = 32) -> float:
    """Seconds per token of HF greedy `generate` on the model as transformers loads it. Runs last:
    it unpacks a packed model in place (one layer at a time, not a second copy of a 7B model)."""
    packing.unpack(model)
    return _generate_per_token(model, context, tokens)


def _generate_per_token(model, context: int, tokens: int) -> float:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(model.device)
    times = []
    for _ in range(3):
        _sync(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=0)
        _sync(model.device)
        times.append(time.perf_counter() - start)
    # the prefill is part of generate: subtract one forward over the prompt
    with torch.inference_mode():
        _sync(model.device)
        start = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        _sync(model.device)
        prefill = time.perf_counter() - start
    return max(statistics.median(times) - prefill, 0.0) / tokens


def run(model, name: str, sizes=SIZES, context: int = 512, reps: int = 10, compile: bool = False) -> dict:
    """The curves of `model` (transformers' or a Llama ladechat runs itself: either way, both
    forwards over the same modules where the Llama file takes the model)."""
    given_own = isinstance(model, llama.Llama)
    own = model if given_own else None
    model = transformers_model(model)
    if own is None and llama.accepts(model, gpu=True) is None:
        own = llama.Llama.adopt(model, gpu=True)
    device = model.device
    la = fixed_config(max(sizes))
    context_length = context + max(sizes) + 8
    curves = {"dynamic": _time_steps(DynamicRunner(model), sizes, context, reps)}
    curves["static"] = _time_steps(StaticRunner(model, la, context_length), sizes, context, reps)
    if compile:
        compiled = StaticRunner(model, la, context_length, compiled=CompiledForward(model))
        curves["compiled"] = _time_steps(compiled, sizes, context, reps)
    own_error = None
    if own is not None:  # the model's layers without transformers' forward (a CPU's default)
        try:  # last but HF: on a GPU it is measured here first, and a broken device loses nothing before it
            curves["llama"] = _time_steps(ModelRunner(own, gpu=True), sizes, context, reps)
        except Exception as exc:  # there a failure is reported, the other curves stand; on a CPU it is a bug
            if device.type == "cpu":
                raise
            own_error = f"{type(exc).__name__}: " + next((line for line in str(exc).splitlines() if line.strip()), "")
    order = ("dynamic", "llama", "static", "compiled")  # the table's columns
    curves = {kind: curves[kind] for kind in order if kind in curves}
    packed, dtype = packing.is_packed(model), str(model.dtype).removeprefix("torch.")
    # Last: HF's generate on the modules unpacked in place, one layer at a time (not a second copy
    # of a 7B model): in the Llama where the caller gave one (a twin over them after), else in
    # transformers' model, the Llama over its modules let go first.
    if given_own:
        model = None
        packing.unpack(own)
        model = own.transformers_twin()
    own = None
    hf_per_token = _hf_per_token(model, context)
    return {"model": name, "device": str(device), "dtype": dtype, "packed_weights": packed, "context": context,
            "reps": reps, "hf_generate_per_token_s": hf_per_token,
            "curves": {kind: {str(s): t for s, t in curve.items()} for kind, curve in curves.items()},
            **({"llama_error": own_error} if own_error else {})}
