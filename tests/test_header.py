"""A GGUF's header read by ladechat (engine/load/gguf/header.py) as gguf-py reads it."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType


def test_the_header_reader_describes_every_tensor_as_gguf_py_does(tmp_path):
    """engine/load/gguf/header.py (a first load's tensor table, without gguf-py's seconds of parsing):
    the same tensors, types, offsets, sizes and arrays, and the same single-valued metadata, as
    gguf-py's GGUFReader, for the embedded model and a file of every block type; a file cut in its
    header is one HeaderError."""
    import gguf

    from ladechat.engine.load.gguf.files import embedded_gguf
    from ladechat.engine.load.gguf.header import HeaderError, read_header

    writer = gguf.GGUFWriter(tmp_path / "all.gguf", "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.0])
    writer.add_uint32("llama.block_count", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    T = GGMLQuantizationType
    for kind in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        dense = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(f"t.{kind.name}", gguf.quantize(dense, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (embedded_gguf(), tmp_path / "all.gguf"):
        ours, theirs = read_header(path), gguf.GGUFReader(path)
        assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape, t.dtype) for t in ours.tensors] == [
            (t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes), t.data.shape, t.data.dtype.name)
            for t in theirs.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
        assert ours.fields and all(value == theirs.fields[key].contents() for key, value in ours.fields.items())
        assert ours.arch == "llama"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "all.gguf").read_bytes()[:100])
    with pytest.raises(HeaderError, match="cut short"):
        read_header(cut)
