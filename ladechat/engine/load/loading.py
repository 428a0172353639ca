"""Load a causal LM for lookahead: a hub id, a local folder, a .gguf file, or the embedded default.

load() is the road map; each part is a module of its own beside this one:
  placement    the device and dtype on this machine, where the weights go (a device map,
               bitsandbytes), and what a user is told where a step's rows round otherwise
  readers      config, tokenizer and weights, by transformers or by ladechat's own readers
  memory       whether weights to be read dense fit in the memory available, before they are read
  mask_probe   whether the model honours a step's tree mask
  context      the most tokens a conversation holds
  governor     the thread counts the steps may follow the machine's load with
and the weights' layouts: gguf/ (a GGUF's blocks on ladechat's kernels), packing (oneDNN's),
requantize (--quantize)."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ladechat.engine.kernels import int4, native, norms, q4, step_ops
from ladechat.engine.kernels.attention import use_grouped_sdpa
from ladechat.engine.load import context, mask_probe, packing, placement, readers
from ladechat.engine.load.gguf import kept, quantized
from ladechat.engine.load.governor import governed
from ladechat.engine.load.spec import LoadError, LoadSpec
from ladechat.engine.models import llama
from ladechat.engine.threads import CpuThreads
from ladechat.paths import cache_root


@dataclass(frozen=True)
class LoadedModel:
    model: object
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]
    context_length: int
    notices: tuple[str, ...] = ()
    weights: str = ""  # the Linear weights' layouts and kernels in words (quantized.describe); "" all as loaded
    # On a CPU where the steps give the same bits on fewer threads (probed: engine/thread_probe.py),
    # their thread count, which follows the machine's other load (engine/threads.py); else None.
    threads: object = None

    @property
    def packed(self) -> bool:
        """Whether some Linear weights run packed for oneDNN (packing.py), not as transformers loads them."""
        return packing.is_packed(self.model)

    def as_loaded_switch(self, model) -> packing.LayoutSwitch:
        """`model` (this one, or transformers' twin of it: the same modules) runnable with its
        Linear weights as transformers loads them (LayoutSwitch.as_loaded), at the cost of a
        second copy of those weights: what HF's reference methods in the bench run on."""
        return packing.LayoutSwitch(model)


def bench_weights(compile: bool) -> str:
    """`ladechat bench`'s Linear weights when --weights is not given: what the chat runs (auto: a
    GGUF's blocks on ladechat's kernels, the rest packed where this device packs them), so the bench
    measures what users run; dense, as loaded, with --compile, which traces the model's own Linear
    modules."""
    return "dense" if compile else "auto"


def load(spec: LoadSpec, progress: Callable[[str], AbstractContextManager] | None = None,
         probe: Callable | None = None) -> LoadedModel:
    """The model `spec` names, with its tokenizer, prepared for lookahead (its Linear weights' layout,
    the attention function, a checked tree mask); progress(message) is shown during slow phases.
    probe: the thread probe (engine/thread_probe.cached_verdict, which runs the model's steps: the
    front ends' opener passes it), whose verdict lets the steps' thread count follow the machine's
    load; None: the steps keep the full count. LoadError (or ModelNotFound) with one line for
    whatever the user can fix."""
    kept_notices: list[str] = []
    with kept.writes_joined(kept_notices):  # the kernels' layouts a first load keeps, written meanwhile
        loaded = _load(spec, progress, probe)
    return replace(loaded, notices=loaded.notices + tuple(kept_notices))


def _load(spec: LoadSpec, progress: Callable[[str], AbstractContextManager] | None, probe: Callable | None
          ) -> LoadedModel:
    device, dtype = placement.checked(spec)
    # its first look at the machine now: the load's seconds are the first interval it measures
    threads = CpuThreads() if device.type == "cpu" else None
    notices: list[str] = []
    attn = _attention(spec.attn, notices)
    kernels = cache_root() / "kernels"
    if device.type == "cpu":  # compiled (a first run) while the model is read
        native.prebuild([step_ops.SOURCE], kernels)
    source, name, gguf_file = readers.locate(spec.model, progress)
    if spec.weights == "int4" and gguf_file is None:
        raise LoadError(f"--weights int4 runs a .gguf file's 4-bit (Q4_0, Q4_1, Q4_K) blocks; {name} is not a GGUF file")
    kwargs: dict = {"dtype": dtype, "attn_implementation": attn, **placement.quantization_config(spec, dtype, notices)}
    notices.extend(placement.parting_notices(device.type, dtype, spec.load_in_4bit, spec.load_in_8bit))
    kwargs.update(placement.arguments(spec, device))
    # Linear layouts (int4, packing) not with quantized weights (bitsandbytes, or a checkpoint's own
    # quantization_config) or a device map: accelerate's hooks sit on the modules they replace.
    layouts = spec.pack_weights and "device_map" not in kwargs and "quantization_config" not in kwargs
    to_int4 = layouts and spec.weights in ("auto", "int4") and gguf_file is not None and int4.supported(device)
    kernel_weights = to_int4 or spec.quantize is not None
    if kernel_weights and spec.dtype == "auto" and shutil.which(native.COMPILER):
        # ladechat's 4-bit kernels quantize a step's rows to int8 whatever the dtype, so bf16 saves
        # nothing there (fp32 steps of the embedded model were as fast or faster, BENCHMARKS.md)
        # while fp32 keeps the rest of the step (norms, attention, residuals) exact: auto picks it
        dtype = kwargs["dtype"] = torch.float32
    if kernel_weights:
        native.prebuild([q4.SOURCE], kernels)  # q8's kernel too: one library
    if spec.quantize:  # read in the checkpoint's own dtype (an 8B's fp32 copy would not fit), the rest cast after
        kwargs["dtype"] = "auto"
        if not shutil.which(native.COMPILER):  # before reading gigabytes
            raise LoadError(f"--quantize runs on ladechat's CPU kernels, which need a C++ compiler ({native.COMPILER})")
    build = readers.builder(spec, source, name, gguf_file, kwargs, device, kernels if to_int4 else None, progress)
    tokenizer, model, applied = readers.read(spec.model or source, source, name, device, kwargs, build, gguf_file,
                                      readers.float_weights if spec.quantize else None)
    if attn == "sdpa" and model.config._attn_implementation == "eager":
        notices.append(f"{name}: transformers has no sdpa attention for {type(model).__name__}; using eager")
        attn = "eager"
    layouts = layouts and getattr(model, "hf_quantizer", None) is None
    if spec.quantize:
        applied = readers.requantized(model, spec.quantize, name, source, kernels, dtype, progress)
    if applied is not None:  # the GGUF's 4-bit blocks and Q8_0 output layer, put in as the model was built
        notices.extend(applied.notices)
        if spec.weights == "int4" and not applied.replaced:
            notices.append(f"{name} has no 4-bit (Q4_0, Q4_1, Q4_K) Linear weights the int4 kernel takes; "
                           "running them as --weights packed")
    blocks = layouts and kernel_weights and applied is not None and applied.replaced > 0 and model.device.type == "cpu"
    _step_kernels(model, blocks, attn, kernels, progress, notices)
    model = mask_probe.check_tree_mask(model, name, attn, source if Path(source).is_dir() else None, notices)
    # pack() itself leaves weights on devices and in dtypes it does not pack.
    if layouts and spec.weights != "dense":
        packing.pack(model)
    if spec.own_forward and not isinstance(model, llama.Llama) and llama.accepts(model) is None:
        model = llama.Llama.adopt(model)  # transformers' wrapper dropped: its modules are the Llama's
    cap = context.context_cap(context.context_length(model.config), spec.context_size)
    threads = governed(threads, model, name, source, gguf_file, progress, probe)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=model.device, dtype=model.dtype,
                       eos_ids=readers.eos_ids(model, tokenizer), context_length=cap,
                       notices=tuple(notices), weights=quantized.describe(model), threads=threads)


