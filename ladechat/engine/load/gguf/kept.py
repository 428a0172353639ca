"""The kernels' layout of a GGUF's blocks, kept in its cache folder as a safetensors file, written
and read one tensor at a time.

safetensors' own save_file turns every tensor into bytes before writing, and safe_open maps the
file while get_tensor copies out of it: each holds the weights twice for a while, gigabytes at 7B.
The format is small (an 8-byte little-endian header size, a JSON header of dtype, shape and byte
range per tensor plus string metadata, then the data), so this writes and reads it with plain file
I/O; the files stay readable by safetensors itself.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` (CPU, of the DTYPES) and `metadata` to `path` in the safetensors format; the data
    of the widest elements first, so that every tensor starts aligned for its dtype (read() would
    copy one that does not: a tensor of an odd number of bytes before it would misalign the rest)."""
    offsets, offset = {}, 0
    in_file = sorted(tensors.items(), key=lambda item: -item[1].element_size())
    for name, tensor in in_file:
        size = tensor.numel() * tensor.element_size()
        offsets[name] = [offset, offset + size]
        offset += size
    header: dict = {"__metadata__": dict(metadata)}
    for name, tensor in tensors.items():  # the names in the order given
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": offsets[name]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(len(encoded).to_bytes(8, "little"))
        fh.write(encoded)
        for _, tensor in in_file:
            fh.write(_bytes_of(tensor))


def weights_memory(size: int) -> torch.Tensor:
    """`size` bytes (uint8) for weights the kernels stream on every step: numpy's allocation, which
    asks the kernel for huge pages (a step on 4 KiB pages is slower), every page touched first on
    every thread (writing into huge pages not yet touched faults them in one at a time: a read()
    into them was several times slower, docs/lab/benchmarks-log.md)."""
    import numpy as np

    memory = torch.from_numpy(np.empty(size, dtype=np.uint8))
    memory.zero_()
    return memory


def read(path: Path) -> tuple[dict[str, str], list[str], Callable[[str], torch.Tensor]]:
    """(metadata, tensor names, get(name) -> the tensor). The file's data is read whole into one
    allocation (weights_memory) and every tensor is a view of it: one read, no copy. OSError or
    ValueError for a file that is not whole."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        metadata = header.pop("__metadata__", {}) or {}
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        whole = weights_memory(end)
        if fh.readinto(memoryview(whole.numpy())) != end:
            raise OSError(f"{Path(path).name} is cut short")

    def get(name: str) -> torch.Tensor:
        entry = header[name]
        begin, stop = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        part = whole[begin:stop]
        if begin % dtype.itemsize:  # not aligned for a view: a copy of its own
            part = part.clone()
        return part.view(dtype).reshape(entry["shape"])

    return metadata, list(header), get


def whole(path: Path) -> bool:
    """Whether `path` is a complete file of this format (its header parses, its data all there)."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if size > Path(path).stat().st_size - 8:  # not a header length at all
                return False
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        return Path(path).stat().st_size == 8 + size + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


# -- a layout kept beside the model it came from ---------------------------------------------------
def keep_beside(path: Path, arrays: dict, metadata: dict[str, str], earlier: str) -> str | None:
    """Write `arrays` (safetensors, with `metadata`) to `path` beside a converted model, after
    removing the files of earlier code that match the glob `earlier`; whole or not at all (written
    under a name of its own first: another process may be writing its copy). Why not, where the
    folder cannot be written (full, read-only): the caller reads its source again next time."""
    partial = None
    try:
        for stale in path.parent.glob(earlier):
            stale.unlink(missing_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
        os.close(handle)
        partial = Path(name)
        write(partial, arrays, metadata)
        partial.rename(path)
        return None
    except OSError as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        return exc.strerror or type(exc).__name__


# The writes keep_beside_meanwhile started inside the current load's `writes_joined`: (thread, path,
# {"why": ...}); None outside one, where a file is written at once.
_writes: ContextVar[list | None] = ContextVar("ladechat_kept_writes", default=None)


def keep_beside_meanwhile(path: Path, arrays: dict, metadata: dict[str, str], earlier: str) -> str | None:
    """keep_beside in a thread of its own, joined at the end of the load that started it
    (writes_joined): a 7B's blocks take seconds to write, which the rest of its first load (the
    thread probe's steps) hides. The arrays must not change until then; the thread is not a daemon,
    so an exit waits for the file (written whole or not at all). Outside a load: written now, and
    why not (keep_beside's answer) returned."""
    writes = _writes.get()
    if writes is None:
        return keep_beside(path, arrays, metadata, earlier)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(why=keep_beside(path, arrays, metadata, earlier)),
                              name="ladechat-keep")
    thread.start()
    writes.append((thread, path, outcome))
    return None


@contextmanager
def writes_joined(notices: list[str]) -> Iterator[None]:
    """The files keep_beside_meanwhile starts inside this block are written by its end, also when
    the block fails; a notice in `notices` for each that could not be kept."""
    token = _writes.set([])
    try:
        yield
    finally:
        writes = _writes.get() or []
        _writes.reset(token)
        for thread, path, outcome in writes:
            thread.join()
            if outcome.get("why"):
                notices.append(f"cannot keep the kernels' layout in {path.parent} ({outcome['why']}): "
                               "the next load reads the GGUF again")
