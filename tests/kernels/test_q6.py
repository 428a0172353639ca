"""Q6_K weights at their own bits (engine/kernels/q6.py, blocks.cpp): the blocks read as gguf
dequantizes them, the kernel's products against fp64 of the same int8 activation codes, the same
bits for a row whatever the step's size, thread count or instruction set, and a GGUF laid out as
llama-quantize's Q4_K_M files are (4-bit with Q6_K ffn_down and a tied Q6_K output layer) loaded
onto the kernels, its lookahead answers plain decoding's."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import HIDDEN, LAYERS, VOCAB, assert_lookahead_answers_as_plain, write_llama
from test_q4 import paths

from ladechat.engine.kernels import int4, native, q4, q6
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.models import transformers_model

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the Q6_K kernel is built with x86-64 vector instructions")

HAS_COMPILER = shutil.which(native.COMPILER) is not None


def random_blocks(rows: int, cols: int, seed: int = 0, size: float = 1e-3) -> np.ndarray:
    """Q6_K blocks (rows, bytes) with every code and scale random and a finite fp16 d below `size`."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // 256, q6.BLOCK_BYTES), dtype=np.uint8)
    d = (rng.random((rows, cols // 256, 1)) * size).astype(np.float16)
    data[..., 208:210] = d.view(np.uint8)
    return data.reshape(rows, -1)


def random_layer(rows: int, cols: int, seed: int = 0):
    return [torch.from_numpy(part) for part in q6.decode(random_blocks(rows, cols, seed), rows, cols)]


def test_decode_reads_q6_k_blocks_as_gguf_dequantizes_them():
    blocks = random_blocks(32, 512)
    codes, sc, d = q6.decode(blocks, 32, 512)
    assert codes.dtype == np.uint8 and codes.max() == 63 and codes.min() == 0 and sc.dtype == np.int8
    weights = np.repeat(d, 256, axis=1).astype(np.float64) * np.repeat(sc, 16, axis=1) * (codes.astype(np.float64) - 32)
    assert np.array_equal(weights, gguf.dequantize(blocks, T.Q6_K))
    with pytest.raises(q6.Q6Error, match="do not make 32x768 weights"):
        q6.decode(blocks, 32, 768)
    with pytest.raises(q6.Q6Error, match="does not fit the Q6_K kernel"):
        q6.check_shape(32, 96)


def test_the_layout_keeps_every_code_and_scale_where_blocks_cpp_reads_them(kernel):
    codes, sc, d = random_layer(32, 512, seed=1)
    tiles, per_tile = q6.layout(codes, sc, d)
    assert tiles.shape == (2, 16, 416) and per_tile.shape == (2, 2, 16) and per_tile.dtype == torch.float16
    with pytest.raises(q6.Q6Error, match="its d are not fp16 values"):  # the kept form is the file's fp16 d
        q6.layout(codes, sc, d * (1 + 2**-20))
    with pytest.raises(RuntimeError, match="q6_mm: d must be .* fp16"):  # the kernel takes no other
        torch.ops.ladechat_blocks.q6_mm(torch.randn(1, 512), tiles, per_tile.float(), 0)
    back_codes, back_sc = q6.parts_of(tiles)
    assert torch.equal(back_codes, codes) and torch.equal(back_sc, sc)
    # output j = 7 of tile 1, group 3, input 4 c + i with c = 6, i = 2: nibble byte 64 (c - 4) + 4 j + i
    # (high nibble), top bits in byte 256 + 64 + 4 j + i at bits 2 (c - 4); sc of the second half at 400 + j
    code = int(codes[16 + 7, 3 * 32 + 4 * 6 + 2])
    assert int(tiles[1, 3, 64 * 2 + 4 * 7 + 2]) >> 4 == code & 0x0F
    assert (int(tiles[1, 3, 256 + 64 + 4 * 7 + 2]) >> 4) & 3 == code >> 4
    assert int(tiles[1, 3, 400 + 7]) == int(sc[16 + 7, 3 * 2 + 1]) & 0xFF
    assert per_tile[1, 1, 7] == d[16 + 7, 1]


def test_products_are_the_int8_rows_times_the_exact_weights(kernel):
    from test_q4 import quantized

    rows, cols = 48, 512
    codes, sc, d = random_layer(rows, cols, seed=2)
    x = torch.randn(5, cols) * torch.tensor([1.0, 0.01, 30.0, 1e-6, 1.0])[:, None]  # rows of any scale
    qa, da, _ = quantized(x)
    groups = cols // 32
    q = codes.double().numpy().reshape(rows, groups, 2, 16) - 32
    s = np.einsum("nghk,mghk->mngh", q, qa.reshape(5, groups, 2, 16))  # exact integer sums per half
    bracket = (s * sc.double().numpy().reshape(rows, groups, 2)[None]).sum(-1)
    terms = da[:, None, :] * np.repeat(d.double().numpy(), 8, axis=1)[None] * bracket
    reference = terms.sum(-1)
    bound = np.abs(terms).sum(-1) * 2**-24 * (2 * groups + 1)  # a product and an fma a group
    weight = (np.repeat(d.double().numpy(), 256, axis=1) * np.repeat(sc.double().numpy(), 16, axis=1)
              * (codes.double().numpy() - 32))
    results = []
    for path in paths():
        layer = q6.Q6Linear(*q6.layout(codes, sc, d), path=path)
        assert np.array_equal(layer.dense_weight().double().numpy(), weight)  # the weights, exactly
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (5, rows)
        assert (np.abs(y.double().numpy() - reference) <= bound).all(), path
        results.append(y)
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())
        assert torch.equal(layer(x[None]), y[None]) and torch.equal(layer.product()(x), y)
    assert all(torch.equal(y, results[0]) for y in results)  # VNNI, AVX2 and portable give the same bits


def test_every_row_count_gives_each_row_its_own_bits(kernel):
    from test_q4 import STEP_ROWS, assert_each_row_its_own

    tiles = q6.layout(*random_layer(48, 256, seed=5))
    assert_each_row_its_own(lambda path: q6.Q6Linear(*tiles, path=path),
                            torch.randn(STEP_ROWS, 256, generator=torch.Generator().manual_seed(5)))


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(kernel):
    from test_q4 import assert_alone_as_among_many_on_any_thread_count

    assert_alone_as_among_many_on_any_thread_count(q6.Q6Linear(*q6.layout(*random_layer(1536, 512, seed=1))),
                                                   torch.randn(40, 512, generator=torch.Generator().manual_seed(1)))


def test_the_module_keeps_its_bias_refuses_moves_and_bad_buffers(kernel):
    tiles, d = q6.layout(*random_layer(32, 256, seed=3))
    bias = torch.randn(32)
    layer = q6.Q6Linear(tiles, d, bias)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), q6.Q6Linear(tiles, d)(x) + bias)
    assert torch.equal(layer.state_dict()["weight"], layer.weight) and torch.equal(layer.state_dict()["bias"], bias)
    with pytest.raises(TypeError, match="Q6_K weights stay on the CPU"):
        layer.to(torch.float16)
    with pytest.raises(q6.Q6Error, match="do not make one weight"):
        q6.Q6Linear(tiles, d[:, :0])
    with pytest.raises(RuntimeError, match="q6_mm: d must be"):
        torch.ops.ladechat_blocks.q6_mm(x, tiles, d[:1].contiguous(), 0)


