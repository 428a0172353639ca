"""Load a causal LM for lookahead: a hub id, a local folder, a .gguf file, or the embedded default."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ladechat.engine.kernels import int4, native, norms, q4, q6, q8, step_ops
from ladechat.engine.kernels.attention import use_grouped_sdpa
from ladechat.engine.load import checkpoint, packing, requantize
from ladechat.engine.load.gguf import files as gguf_files
from ladechat.engine.load.gguf import head, kept, quantized
from ladechat.engine.load.spec import LoadError, LoadSpec
from ladechat.engine.models import llama, transformers_model
from ladechat.engine.threads import CpuThreads
from ladechat.errors import ModelNotFound
from ladechat.paths import cache_root, source_digest

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# A local model folder needs one of these for AutoTokenizer (without it transformers' error reads
# like a failed download).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


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


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo unless given."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    """The device --device names; a GPU always with its index (a device map needs one)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
            raise LoadError(f"--device {name} asked for a GPU, but CUDA is not available here ({build}); "
                            "use --device cpu")
        index = name.removeprefix("cuda").removeprefix(":")
        count = torch.cuda.device_count()
        if index and not (index.isdigit() and int(index) < count):
            raise LoadError(f"--device {name}: no such GPU ({count} visible: cuda:0 to cuda:{count - 1})")
        return torch.device("cuda", int(index) if index else torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps" and torch.backends.mps.is_available():
        return torch.device("mps")
    raise LoadError(f"unknown or unavailable --device {name!r} (choose auto, cpu, cuda, cuda:N)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device.type, name == "auto" and has_native_bf16(device))


def choose_dtype(name: str, device_type: str, native_bf16: bool) -> torch.dtype:
    """--dtype NAME on a device of this type, which computes bf16 natively or not. auto: bf16 where
    native; else fp16 on a GPU (T4 and V100 only emulate bf16, several times slower) and fp32 elsewhere."""
    if name == "auto":
        if native_bf16 and device_type in ("cuda", "cpu"):
            return torch.bfloat16
        return torch.float16 if device_type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LoadError(f"unknown --dtype {name!r} (choose auto, float32, bfloat16, float16)")
    return DTYPES[name]


def has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        if torch.version.hip:  # ROCm GPUs compute bf16; their CUDA compute capability means nothing
            return torch.cuda.is_bf16_supported(including_emulation=False)
        # is_bf16_supported() asks about the current device, which need not be the chosen cuda:N;
        # bf16 units came with Ampere (compute capability 8.0).
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and cpu_has_native_bf16()


def placement(spec: LoadSpec, device: torch.device) -> dict:
    """from_pretrained's device_map (and max_memory) arguments. Quantized weights cannot be moved with
    .to() after loading, so they are placed on --device while they load; without a device map
    transformers would put them on the current GPU whatever --device says. Other weights go straight
    to a GPU too (read into CPU memory first, a model would need its size in RAM and a second copy);
    on the CPU they need no map."""
    if spec.device_map:
        kwargs: dict = {"device_map": spec.device_map}
        if spec.max_memory is not None:
            # Layers that fit nowhere are offloaded to disk, into a folder of ours.
            kwargs["max_memory"] = {int(d) if d.isdigit() else d: size for d, size in spec.memory_limits}
            kwargs["offload_folder"] = str(cache_root() / "offload")
        return kwargs
    if spec.load_in_4bit or spec.load_in_8bit or device.type != "cpu":
        return {"device_map": {"": str(device)}}
    return {}


def _source(model: str | None, progress) -> tuple[str, str, Path | None]:
    """(folder or hub id to load, display name, the GGUF file or None); a GGUF's folder holds its
    config and tokenizer (gguf_files.ensure_prepared)."""
    if model is None:
        path = gguf_files.embedded_gguf()
        return str(gguf_files.ensure_prepared(path, progress)), gguf_files.EMBEDDED_NAME, path
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if path.is_dir():
            raise ModelNotFound(f"{model} is a folder, not a GGUF file")
        if path.exists() and not path.is_file():
            raise ModelNotFound(f"{model} is not a regular file (a GGUF file is read from disk)")
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {model}")
        try:
            return str(gguf_files.ensure_prepared(path, progress)), path.name, path
        except gguf_files.BadGGUF as exc:
            raise LoadError(str(exc)) from None
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFound(f"{model} is not a model folder (no config.json in it)")
        return str(path), model, None
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelNotFound(f"model folder not found: {model}")
    return model, model, None


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
    device, dtype = _checked(spec)
    # its first look at the machine now: the load's seconds are the first interval it measures
    threads = CpuThreads() if device.type == "cpu" else None
    notices: list[str] = []
    attn = _attention(spec.attn, notices)
    kernels = cache_root() / "kernels"
    if device.type == "cpu":  # compiled (a first run) while the model is read
        native.prebuild([step_ops.SOURCE], kernels)
    source, name, gguf_file = _source(spec.model, progress)
    if spec.weights == "int4" and gguf_file is None:
        raise LoadError(f"--weights int4 runs a .gguf file's 4-bit (Q4_0, Q4_1, Q4_K) blocks; {name} is not a GGUF file")
    kwargs: dict = {"dtype": dtype, "attn_implementation": attn, **_quantization(spec, dtype, notices)}
    notices.extend(parting_notices(device.type, dtype, spec.load_in_4bit, spec.load_in_8bit))
    kwargs.update(placement(spec, device))
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
    build = _builder(spec, source, name, gguf_file, kwargs, device, kernels if to_int4 else None, progress)
    tokenizer, model, applied = _read(spec.model or source, source, name, device, kwargs, build, gguf_file,
                                      _float_weights if spec.quantize else None)
    if attn == "sdpa" and model.config._attn_implementation == "eager":
        notices.append(f"{name}: transformers has no sdpa attention for {type(model).__name__}; using eager")
        attn = "eager"
    layouts = layouts and getattr(model, "hf_quantizer", None) is None
    if spec.quantize:
        applied = _quantized(model, spec.quantize, name, source, kernels, dtype, progress)
    if applied is not None:  # the GGUF's 4-bit blocks and Q8_0 output layer, put in as the model was built
        notices.extend(applied.notices)
        if spec.weights == "int4" and not applied.replaced:
            notices.append(f"{name} has no 4-bit (Q4_0, Q4_1, Q4_K) Linear weights the int4 kernel takes; "
                           "running them as --weights packed")
    blocks = layouts and kernel_weights and applied is not None and applied.replaced > 0 and model.device.type == "cpu"
    _step_kernels(model, blocks, attn, kernels, progress, notices)
    model = _check_tree_mask(model, name, attn, source if Path(source).is_dir() else None, notices)
    # pack() itself leaves weights on devices and in dtypes it does not pack.
    if layouts and spec.weights != "dense":
        packing.pack(model)
    if spec.own_forward and not isinstance(model, llama.Llama) and llama.accepts(model) is None:
        model = llama.Llama.adopt(model)  # transformers' wrapper dropped: its modules are the Llama's
    cap = context_cap(context_length(model.config), spec.context_size)
    governed = _governed(threads, model, name, source, gguf_file, progress, probe)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=model.device, dtype=model.dtype,
                       eos_ids=eos_ids(model, tokenizer), context_length=cap,
                       notices=tuple(notices), weights=quantized.describe(model), threads=governed)


def _builder(spec: LoadSpec, source: str, name: str, gguf_file: Path | None, kwargs: dict, device: torch.device,
             kernels: Path | None, progress) -> Callable | None:
    """_read's `build(config)`: ladechat's own reading of a GGUF (but one spread by a device map,
    which transformers' GGUF load does) or of a checkpoint of a family it runs itself on a CPU
    (placed and quantized weights aside); None: from_pretrained reads it."""
    if gguf_file is not None and not spec.device_map:
        return lambda config: _from_gguf(Path(source), gguf_file, config, kwargs, device, kernels, progress,
                                         blocks_embedding=spec.pack_weights, own_forward=spec.own_forward)
    if gguf_file is None and spec.own_forward and device.type == "cpu" and "device_map" not in kwargs \
            and "quantization_config" not in kwargs:
        return lambda config: _from_checkpoint(source, config, kwargs, progress, name)
    return None


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


def _governed(threads: CpuThreads | None, model, name: str, source: str, gguf_file: Path | None, progress,
              probe: Callable | None) -> CpuThreads | None:
    """The thread governor, allowed the counts whose steps give the full count's bits on this CPU
    (thread_probe.py), or None where only the full count does: a lookahead answer must equal plain
    decoding's whatever the machine's load did meanwhile. MKL's dense fp32 products split their sums
    by the thread count by design, so a model with dense Linear weights is not probed."""
    if probe is None or threads is None or threads.ceiling == 1 or "dense" in quantized.weight_layout(model):
        return None
    folder = Path(source) if Path(source).is_dir() else None
    what = None
    if folder is not None:  # a model whose files can be named: its verdict is kept
        files = model_files(folder)
        origin = (str(gguf_file.resolve()), gguf_file.stat().st_size) if gguf_file is not None else None
        what = [str(folder.resolve()), files, origin, quantized.weight_layout(model)]
    with progress("checking which thread counts give the same results") if progress else nullcontext():
        verdict = probe(model, what, threads.ceiling, cache_root() / "thread-probe" if what is not None else None)
    if len(verdict.counts) < 2:
        return None
    threads.restrict(verdict.counts, verdict.widest)
    return threads


def _checked(spec: LoadSpec) -> tuple[torch.device, torch.dtype]:
    """The device and dtype `spec` asks for on this machine (the spec checked itself when built)."""
    # --quantize's blocks run on the CPU: there by default, whatever GPU there is
    device = resolve_device("cpu" if spec.quantize and spec.device == "auto" else spec.device)
    if spec.quantize and device.type != "cpu":
        raise LoadError(f"--quantize runs on ladechat's CPU kernels, not on {device}; there --load-in-4bit or "
                        "--load-in-8bit quantize with bitsandbytes")
    dtype = resolve_dtype(spec.dtype, device)
    if spec.weights == "int4" and not int4.supported(device):
        raise LoadError(f"--weights int4 runs on an x86-64 CPU with torch's int4 kernel "
                        f"(torch.ops.aten.{int4.KERNEL}), not on {device}; use --weights auto")
    if spec.weights == "packed" and not packing.supported(device, dtype):
        raise LoadError(f"--weights packed needs an x86-64 CPU with oneDNN (bf16: with native bf16), "
                        f"not {device} in {str(dtype).removeprefix('torch.')}; use --weights auto")
    return device, dtype


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


def _quantization(spec: LoadSpec, dtype: torch.dtype, notices: list[str]) -> dict:
    """from_pretrained's quantization_config for --load-in-4bit / --load-in-8bit ({} for neither)."""
    if not (spec.load_in_4bit or spec.load_in_8bit):
        return {}
    flag = "--load-in-4bit" if spec.load_in_4bit else "--load-in-8bit"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise LoadError(f"{flag} needs bitsandbytes, which is not installed or does not import ({exc}): "
                        "pip install 'ladechat[quant]'") from None
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=spec.load_in_4bit, load_in_8bit=spec.load_in_8bit,
                                                      bnb_4bit_compute_dtype=dtype if spec.load_in_4bit else None)}


