"""A GGUF file's header read quickly: the metadata's single values (arrays are stepped over) and
where each tensor lies, for reading the tensors as memory maps.

gguf-py's GGUFReader makes numpy views of every part of every metadata value, a million of them
for a tokenizer's vocabulary and merges (seconds on a small CPU, every first load); ladechat needs
the architecture, the alignment and the tensor table. The tensors are described as GGUFReader
describes them (its `data` arrays' shape and dtype), so either reads the same bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
# metadata value types: struct format of the single-valued ones; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# GGML types numpy holds as numbers of their own (as GGUFReader does); the rest as bytes
NUMPY_TYPES = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64"}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays in the metadata (the models made so far use one level)
MAX_LAYERS = 1024  # past any model made; a count beyond is a corrupt field, not a model


class HeaderError(ValueError):
    """Not a GGUF header, or one cut short (the message says where)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, GGML type, where its bytes start in the file and how many,
    and the array GGUFReader would give for it (shape, numpy dtype)."""

    path: Path
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    shape: tuple[int, ...]
    dtype: str
    elements: int  # the numbers it holds

    @property
    def data(self):
        """The tensor's bytes as a read-only numpy memory map (unmapped when dropped)."""
        import numpy as np

        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.data_offset, shape=self.shape)


@dataclass(frozen=True)
class Header:
    fields: dict  # key -> value, for the single-valued metadata (strings, numbers, booleans)
    tensors: list[TensorInfo]
    array_lengths: dict = field(default_factory=dict)  # key -> how many items, for the metadata's arrays

    @property
    def arch(self) -> str:
        return str(self.fields["general.architecture"])


class ArrayLength(int):
    """What the header reader keeps of a metadata array: its length."""