# -- a GGUF laid out as llama-quantize's Q4_K_M files are -----------------------------------------



def q4_0_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    from test_int4 import blocks_of

    return blocks_of("Q4_0", rows, cols, seed)  # quantized from Gaussian weights (random Q4_K codes would
    # make a model whose int8 roundings grow layer by layer: tests/test_int4.py reads those)


def write_q4_k_m_gguf(path: Path, more_bits: str = "Q6_K") -> Path:
    """A 2-layer Llama: Q4_0 q/k/v/o/gate/up, `more_bits` (Q6_K, or Q8_0) ffn_down and attn_v in
    layer 0 (as llama-quantize gives some layers more bits), and no output.weight: the output layer
    is the Q6_K input embedding (tied)."""

    def weight(layer: int, name: str, rows: int, cols: int):
        seed = layer * 10 + len(name)
        if not (name == "ffn_down" or (name == "attn_v" and layer == 0)):
            return q4_0_blocks(rows, cols, seed), T.Q4_0
        if more_bits == "Q6_K":
            return random_blocks(rows, cols, seed, 2e-5), T.Q6_K
        gaussian = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quantize(gaussian, T[more_bits]), T[more_bits]

    # weights of ~0.05, as a model's: d sc (q - 32) with |sc| < 128, |q - 32| <= 32
    return write_llama(path, weight, (random_blocks(VOCAB, HIDDEN, seed=9, size=2e-5), T.Q6_K))