def parting_notices(device_type: str, dtype: torch.dtype, four_bit: bool, eight_bit: bool) -> list[str]:
    """What a user is told where a lookahead step's rows need not round as plain decoding's one row
    does, so a greedy answer can part from plain decoding's after a near-tie (measured on an H200:
    BENCHMARKS.md). A GPU's products pick their kernel and reduction order by the number of rows;
    LLM.int8 splits outlier columns by all of a step's rows, on any device."""
    if eight_bit:
        return ["8-bit weights (LLM.int8) compute each row of a step in ways that depend on the other rows, "
                "so lookahead answers can differ from plain decoding after a near-tie"
                + ("; --load-in-4bit keeps them identical" if device_type == "cpu" else "")]
    if device_type != "cuda":
        return []
    if four_bit:
        return [("4-bit weights (bitsandbytes) on a GPU run a one-row step on another kernel than a step of "
                 "several rows, so lookahead answers can differ from plain decoding after a near-tie")]
    if dtype in (torch.bfloat16, torch.float16):
        return [(f"on a GPU in {str(dtype).removeprefix('torch.')} a lookahead step's rows can round differently "
                 "from plain decoding's one row, so an answer can part from plain decoding's after a near-tie "
                 "(--dtype float32 makes that rarer)")]
    return []


