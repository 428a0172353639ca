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
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# metadata value types: struct format of the single-valued ones; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# GGML types numpy holds as numbers of their own (as GGUFReader does); the rest as bytes
NUMPY_TYPES = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64"}


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

    @property
    def data(self):
        """The tensor's bytes as a read-only numpy memory map (unmapped when dropped)."""
        import numpy as np

        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.data_offset, shape=self.shape)


@dataclass(frozen=True)
class Header:
    fields: dict  # key -> value, for the single-valued metadata (strings, numbers, booleans)
    tensors: list[TensorInfo]

    @property
    def arch(self) -> str:
        return str(self.fields["general.architecture"])


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

    def string(self) -> str:
        size = self.take("<Q")
        if self.at + size > self.end:
            raise HeaderError(f"the header is cut short at byte {self.at}")
        text = bytes(self.buffer[self.at : self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def skip_string(self) -> None:
        size = self.take("<Q")
        self.at += size

    def value(self, kind: int, keep: bool):
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
            else:
                for _ in range(count):
                    self.value(item, keep=False)
            if self.at > self.end:
                raise HeaderError("the header is cut short inside an array")
            return None
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
            fields = {}
            for _ in range(kv_count):
                key = cursor.string()
                value = cursor.value(cursor.take("<I"), keep=True)
                if value is not None:
                    fields[key] = value
            raw = []
            for _ in range(count):
                name = cursor.string()
                dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
                raw.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
            alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
            start = cursor.at + (-cursor.at % alignment)
    tensors = []
    for name, dims, kind, offset in raw:
        try:
            ggml_type = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise HeaderError(f"tensor {name} has an unknown type {kind}") from None
        shape = tuple(reversed(dims)) or (1,)
        elements = 1
        for dim in dims:
            elements *= dim
        n_bytes = elements // block * type_size
        if kind in NUMPY_TYPES:
            dtype = NUMPY_TYPES[kind]
        else:  # bytes: a row's blocks in the last dimension, as GGUFReader gives them
            dtype, shape = "uint8", (*shape[:-1], shape[-1] // block * type_size)
        tensors.append(TensorInfo(path, name, ggml_type, start + offset, n_bytes, shape, dtype))
    return Header(fields, tensors)