def _step_kernels(model, blocks: bool, attn: str, kernels: Path, progress, notices: list[str]) -> None:
    """A step's small ops by ladechat's kernels (step_ops.py). Where the weights are blocks on its
    kernels (`blocks`), not the checkpoint's floats, the norms by the kernel too (norms.py) and
    attention row by row, so a lookahead step's rows are plain decoding's (attention.py)."""
    unbuilt = step_ops.load(kernels, progress) if model.device.type == "cpu" else None
    if blocks and unbuilt:
        notices.append(f"the RMSNorm layers run as transformers' modules: {unbuilt}")
    elif blocks:
        norms.apply(model)
    if attn == "sdpa":
        # lookahead's masked steps without a copy of the cache per query head
        use_grouped_sdpa(model, rowwise=blocks and not unbuilt)


def _attention(attn: str, notices: list[str]) -> str:
    """The attention implementation to load with: flash's kernels cannot take the lookahead step's
    arbitrary 4D mask, so it is sdpa then (with a notice)."""
    if attn != "flash":
        return attn
    if importlib.util.find_spec("flash_attn") is None:
        notices.append("flash-attn is not installed (pip install 'ladechat[flash]'); using sdpa")
    else:
        notices.append("flash-attn cannot take the lookahead step's tree mask; using sdpa for every step")
    return "sdpa"