def _read(asked: str, source: str, name: str, device: torch.device, kwargs: dict, build=None,
          gguf_file: Path | None = None, check: Callable | None = None):
    """(tokenizer, model in eval mode on its device, what `build` applied) from `source` (a folder or
    hub id; `asked`: what the user gave, for messages): built by `build(config)` (_from_gguf,
    _from_checkpoint: (model, quantized.Applied or None), or None where it does not build this one)
    where given, else loaded with from_pretrained's `kwargs` (from `gguf_file` by transformers' own
    GGUF reader, where given)."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local = Path(source).is_dir()
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        # a local folder's config.json that is not valid JSON or has a field of the wrong type
        if local:
            raise LoadError(f"cannot load model {name}: bad config.json: {_one_line(exc)}") from None
        raise ModelNotFound(_not_found(asked, exc)) from None
    if getattr(config, "is_encoder_decoder", False):
        raise LoadError(f"{name} is an encoder-decoder model; ladechat needs a decoder-only causal LM")
    if check is not None:
        check(config, name)
    if local and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        raise LoadError(f"{name} has no tokenizer in it (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as exc:
        raise LoadError(f"cannot load the tokenizer of {name}: {_one_line(exc)}" if local
                        else _not_found(asked, exc)) from None
    if kwargs.get("attn_implementation") == "sdpa" and not _has_sdpa(config):
        kwargs["attn_implementation"] = "eager"  # load() says so
    try:
        built = build(config) if build is not None else None
        if built is not None:
            return tokenizer, *built
        if gguf_file is not None:
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        if "device_map" not in kwargs:  # on the CPU, where it was loaded
            model = model.to(device)
    except gguf_files.BadGGUF as exc:
        raise LoadError(str(exc)) from None
    except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a file that does not parse
        raise LoadError(_not_found(asked, exc) if not local else f"cannot load model {name}: {_one_line(exc)}") from None
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise LoadError(_out_of_memory(name, device, exc)) from None
    except RuntimeError as exc:
        if "can't allocate memory" in str(exc):  # the CPU allocator's out-of-memory is a plain RuntimeError
            raise LoadError(_out_of_memory(name, device, exc)) from None
        if "mismatch" in str(exc):  # transformers' report of the tensors is logged, which we silence
            raise LoadError(f"cannot load model {name}: its weights do not have the shapes its config.json "
                            "gives (a mismatched or corrupt checkpoint)") from None
        raise
    return tokenizer, model.eval(), None


def _has_sdpa(config) -> bool:
    """Whether transformers' model class for `config` runs torch's SDPA (Gemma 2 does not)."""
    from transformers import AutoModelForCausalLM

    try:
        return bool(getattr(AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", True))
    except (KeyError, ValueError, AttributeError):  # a class transformers maps otherwise: it says so itself
        return True


def _from_checkpoint(source: str, config, kwargs: dict, progress, name: str) -> tuple | None:
    """(the Llama of a Llama-family checkpoint, its tensors read by name from its safetensors files
    (checkpoint.py), None) where engine/models/llama.py runs the model and the files hold its
    tensors by their names; None for any other (from_pretrained reads it, then load() adopts what
    it can). LoadError where the weights it must cast would not fit in the memory available."""
    folder = _folder(source)
    if folder is None or getattr(config, "quantization_config", None) is not None \
            or llama.takes(config, kwargs["attn_implementation"]) is not None:
        return None
    found = checkpoint.tensors(folder)
    if found is None:
        return None
    dtype = checkpoint.checkpoint_dtype(found, config) if kwargs["dtype"] == "auto" else kwargs["dtype"]
    model = llama.Llama.empty(config, dtype, kwargs["attn_implementation"])
    if checkpoint.misfit(model, found) is not None:
        return None
    # the weights cast to another dtype are copies; the rest stay the file's pages (the page cache's)
    needed, available = checkpoint.copied_bytes(model, found, dtype), available_memory()
    if available is not None and needed > available:
        raise LoadError(f"not enough memory for {name}: its weights are {_size(needed)} in "
                        f"{str(dtype).removeprefix('torch.')}, and {_size(available)} is available")
    checkpoint.read_into(model, found, dtype, progress, name)
    config.dtype = dtype  # as from_pretrained records it
    _generation_config(model, folder)
    return model, None


def _generation_config(model, folder: Path) -> None:
    """The folder's generation_config.json, as from_pretrained reads it, where it has one (else the
    one made from the model's config stays)."""
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def _from_gguf(folder: Path, gguf_file: Path, config, kwargs: dict, device: torch.device, kernels: Path | None,
               progress, blocks_embedding: bool = True, own_forward: bool = False) -> tuple:
    """(the model of `gguf_file`, built from its blocks as they are, in eval mode on `device`;
    quantized.Applied or None). Built empty (parameters on the meta device); with `kernels` (a CPU that
    runs them), its Q4_0/Q4_1/Q4_K Linear weights and its Q8_0 output layer go into the kernels'
    layout first (quantized.py, head.py: read from the file once and kept in `folder`); then every other
    tensor is dequantized on its own into the model's dtype on `device` (gguf_files.read_tensors). No
    dense copy of the weights is made at any point. own_forward: a family ladechat runs itself is
    built as its own model (engine/models/) on a CPU, not as transformers'."""
    try:
        return _build_from_gguf(folder, gguf_file, config, kwargs, device, kernels, progress, blocks_embedding,
                                own_forward)
    finally:
        gguf_files.reader.cache_clear()  # the first load's parsed metadata: not kept with the model