class _Cursor:
    def __init__(self, buffer, end: int) -> None:
        self.buffer, self.at, self.end = buffer, 0, end

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > self.end:
            raise HeaderError(f"the header is cut short at byte {self.at}")
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += size
        return value

    def _string_span(self) -> tuple[int, int]:
        """Where the next string's bytes lie (after its length), the cursor moved past them."""
        size = self.take("<Q")
        if self.at + size > self.end:
            raise HeaderError(f"the header is cut short at byte {self.at} (a string of {size} bytes)")
        start, self.at = self.at, self.at + size
        return start, self.at

    def string(self) -> str:
        start, stop = self._string_span()
        return bytes(self.buffer[start:stop]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self._string_span()

    def value(self, kind: int, keep: bool, depth: int = 0):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in SCALARS:
                self.at += count * struct.calcsize(SCALARS[item])
            elif item in (STRING, ARRAY):
                if item == ARRAY and depth >= MAX_NESTING:
                    raise HeaderError(f"its metadata nests arrays more than {MAX_NESTING} deep")
                for _ in range(count):  # each item takes 8 bytes at least: as many turns as the file holds
                    self.value(item, keep=False, depth=depth + 1)
            else:
                raise HeaderError(f"unknown metadata value type {item} in an array")
            if self.at > self.end:
                raise HeaderError("the header is cut short inside an array")
            return ArrayLength(count)
        raise HeaderError(f"unknown metadata value type {kind}")


def read_header(path: Path) -> Header:
    """The header of the GGUF at `path`. HeaderError for one that is not GGUF (version 2 or 3) or
    is cut short; OSError where the file cannot be read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        if size < 24:
            raise HeaderError(f"{size} bytes, shorter than a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _Cursor(buffer, size)
            if bytes(buffer[:4]) != MAGIC:
                raise HeaderError("it does not start with the GGUF magic bytes")
            cursor.at = 4
            version = cursor.take("<I")
            if version not in (2, 3):
                raise HeaderError(f"GGUF version {version} (ladechat reads 2 and 3)")
            count, kv_count = cursor.take("<Q"), cursor.take("<Q")
            fields, lengths = {}, {}
            for _ in range(kv_count):
                key = cursor.string()
                value = cursor.value(cursor.take("<I"), keep=True)
                if isinstance(value, ArrayLength):
                    lengths[key] = int(value)
                elif value is not None:
                    fields[key] = value
            raw = []
            for _ in range(count):
                name = cursor.string()
                n_dims = cursor.take("<I")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise HeaderError(f"tensor {name!r} has {n_dims} dimensions (a GGUF tensor has 1 to {MAX_DIMS})")
                dims = [cursor.take("<Q") for _ in range(n_dims)]
                raw.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
            alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
            if not _is_int(alignment) or not 0 < alignment <= 2**20 or alignment & (alignment - 1):
                raise HeaderError(f"its alignment {alignment!r} is not a power of two")
            start = cursor.at + (-cursor.at % alignment)
    tensors = []
    for name, dims, kind, offset in raw:
        try:
            ggml_type = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise HeaderError(f"tensor {name} has an unknown type {kind}") from None
        if any(dim < 1 for dim in dims) or dims[0] % block:
            raise HeaderError(f"tensor {name} has the dimensions {dims}: each must be positive, the first a "
                              f"multiple of its {ggml_type.name} blocks' {block}")
        shape = tuple(reversed(dims)) or (1,)
        elements = 1
        for dim in dims:
            elements *= dim
        n_bytes = elements // block * type_size
        if offset % alignment or start + offset + n_bytes > size:
            raise HeaderError(f"tensor {name}'s {n_bytes} bytes at offset {offset} lie "
                              + ("off the alignment" if offset % alignment else f"past the file's end ({size} bytes)"))
        if kind in NUMPY_TYPES:
            dtype = NUMPY_TYPES[kind]
        else:  # bytes: a row's blocks in the last dimension, as GGUFReader gives them
            dtype, shape = "uint8", (*shape[:-1], shape[-1] // block * type_size)
        tensors.append(TensorInfo(path, name, ggml_type, start + offset, n_bytes, shape, dtype, elements))
    return Header(fields, tensors, lengths)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(header: Header) -> None:
    """HeaderError unless the header agrees with itself: a named architecture, its model's counts
    and sizes positive and consistent (heads dividing the width, key/value heads dividing the
    heads), every layer the count names present in the tensor table, one token embedding as wide as
    the model, no tensor named twice. read_header has checked each tensor's shape and place."""
    fields = header.fields
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise HeaderError("it names no architecture (general.architecture)")
    names = [t.name for t in header.tensors]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise HeaderError(f"the tensor {twice} is in it twice")

    def count(key: str, required: bool = True) -> int | None:
        if f"{arch}.{key}" in header.array_lengths:
            return None  # a per-layer list (some architectures): transformers checks it
        value = fields.get(f"{arch}.{key}")
        if value is None and not required:
            return None
        if not _is_int(value) or value < 1:
            raise HeaderError(f"its {arch}.{key} is {value!r}, not a positive whole number")
        return value

    layers, width = count("block_count"), count("embedding_length")
    heads, kv_heads = count("attention.head_count"), count("attention.head_count_kv", required=False)
    count("feed_forward_length", required=False)
    count("context_length", required=False)
    key_length = count("attention.key_length", required=False)
    if heads is not None and key_length is None and width % heads:
        raise HeaderError(f"its {heads} attention heads do not divide its width {width}")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise HeaderError(f"its {kv_heads} key/value heads do not divide its {heads} attention heads")
    if layers > MAX_LAYERS:
        raise HeaderError(f"it claims {layers} layers")
    present = {int(name.split(".")[1]) for name in names
               if name.startswith("blk.") and name.count(".") >= 2 and name.split(".")[1].isdigit()}
    if present and max(present) >= layers:
        raise HeaderError(f"it holds tensors for layer {max(present)}, past the {layers} layers it claims")
    missing = [i for i in range(layers) if i not in present]
    if missing:
        raise HeaderError(f"it claims {layers} layers but holds no tensors for layer {missing[0]}"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise HeaderError("it holds no token embedding (token_embd.weight)")
    columns = embedding.elements // embedding.shape[0]
    if len(embedding.shape) != 2 or columns != width:
        raise HeaderError(f"its token embedding is {'x'.join(map(str, embedding.shape))} ({columns} wide), "
                          f"its model {width} wide")
    if header.array_lengths.get("tokenizer.ggml.tokens") == 0:
        raise HeaderError("its tokenizer has no tokens")