@pytest.mark.slow
def test_a_q4_k_m_like_layout_runs_every_tensor_at_its_own_bits_and_lookahead_answers_as_plain(kernel, tmp_path):
    from test_int4 import INT8_ERROR, dense_from_gguf, relative_error

    path = write_q4_k_m_gguf(tmp_path / "tiny.gguf")
    dense = dense_from_gguf(path)  # transformers' own GGUF load: every tensor dequantized
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    model = lm.model
    assert quantized.weight_layout(model).startswith(f"q4:{6 * LAYERS - 1},q6_k:{LAYERS + 2},")
    assert type(model.lm_head) is q6.Q6Linear and "Linear from Q6_K blocks" in lm.weights
    assert torch.equal(model.lm_head.dense_weight(), dense.lm_head.weight)  # the tied embedding's blocks
    torch.manual_seed(0)
    for name, module in model.named_modules():
        if type(module) is q6.Q6Linear:
            reference = dense.get_submodule(name).weight.detach()
            assert torch.equal(module.dense_weight(), reference), name
            assert relative_error(module, reference, torch.randn(5, module.in_features)) < INT8_ERROR, name
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, dense(ids).logits
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    again = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))  # from the kept blocks
    with torch.no_grad():
        assert torch.equal(transformers_model(again.model)(ids).logits, ours)
    # lookahead's steps of many rows give plain decoding's tokens on these kernels
    assert_lookahead_answers_as_plain(model, ids[0].tolist())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_the_librarys_tiles_are_the_layouts_from_the_blocks(kernel, kind, monkeypatch):
    """blocks.cpp's gguf_tiles (a model's first use) makes from a tensor's blocks the very bytes that
    q4.layout / q4.layout_k / q6.layout make from the decoded codes; the rows reordered (llama.cpp's
    q and k) give the reordered layout; and kernel_form's two paths give the same buffers, the
    library's also when it writes into a part of a larger tensor."""
    from test_int4 import random_blocks as random_q4_blocks

    for rows, cols, seed in ((16, 256, 0), (48, 512, 1), (32, 1024, 2)):
        data = random_blocks(rows, cols, seed) if kind == "Q6_K" else random_q4_blocks(kind, rows, cols, seed)
        if kind == "Q6_K":
            codes, scales, _ = (torch.from_numpy(p) for p in q6.decode(data, rows, cols))
            python = q6.layout(codes, scales, torch.ones(rows, cols // 256))[0]
        else:
            python = q4.tiles_of(torch.from_numpy(q4.decode_compact(kind, data, rows, cols)[0]))
        assert torch.equal(q4.gguf_tiles(kind, data, rows, cols), python)
        order = np.random.default_rng(seed).permutation(rows)
        tiled = quantized.kernel_form(kind, data, rows, cols, lambda o=order: o)
        with monkeypatch.context() as patch:
            patch.setattr(q4, "loaded", lambda: False)  # the numpy path, as where the library is not built
            plain = quantized.kernel_form(kind, data, rows, cols, lambda o=order: o)
        assert tiled.keys() == plain.keys()
        assert all(tiled[k].dtype == plain[k].dtype and torch.equal(tiled[k], plain[k]) for k in tiled)
        # written into a part of a larger allocation (a model's first load), the rows reordered there
        whole = torch.full((python.numel() + 64,), 7, dtype=torch.uint8)
        placed = quantized.kernel_form(kind, data, rows, cols, lambda o=order: o, whole[32 : 32 + python.numel()])
        assert torch.equal(placed["tiles"], plain["tiles"]) and placed["tiles"].data_ptr() == whole[32:].data_ptr()
        assert torch.equal(whole[:32], torch.full((32,), 7, dtype=torch.uint8)) and torch.equal(whole[-32:], whole[:32])