def _build_from_gguf(folder: Path, gguf_file: Path, config, kwargs: dict, device: torch.device, kernels: Path | None,
                     progress, blocks_embedding: bool, own_forward: bool) -> tuple:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    dtype = kwargs["dtype"]
    if own_forward and device.type == "cpu" \
            and llama.takes(config, kwargs["attn_implementation"]) is None:
        model = llama.Llama.empty(config, dtype, kwargs["attn_implementation"])
    else:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=kwargs["attn_implementation"])
    index = gguf_files.tensor_index(model, gguf_file, folder)  # before any module is replaced
    applied = None
    if kernels is not None:
        four_bit = quantized.apply(model, gguf_file, folder, kernels, progress)
        # its Q8_0 output layer at 8 bits too
        applied = quantized.Applied(four_bit.replaced, four_bit.kinds,
                               four_bit.notices + head.apply(model, gguf_file, folder, kernels, progress).notices)
    if device.type == "cpu" and blocks_embedding:  # not for --compile: graphs cannot trace gguf-py's lookup
        gguf_files.keep_embedding_as_blocks(model, gguf_file, index, dtype)
    empty = {name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta}
    if device.type == "cpu":
        _check_dense_fits(model, gguf_file, index, empty, available_memory())
    if applied is not None:
        applied = replace(applied, notices=applied.notices + _no_kernel_notices(model, gguf_file, index, empty))
    state = gguf_files.read_tensors(model, gguf_file, index, dtype, device, empty, progress)
    loaded = model.load_state_dict(state, strict=False, assign=True)
    # a kernel's output module computes .weight dense on each read: ask for the Parameter itself
    output = model.get_output_embeddings()
    if output is not None and isinstance(output._parameters.get("weight"), torch.nn.Parameter):
        # as from_pretrained ties: only what the file lacks (an output layer on the Q8_0 kernel is its own)
        model.tie_weights(missing_keys=set(loaded.missing_keys))
    empty = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if empty:
        raise LoadError(f"cannot load {gguf_file.name}: it has no weights for {', '.join(empty[:3])}"
                        + (f" and {len(empty) - 3} more" if len(empty) > 3 else ""))
    if device.type != "cpu":
        model = model.to(device)  # the buffers (rotary tables), made on the CPU
    _generation_config(model, folder)
    return model.eval(), applied


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new process can take without swapping (MemAvailable), None
    where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_dense_fits(model, gguf_file: Path, index: dict, empty: set[str], available: int | None) -> None:
    """LoadError (one line) where the tensors still to be read dense, in the model's dtype (those
    without a kernel for their blocks here, e.g. an F16 file's, or a Q3_K_M file's Q3_K ones), would not fit in the
    memory available: the kernel's OOM killer would otherwise end the process without a word."""
    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    needed = sum(tensors[name].numel() * tensors[name].element_size() for name in empty)
    if available is None or needed <= available:
        return
    kinds = sorted(_dense_kinds(model, index, empty))
    what = f"its {'/'.join(kinds)} tensors" if kinds else "its tensors"
    raise LoadError(f"not enough memory for {gguf_file.name}: {what} run dense here, "
                    f"{_size(needed)} in {str(model.dtype).removeprefix('torch.')}, and {_size(available)} is available")


