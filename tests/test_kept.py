"""The kernels' layout kept in a GGUF's cache folder (engine/load/gguf/kept.py): safetensors' format,
written and read a tensor at a time; a file cut short is not taken for a whole one."""

import os

import pytest
import torch
from safetensors import safe_open

from ladechat.engine.load.gguf import kept


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a.tiles": torch.randint(0, 256, (3, 4, 416), dtype=torch.uint8, generator=generator),
            "a.d": torch.randn(3, 2, 16, generator=generator),
            "b.sums": torch.randint(-1000, 1000, (2, 5, 16), dtype=torch.int32, generator=generator),
            "b.half": torch.randn(7, generator=generator).bfloat16(),  # 14 bytes: what followed was not aligned
            "b.factors": torch.full((3, 1, 1), -8, dtype=torch.int8),  # 3 bytes
            "after": torch.randn(3, 5, generator=generator),
            "empty": torch.zeros(0, 16)}


def test_what_is_written_is_read_back_and_safetensors_reads_it_too(tmp_path):
    path = tmp_path / "kept.safetensors"
    kept.write(path, tensors(), {"kinds": '{"a": "Q6_K"}'})
    assert kept.whole(path)
    metadata, names, get = kept.read(path)
    assert metadata == {"kinds": '{"a": "Q6_K"}'} and names == list(tensors())
    for name, tensor in tensors().items():
        assert get(name).dtype == tensor.dtype and torch.equal(get(name), tensor), name
    # each a view of the one read, none copied for its alignment (the widest elements come first)
    assert len({get(name).untyped_storage().data_ptr() for name in names if get(name).numel()}) == 1
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == metadata
        assert all(torch.equal(fh.get_tensor(name), tensor) for name, tensor in tensors().items())


