"""engine/load/gguf/dequantize.py: every GGML type it takes gives gguf-py's weights bit for bit, on the
CPU and, where the machine has one, on a CUDA GPU (scripts/gpu/gguf_sizes.sh runs this file there)."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import dequantize as gguf_dequantize

from ladechat.engine.load.gguf import dequantize

T = GGMLQuantizationType
# the byte offsets of each block's fp16 fields (scales, mins), set to finite numbers: random bytes
# there would be NaN and infinity, whose payloads say nothing about the unpacking
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
          T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
FLOATS = (T.F32, T.F16, T.BF16)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def random_rows(kind, rows: int, blocks_a_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights_a_block, block_bytes = GGML_QUANT_SIZES[kind]
    if kind in FLOATS:
        values = rng.standard_normal((rows, blocks_a_row * weights_a_block)).astype(np.float32)
        if kind == T.F16:
            return values.astype(np.float16).view(np.uint8)
        if kind == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    raw = rng.integers(0, 256, size=(rows * blocks_a_row, block_bytes), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (rng.standard_normal(rows * blocks_a_row) * 0.05).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_every_type_it_takes_is_tested():
    assert {k for k in T if dequantize.supported(k)} == set(HALVES) | set(FLOATS)
    assert not dequantize.supported(T.IQ4_XS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [*FLOATS, *HALVES], ids=lambda k: k.name)
def test_same_bits_as_gguf_py(kind, device):
    raw = random_rows(kind, rows=7, blocks_a_row=3 if kind in HALVES else 40, seed=int(kind))
    ours = dequantize.dequantize(torch.from_numpy(raw).to(device), kind)
    theirs = gguf_dequantize(raw, kind)
    assert ours.dtype == torch.float32 and ours.device.type == device and tuple(ours.shape) == theirs.shape
    assert np.isfinite(theirs).all()
    np.testing.assert_array_equal(ours.cpu().numpy().view(np.uint32), np.ascontiguousarray(theirs).view(np.uint32))


def test_a_slice_of_rows_is_those_rows():
    raw = random_rows(T.Q4_K, rows=6, blocks_a_row=2, seed=1)
    whole = dequantize.dequantize(torch.from_numpy(raw), T.Q4_K)
    part = dequantize.dequantize(torch.from_numpy(raw[2:5]), T.Q4_K)
    assert torch.equal(part, whole[2:5])


# -- a GGUF of every type read densely: the weights of transformers' own GGUF load ---------------

LAYER_KINDS = [  # q and k are permuted on loading (llama.cpp's rotary layout): both paths are read
    {"attn_q": T.Q5_K, "attn_k": T.Q3_K, "attn_v": T.Q6_K, "attn_output": T.BF16, "ffn_gate": T.Q2_K,
     "ffn_up": T.Q5_0, "ffn_down": T.Q5_1},
    {"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.F16, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
     "ffn_up": T.TQ2_0, "ffn_down": T.F32},  # TQ2_0: not torch's here, gguf-py's
]


def write_every_type(path):
    from gguf import quantize
    from gguf_files import HIDDEN, VOCAB, write_llama

    rng = np.random.default_rng(5)

    def weight(layer: int, name: str, rows: int, cols: int):
        kind = LAYER_KINDS[layer][name]
        if kind == T.TQ2_0:
            return quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind), kind
        raw = random_rows(kind, rows, cols // GGML_QUANT_SIZES[kind][0], seed=layer * 100 + int(kind))
        if kind in (T.F32, T.F16):
            return raw.view(np.float32 if kind == T.F32 else np.float16), kind
        return raw, kind

    return write_llama(path, weight, (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), None),
                       (random_rows(T.Q6_K, VOCAB, HIDDEN // 256, seed=9), T.Q6_K))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_dense_load_of_every_type_has_transformers_own_weights(tmp_path, device):
    from transformers import AutoModelForCausalLM

    from ladechat.engine.load.loading import LoadSpec, load

    path = write_every_type(tmp_path / "every-type.gguf")
    ours = load(LoadSpec(model=str(path), dtype="float32", device=device, weights="dense", pack_weights=False))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    wanted, built = theirs.state_dict(), ours.model.state_dict()
    assert set(built) == set(wanted)
    assert all(tensor.device.type == device for tensor in built.values())
    differ = [name for name in wanted if not torch.equal(built[name].cpu(), wanted[name])]
    assert not differ, differ


@pytest.mark.slow
def test_a_load_names_the_types_no_kernel_takes(tmp_path, monkeypatch):
    """On the CPU's kernels each of the file's types runs at its own bits but those no kernel takes
    (Q2_K, Q3_K, TQ2_0 here), which one notice names; where ladechat's kernels do not run (a CPU
    without AVX2: its portable loops are not used), it names every type then read dense."""
    import shutil

    from ladechat.engine.kernels import int4, native
    from ladechat.engine.load.loading import LoadSpec, load

    if shutil.which(native.COMPILER) is None or not int4.supported(torch.device("cpu")):
        pytest.skip("ladechat's kernels are not built on this machine")
    path = write_every_type(tmp_path / "every-type.gguf")
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    named = [n for n in lm.notices if "no kernel for them" in n]
    wanted = "every-type.gguf: its Q2_K/Q3_K/TQ2_0 tensors run dequantized to float32 (no kernel for them here)"
    assert named == [wanted], lm.notices
    assert "Q5_0/Q5_1/Q5_K" in lm.weights and "BF16/F16 weights as they are" in lm.weights
    from ladechat.engine.kernels import q4

    monkeypatch.setattr(q4, "best_path", lambda: 0)
    portable = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    named = [n for n in portable.notices if "no kernel for them" in n]
    kinds = "BF16/F16/Q2_K/Q3_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0/TQ2_0"
    assert named == [f"every-type.gguf: its {kinds} tensors run dequantized to float32 (no kernel for them here)"]
    assert "int4 from Q4_0/Q4_1/Q4_K blocks (torch" in portable.weights


@pytest.mark.slow
def test_a_weight_of_a_type_nothing_reads_is_one_line_naming_it(tmp_path):
    from gguf_files import HIDDEN, VOCAB, write_llama

    from ladechat.engine.load.loading import LoadError, LoadSpec, load

    def weight(layer: int, name: str, rows: int, cols: int):
        values = np.zeros((rows, cols), np.float64 if (layer, name) == (1, "ffn_up") else np.float32)
        return values, None

    path = write_llama(tmp_path / "f64.gguf", weight, (np.zeros((VOCAB, HIDDEN), np.float32), None))
    with pytest.raises(LoadError) as caught:
        load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    assert str(caught.value) == "cannot read f64.gguf: its tensor blk.1.ffn_up.weight is F64, a type ladechat cannot read"