def _no_kernel_notices(model, gguf_file: Path, index: dict, empty: set[str]) -> tuple[str, ...]:
    """A notice naming the block types of the file's weights that no kernel here runs (IQ4_XS,
    Q3_K, ...; and every type of BLOCK_KINDS where ladechat's kernels do not run: no compiler, no
    AVX2) and so run dequantized into the model's dtype: slower and larger than the file. A Q8_0
    embedding that runs dense because its module scales its rows (Gemma) is not news."""
    ours = quantized.BLOCK_KINDS if q4.loaded() and q4.best_path() >= 1 else ()
    kinds = sorted(_dense_kinds(model, index, empty) - {*ours, "F32"})
    if not kinds:
        return ()
    dtype = str(model.dtype).removeprefix("torch.")
    return (f"{gguf_file.name}: its {'/'.join(kinds)} tensors run dequantized to {dtype} (no kernel for them here)",)


def _dense_kinds(model, index: dict, empty: set[str]) -> set[str]:
    """The GGUF block types of the weights (2-D tensors) among `empty`: those still to be read dense."""
    from gguf import GGMLQuantizationType

    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    return {GGMLQuantizationType(where["type"]).name for name, where in index["tensors"].items()
            if name in empty and tensors[name].dim() >= 2}


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def _check_tree_mask(model, name: str, attn: str, folder: str | None, notices: list[str]):
    """The model to run, once it honours the step's 4D mask with explicit positions (LoadError
    where it does not): itself, or transformers' model switched to eager attention (with a notice)
    where only that does (a Llama's twin over its modules: its own steps do not run eager)."""
    try:
        if honours_tree_mask(model, folder, model.config._attn_implementation):
            return model
    except NotFinite as exc:
        raise LoadError(f"{name}: {exc}") from None
    if isinstance(model, llama.Llama):
        model = model.transformers_twin()
    if attn != "eager":
        model.set_attn_implementation("eager")
        try:
            honoured = mask_probe(model)
        except NotFinite as exc:
            raise LoadError(f"{name} under eager attention: {exc}") from None
        if honoured:
            notices.append(f"{name} ignores 4D masks under {attn}; switched to eager attention")
            return model
    raise LoadError(f"{name} does not honour a 4D attention mask with position ids, "
                    "so lookahead cannot run on it")


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' and huggingface_hub's span several)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def _out_of_memory(name: str, device: torch.device, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"out of memory loading {name} on {device} ({first}); try --load-in-4bit, --dtype float16, "
            "or --device-map auto to spread it over devices")