def test_a_file_cut_short_or_not_of_this_format_is_not_whole(tmp_path):
    path = tmp_path / "kept.safetensors"
    kept.write(path, tensors(), {})
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert not kept.whole(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert not kept.whole(path)
    path.write_bytes(b"\xff" * 8 + data[8:])  # a header length past the file's end
    assert not kept.whole(path)
    assert not kept.whole(tmp_path / "missing.safetensors")


def test_a_loads_kept_files_are_written_by_its_end_also_when_it_fails(tmp_path):
    """keep_beside_meanwhile's writers belong to the load that started them (writes_joined): joined
    when it ends, also by an error, each file whole; a file not kept is a notice of that load only."""
    import threading

    tensors = {"x": torch.arange(4096, dtype=torch.int32)}
    first: list[str] = []
    with pytest.raises(RuntimeError, match="the load failed"), kept.writes_joined(first):
        kept.keep_beside_meanwhile(tmp_path / "a.safetensors", tensors, {}, "none-*")
        raise RuntimeError("the load failed")
    assert not [t for t in threading.enumerate() if t.name == "ladechat-keep"]
    assert kept.whole(tmp_path / "a.safetensors") and first == []
    second: list[str] = []
    with kept.writes_joined(second):
        kept.keep_beside_meanwhile(tmp_path / "gone" / "b.safetensors", tensors, {}, "none-*")
    assert len(second) == 1 and second[0].startswith(f"cannot keep the kernels' layout in {tmp_path / 'gone'} (")
    assert first == []
    assert kept.keep_beside_meanwhile(tmp_path / "c.safetensors", tensors, {}, "none-*") is None  # outside: at once
    assert kept.whole(tmp_path / "c.safetensors")
    assert kept.keep_beside_meanwhile(tmp_path / "gone" / "d.safetensors", tensors, {}, "none-*")  # and why not


def test_the_data_starts_aligned_and_reads_the_same_direct_or_not(tmp_path, monkeypatch):
    """write() pads the header so the data starts on ALIGN (a direct read's offset); through the
    aligned buffer in small pieces, with direct I/O or where the file system refuses it, the file
    has the same bytes and reads back the same tensors, into memory that starts on ALIGN."""
    monkeypatch.setattr(kept, "BOUNCE", 2 * kept.ALIGN)  # many pieces: a tensor spans several
    monkeypatch.setattr(kept, "READ_CHUNK", 3 * kept.ALIGN)
    many = tensors() | {"big": torch.arange(9000, dtype=torch.int32)}  # 36000 bytes: not a whole block
    direct, buffered = tmp_path / "direct.safetensors", tmp_path / "buffered.safetensors"
    kept.write(direct, many, {"m": "1"})
    header = int.from_bytes(direct.read_bytes()[:8], "little")
    assert (8 + header) % kept.ALIGN == 0 and kept.whole(direct)
    with monkeypatch.context() as refused:
        refused.setattr(kept, "_open_direct", lambda path, flags: None)
        kept.write(buffered, many, {"m": "1"})
        assert buffered.read_bytes() == direct.read_bytes()
        _, _, get = kept.read(direct)
        assert all(torch.equal(get(name), tensor) for name, tensor in many.items())
    _, _, get = kept.read(direct)
    assert all(torch.equal(get(name), tensor) for name, tensor in many.items())
    data = direct.read_bytes()[8 + header :]
    into = memoryview(kept.weights_memory(len(data)).numpy())
    done = kept._read_direct(direct, 8 + header, into)  # every whole block, or none where refused
    assert done in (0, len(data) // kept.ALIGN * kept.ALIGN) and bytes(into[:done]) == data[:done]
    assert kept.weights_memory(100).data_ptr() % kept.ALIGN == 0


def test_the_aligned_writer_pads_the_last_block_and_cuts_the_file_back(tmp_path, monkeypatch):
    """_write_direct on any descriptor: the parts in order, the file exactly their length."""
    monkeypatch.setattr(kept, "BOUNCE", kept.ALIGN)
    parts = [memoryview(b"x" * 10), memoryview(bytes(range(256)) * 20), memoryview(b"")]
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        kept._write_direct(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 10 + bytes(range(256)) * 20


def test_a_file_safetensors_wrote_is_read_and_one_cut_short_is_refused(tmp_path):
    """A file whose data does not start on ALIGN (as safetensors and earlier versions wrote them)
    is read the buffered way; a cut file is an error, not a model of zeros."""
    from safetensors.torch import save_file

    theirs = tmp_path / "theirs.safetensors"
    written = {name: tensor for name, tensor in tensors().items() if tensor.numel()}
    save_file(written, str(theirs), metadata={"m": "2"})
    metadata, _, get = kept.read(theirs)
    assert metadata == {"m": "2"} and all(torch.equal(get(name), tensor) for name, tensor in written.items())
    ours = tmp_path / "ours.safetensors"
    kept.write(ours, tensors() | {"big": torch.arange(9000, dtype=torch.int32)}, {})
    ours.write_bytes(ours.read_bytes()[:-100])
    with pytest.raises(OSError, match="cut short"):
        kept.read(ours)


def test_a_direct_write_refused_midway_falls_back_and_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """A file system that opens for direct I/O and refuses the write (EINVAL) gets the buffered
    write, the file whole; any other error on the last block (a full disk) reaches keep_beside as
    the OSError it is, which says why and leaves no partial file behind."""
    import errno

    def plain_open(path, flags):
        return os.open(path, flags, 0o644)

    def refusing(code):
        def write_all(fd, data):  # holds the aligned buffer's view in its frame, as a real failure does
            raise OSError(code, os.strerror(code))
        return write_all

    monkeypatch.setattr(kept, "_open_direct", plain_open)
    monkeypatch.setattr(kept, "_write_all", refusing(errno.EINVAL))
    path = tmp_path / "small.safetensors"  # under one aligned buffer: its only write is the last block
    kept.write(path, tensors(), {"m": "3"})
    metadata, _, get = kept.read(path)
    assert metadata == {"m": "3"} and all(torch.equal(get(name), tensor) for name, tensor in tensors().items())
    monkeypatch.setattr(kept, "_write_all", refusing(errno.ENOSPC))
    with pytest.raises(OSError) as raised:
        kept.write(tmp_path / "full.safetensors", tensors(), {})
    assert raised.value.errno == errno.ENOSPC
    why = kept.keep_beside(tmp_path / "kept.safetensors", tensors(), {}, "nothing*")
    assert why == os.strerror(errno.ENOSPC) and not list(tmp_path.glob("kept.safetensors*"))
