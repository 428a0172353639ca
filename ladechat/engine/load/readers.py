"""The readers: a model's config, tokenizer and weights from a hub id, a local folder or a GGUF
file, by transformers' from_pretrained or by ladechat's own (a GGUF's blocks as they are, a
checkpoint's safetensors by name), with one line for whatever a user can fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ladechat.engine.load import checkpoint, hub, memory, requantize
from ladechat.engine.load.gguf import files as gguf_files
from ladechat.engine.load.gguf import head, quantized
from ladechat.engine.load.spec import LoadError, LoadSpec
from ladechat.engine.models import llama
from ladechat.errors import ModelNotFound

# A local model folder needs one of these for AutoTokenizer (without it transformers' error reads
# like a failed download).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def locate(model: str | None, progress) -> tuple[str, str, Path | None]:
    """(folder or hub id to load, display name, the GGUF file or None); a GGUF's folder holds its
    config and tokenizer (gguf_files.ensure_prepared)."""
    if model is None:
        path = gguf_files.embedded_gguf()
        return str(gguf_files.ensure_prepared(path, progress)), gguf_files.EMBEDDED_NAME, path
    path = Path(model).expanduser()
    ref = None if path.exists() else hub.gguf_ref(model)
    if ref is not None:  # hf.co/ORG/REPO[:QUANT]: the file from the hub (its cache), then as any GGUF
        path = hub.fetch_shown(*ref, progress)
        try:
            return str(gguf_files.ensure_prepared(path, progress)), f"{ref[0]}:{ref[1]}", path
        except gguf_files.BadGGUF as exc:
            raise LoadError(str(exc)) from None
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


def builder(spec: LoadSpec, source: str, name: str, gguf_file: Path | None, kwargs: dict, device: torch.device,
             kernels: Path | None, progress) -> Callable | None:
    """read's `build(config)`: ladechat's own reading of a GGUF (but one spread by a device map,
    which transformers' GGUF load does) or of a checkpoint of a family it runs itself on a CPU
    (placed and quantized weights aside); None: from_pretrained reads it."""
    if gguf_file is not None and not spec.device_map:
        return lambda config: _from_gguf(Path(source), gguf_file, config, kwargs, device, kernels, progress,
                                         blocks_embedding=spec.pack_weights, own_forward=spec.own_forward)
    if gguf_file is None and spec.own_forward and device.type == "cpu" and "device_map" not in kwargs \
            and "quantization_config" not in kwargs:
        return lambda config: _from_checkpoint(source, config, kwargs, progress, name)
    return None


def read(asked: str, source: str, name: str, device: torch.device, kwargs: dict, build=None,
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
    needed, available = checkpoint.copied_bytes(model, found, dtype), memory.available_memory()
    if available is not None and needed > available:
        raise LoadError(f"not enough memory for {name}: its weights are {memory.size_text(needed)} in "
                        f"{str(dtype).removeprefix('torch.')}, and {memory.size_text(available)} is available")
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
        memory.check_dense_fits(model, gguf_file, index, empty, memory.available_memory())
    if applied is not None:
        applied = replace(applied, notices=applied.notices + memory.no_kernel_notices(model, gguf_file, index, empty))
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


def model_files(folder: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the files of a model folder, which key the verdicts kept for it; not
    the blocks a GGUF's folder keeps for later loads: they are the GGUF's, named by its folder, and
    are still being written while a first load's probes run (kept.keep_beside_meanwhile)."""
    derived = (quantized.CACHE_PREFIX, head.CACHE_PREFIX)
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                  if f.is_file() and not (f.name.startswith(derived) and f.name.endswith((".safetensors", ".partial"))))


def float_weights(config, name: str) -> None:
    """LoadError for a checkpoint that is quantized already (its own quantization_config: GPTQ,
    AWQ, bitsandbytes...), which --quantize cannot take: checked before it is read."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method) or "its own"  # transformers' QuantizationMethod enum
    raise LoadError(f"{name} is already quantized ({method} weights): --quantize takes a model of float weights")


def requantized(model, quantize: str, name: str, source: str, kernels: Path, dtype: torch.dtype,
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