def _not_found(model: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hints = ("offline", "connect", "couldn't", "not a local folder")
    if any(h in text.lower() for h in hints):
        return (f"model {model!r} is not in the local Hugging Face cache and the hub cannot be reached; "
                "pass a local folder or .gguf file, or download it first")
    return f"cannot load model {model!r}: {text}"


def eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


DEFAULT_CONTEXT = 8192  # a 128k-context model's cache would otherwise grow until memory runs out


def context_cap(model_length: int, asked: int | None) -> int:
    """The tokens a conversation may hold: --ctx where given (no more than the model's own length),
    else the model's length up to DEFAULT_CONTEXT."""
    if asked is None:
        return min(model_length, DEFAULT_CONTEXT)
    if asked > model_length:
        raise LoadError(f"--ctx {asked} is more than the model's context of {model_length} tokens")
    return asked


def context_length(config) -> int:
    length = getattr(config, "max_position_embeddings", None) or 2048
    window = getattr(config, "sliding_window", None)
    # Our 4D mask is full attention for every layer, so a sliding-window model is exact only
    # while the whole conversation fits in its window.
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, window)
    return int(length)


def model_files(folder: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the files of a model folder, which key the verdicts kept for it; not
    the blocks a GGUF's folder keeps for later loads: they are the GGUF's, named by its folder, and
    are still being written while a first load's probes run (kept.keep_beside_meanwhile)."""
    derived = (quantized.CACHE_PREFIX, head.CACHE_PREFIX)
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                  if f.is_file() and not (f.name.startswith(derived) and f.name.endswith((".safetensors", ".partial"))))


