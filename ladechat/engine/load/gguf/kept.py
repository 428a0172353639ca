"""The kernels' layout of a GGUF's blocks, kept in its cache folder as a safetensors file, written
and read one tensor at a time.

safetensors' own save_file turns every tensor into bytes before writing, and safe_open maps the
file while get_tensor copies out of it: each holds the weights twice for a while, gigabytes at 7B.
The format is small (an 8-byte little-endian header size, a JSON header of dtype, shape and byte
range per tensor plus string metadata, then the data), so this writes and reads it with plain file
I/O; the files stay readable by safetensors itself.

The data goes past the page cache where the file system allows (O_DIRECT): a buffered write of a
7B's gigabytes costs a core seconds of page-cache copying (more on a VM, where those pages are new
to the host), which a first load's probes running meanwhile feel at every thread barrier; and a
buffered read of a file no longer cached is slower than a direct one (docs/lab/benchmarks-log.md).
The header is padded with spaces (as safetensors pads it) so that the data starts on ALIGN.
"""

from __future__ import annotations

import errno
import json
import mmap
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
ALIGN = 4096  # what direct I/O asks of a buffer's address, a file offset and a length (a disk block at most)
BOUNCE = 8 << 20  # the aligned buffer a direct write copies through
READ_CHUNK = 64 << 20  # bytes a direct read asks for at once
# how a file system says it does no direct I/O (Linux: EINVAL; some FUSE and network ones: EOPNOTSUPP)
REFUSED = {errno.EINVAL, getattr(errno, "EOPNOTSUPP", errno.EINVAL), getattr(errno, "ENOTSUP", errno.EINVAL)}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` (CPU, of the DTYPES) and `metadata` to `path` in the safetensors format; the data
    of the widest elements first, so that every tensor starts aligned for its dtype (read() would
    copy one that does not: a tensor of an odd number of bytes before it would misalign the rest),
    from a file offset of a multiple of ALIGN (read() reads it directly)."""
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
    encoded += b" " * (-(8 + len(encoded)) % ALIGN)
    parts = [memoryview(len(encoded).to_bytes(8, "little") + encoded), *(_bytes_of(t) for _, t in in_file)]
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if fd is not None:
        try:
            _write_direct(fd, parts)
            return
        except OSError as exc:  # a file system that opens for direct I/O and then refuses a write
            if exc.errno not in REFUSED:
                raise
        finally:
            os.close(fd)
    with open(path, "wb") as fh:
        fh.writelines(parts)


def _open_direct(path: Path, flags: int) -> int | None:
    """A descriptor of `path` for I/O past the page cache, or None where there is none (no O_DIRECT
    on the system, or a file system without it: tmpfs, some network ones)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct, 0o644)
    except OSError as exc:
        if exc.errno in REFUSED:
            return None
        raise


def _write_direct(fd: int, parts: list[memoryview]) -> None:
    """The bytes of `parts`, one after another, to `fd` (opened for direct I/O) through an aligned
    buffer; the last block padded to ALIGN for the write, and the file cut back to its length."""
    bounce = mmap.mmap(-1, BOUNCE)  # page-aligned
    buffer = memoryview(bounce)
    filled = length = 0
    try:
        for part in parts:
            taken = 0
            while taken < len(part):
                count = min(BOUNCE - filled, len(part) - taken)
                buffer[filled : filled + count] = part[taken : taken + count]
                filled, taken = filled + count, taken + count
                if filled == BOUNCE:
                    _write_all(fd, buffer)
                    length, filled = length + filled, 0
        if filled:
            padded = filled + -filled % ALIGN
            buffer[filled:padded] = bytes(padded - filled)
            with buffer[:padded] as last:
                _write_all(fd, last)
            length += filled
            os.ftruncate(fd, length)
    finally:
        buffer.release()
        try:
            bounce.close()
        except BufferError:  # a failed write's traceback still holds a view of it: freed with it
            pass


def _write_all(fd: int, data: memoryview) -> None:
    written = 0
    while written < len(data):
        count = os.write(fd, data[written:])
        if count <= 0:
            raise OSError(errno.EIO, "the file system took no bytes")
        written += count


def weights_memory(size: int) -> torch.Tensor:
    """`size` bytes (uint8) for weights the kernels stream on every step, starting on ALIGN (a
    direct read's destination; the kernels' loads never straddle a cache line): numpy's
    allocation, which asks the kernel for huge pages (a step on 4 KiB pages is slower), every page
    touched first on every thread (writing into huge pages not yet touched faults them in one at a
    time: a read() into them was several times slower, docs/lab/benchmarks-log.md)."""
    import numpy as np

    memory = torch.from_numpy(np.empty(size + ALIGN, dtype=np.uint8))
    skip = -memory.data_ptr() % ALIGN
    memory = memory[skip : skip + size]
    memory.zero_()
    return memory


def read(path: Path) -> tuple[dict[str, str], list[str], Callable[[str], torch.Tensor]]:
    """(metadata, tensor names, get(name) -> the tensor). The file's data is read whole into one
    allocation (weights_memory), directly where write() aligned it, and every tensor is a view of
    it: one read, no copy. OSError or ValueError for a file that is not whole."""
    with open(path, "rb") as fh:
        start, header, end = _header(fh, Path(path))
        metadata = header.pop("__metadata__", {}) or {}
        whole = weights_memory(end)
        view = memoryview(whole.numpy())
        done = _read_direct(path, start, view) if start % ALIGN == 0 else 0
        fh.seek(start + done)
        if fh.readinto(view[done:]) != end - done:
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


def _read_direct(path: Path, start: int, into: memoryview) -> int:
    """How many bytes of `into` (aligned) were read directly from `path` at `start` (aligned): all
    its whole ALIGN blocks, or none where direct I/O is refused; the rest is the caller's."""
    blocks = len(into) // ALIGN * ALIGN
    fd = _open_direct(path, os.O_RDONLY) if blocks else None
    if fd is None:
        return 0
    done = 0
    try:
        while done < blocks:
            count = os.preadv(fd, [into[done : min(blocks, done + READ_CHUNK)]], start + done)
            done += count - count % ALIGN
            if count == 0 or count % ALIGN:  # the file's end: the caller's read finds it cut short
                break
    except OSError as exc:
        if exc.errno not in REFUSED:
            raise
    finally:
        os.close(fd)
    return done


def whole(path: Path) -> bool:
    """Whether `path` is a complete file of this format (its header parses, its data all there)."""
    try:
        with open(path, "rb") as fh:
            start, _, end = _header(fh, Path(path))
        return Path(path).stat().st_size == start + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def _header(fh, path: Path) -> tuple[int, dict, int]:
    """(where the data starts, the JSON header, metadata and all, the data's length) of an open
    file of this format; ValueError for a header length past the file's end (not a header at all)."""
    size = int.from_bytes(fh.read(8), "little")
    if size > path.stat().st_size - 8:
        raise ValueError(f"{path.name} is not a safetensors file: its header length is past its end")
    header = json.loads(fh.read(size))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    return 8 + size, header, end


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