def _float_weights(config, name: str) -> None:
    """LoadError for a checkpoint that is quantized already (its own quantization_config: GPTQ,
    AWQ, bitsandbytes...), which --quantize cannot take: checked before it is read."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method) or "its own"  # transformers' QuantizationMethod enum
    raise LoadError(f"{name} is already quantized ({method} weights): --quantize takes a model of float weights")


def _quantized(model, quantize: str, name: str, source: str, kernels: Path, dtype: torch.dtype,
               progress) -> quantized.Applied:
    """--quantize: `model`'s (read dense) Linear weights put on ladechat's kernels as blocks
    (requantize.py), the rest in `dtype`."""
    try:
        return requantize.apply(model, requantize.KINDS[quantize], _checkpoint(source), kernels, dtype, progress, name)
    except requantize.QuantizeError as exc:
        raise LoadError(str(exc)) from None


def _checkpoint(source: str) -> tuple[str, str] | None:
    """A checkpoint's folder and its files as text (the key of its quantized layout, requantize.py);
    None where its folder is not found."""
    folder = _folder(source)
    return None if folder is None else (str(folder.resolve()), str(model_files(folder)))


def _folder(source: str) -> Path | None:
    """A checkpoint's folder: a local one, or a hub id's in the hub's cache; None where neither is found."""
    folder = Path(source)
    if folder.is_dir():
        return folder
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def honours_tree_mask(model, folder: str | None, attn: str) -> bool:
    """mask_probe(model), remembered for a local model folder: a yes is kept per folder (its files'
    sizes and times), dtype, device type, attention kernel, library versions and our own code that
    builds the mask and attends under it, since the probe's three forward passes are a noticeable
    part of every start on a small CPU."""
    if folder is None:
        return mask_probe(model)
    import hashlib
    import json

    import transformers

    from ladechat.engine import layout
    from ladechat.engine.kernels import attention

    files = model_files(Path(folder))
    key = json.dumps(["v1", str(Path(folder).resolve()), files, str(model.dtype), model.device.type, attn,
                      torch.__version__, transformers.__version__, source_digest(attention.__file__, layout.__file__)])
    path = cache_root() / "mask-probe" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if path.is_file():
        return True
    if not mask_probe(model):
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key + "\n")
    except OSError:  # a read-only cache only costs the probe next time
        pass
    return True


class NotFinite(ValueError):
    """mask_probe: the model's plain logits are not finite numbers."""


def mask_probe(model) -> bool:
    """Does the model honour an explicit 4D mask + position ids? Runs three tiny forwards.

    [a, b, c] where c may not see b and sits at position 1 must give c the same logits as the
    plain sequence [a, c].
    """
    from ladechat.engine.layout import StepLayout, step_inputs

    model = transformers_model(model)  # a Llama: transformers' forward over its modules and kernels
    device, dtype = model.device, model.dtype
    vocab = model.config.get_text_config().vocab_size
    a, b, c = 1 % vocab, 2 % vocab, 3 % vocab
    layout = StepLayout([a, b, c], [-1, 0, 0], 3, range(3), [{}, {}, {}], [])
    ids, positions, mask = step_inputs(layout, 0, dtype, device)
    with torch.inference_mode():
        tree = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0, 2].float()
        plain = model(input_ids=torch.tensor([[a, c]], device=device)).logits[0, 1].float()
        leak = model(input_ids=torch.tensor([[a, b, c]], device=device)).logits[0, 2].float()
    if not torch.isfinite(plain).all():  # no mask in that pass: the weights themselves are at fault
        raise NotFinite("its logits are NaN or infinite on a plain forward pass: the weights are not numbers "
                        "(a corrupt or badly converted file)")
    # 4-bit Linear modules round their activations (to int8 codes, or bf16 on torch's kernel): their
    # rows are as close as bf16's
    rounded_products = any(type(m) in (int4.Int4Linear, q4.Q4Linear, q6.Q6Linear, q8.Q8Linear)
                           for m in model.modules())
    tol = 1e-3 if dtype == torch.float32 and not rounded_products else 5e-2
    close = torch.allclose(tree, plain, atol=tol * max(1.0, float(plain.abs().max())), rtol=0)
    return close and not torch.allclose(tree, leak, atol=1e-6, rtol=0)
