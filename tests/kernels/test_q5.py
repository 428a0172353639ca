"""Q5_0, Q5_1 and Q5_K weights at their own bits (engine/kernels/q4.py's 5-bit tiles, blocks.cpp):
the blocks read as gguf dequantizes them, the library's tiles the layout of the decoded codes, the
products against fp64 of the same int8 activation codes, the same bits for a row whatever the step's
size, thread count or instruction set, and a GGUF laid out as llama-quantize's Q5_K_M files are
loaded onto the kernels, its lookahead answers plain decoding's."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import HIDDEN, LAYERS, VOCAB, assert_lookahead_answers_as_plain, write_llama
from test_q4 import paths

from ladechat.engine.kernels import int4, linear, q4, q6
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.models import transformers_model

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the 5-bit kernel is built with x86-64 vector instructions")
KINDS = q4.FIVE_BIT_KINDS


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, size: float = 0.02) -> np.ndarray:
    """Blocks of `kind`, every code, top bit and 6-bit scale random, the fp16 scales (and minimums)
    finite, of about `size`."""
    rng = np.random.default_rng(seed)
    block, bytes_a_block = gguf.GGML_QUANT_SIZES[T[kind]]
    data = rng.integers(0, 256, (rows, cols // block, bytes_a_block), dtype=np.uint8)
    halves = 1 if kind == "Q5_0" else 2
    scales = (rng.standard_normal((rows, cols // block, halves)) * size).astype(np.float16)
    data[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return data.reshape(rows, -1)


def layer_of(kind: str, data: np.ndarray, rows: int, cols: int, path: int | None = None) -> q4.Q4Linear:
    parts = [torch.from_numpy(part) for part in q4.decode_compact(kind, data, rows, cols)]
    lay = q4.layout_k if kind in q4.K_FORMS else q4.layout
    return q4.Q4Linear(*lay(*parts, five_bit=True), kind=kind, path=path)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_reads_the_blocks_as_gguf_dequantizes_them(kind):
    rows, cols = 32, 512
    data = random_blocks(kind, rows, cols, seed=1)
    q, scale, low = q4.decode(kind, data, rows, cols)
    assert q.dtype == np.uint8 and q.min() == 0 and q.max() == 31
    weights = np.repeat(scale, 32, axis=1) * q.astype(np.float32) + np.repeat(low, 32, axis=1)  # fp32, gguf's order
    assert np.array_equal(weights, gguf.dequantize(data, T[kind]))  # (Q5_0's zeros may differ in sign)
    with pytest.raises(q4.Q4Error, match="do not make 32x768 weights"):
        q4.decode(kind, data, rows, 768)


@pytest.mark.parametrize("kind", KINDS)
def test_the_librarys_tiles_are_the_layout_of_the_decoded_codes(kernel, kind, monkeypatch):
    """gguf_tiles makes from the blocks the bytes q4.tiles_of makes from the codes, in the model's
    row order where one is given; kernel_form's two paths (the library's, numpy's) agree."""
    for rows, cols, seed in ((16, 256, 0), (48, 512, 1)):
        data = random_blocks(kind, rows, cols, seed)
        codes = torch.from_numpy(q4.decode_compact(kind, data, rows, cols)[0])
        python = q4.tiles_of(codes, five_bit=True)
        assert python.shape == (rows // 16, cols // 32, 320) and torch.equal(q4.codes_of(python), codes)
        assert torch.equal(q4.gguf_tiles(kind, data, rows, cols), python)
        order = np.random.default_rng(seed).permutation(rows)
        tiled = quantized.kernel_form(kind, data, rows, cols, lambda o=order: o)
        with monkeypatch.context() as patch:
            patch.setattr(q4, "loaded", lambda: False)
            plain = quantized.kernel_form(kind, data, rows, cols, lambda o=order: o)
        assert tiled.keys() == plain.keys()
        assert all(tiled[k].dtype == plain[k].dtype and torch.equal(tiled[k], plain[k]) for k in tiled)
        assert torch.equal(q4.codes_of(tiled["tiles"]), codes[order])
    # output j = 5 of tile 1, group 2, input 4 c + i with c = 6, i = 3: top bit at byte 256 + 8 c + b,
    # bit t, where 4 j + i = 8 b + t
    code = int(codes[16 + 5, 2 * 32 + 4 * 6 + 3])
    b, t = divmod(4 * 5 + 3, 8)
    assert (int(python[1, 2, 256 + 8 * 6 + b]) >> t) & 1 == code >> 4


@pytest.mark.parametrize("kind", KINDS)
def test_products_are_the_int8_rows_times_the_exact_weights(kernel, kind):
    from test_q4 import quantized as int8_rows

    rows, cols = 48, 512
    data = random_blocks(kind, rows, cols, seed=2)
    q, scale, low = (part.astype(np.float64) for part in q4.decode(kind, data, rows, cols))
    x = torch.randn(5, cols) * torch.tensor([1.0, 0.01, 30.0, 1e-6, 1.0])[:, None]  # rows of any scale
    qa, da, sa = int8_rows(x)
    isum = np.einsum("ngk,mgk->mng", q.reshape(rows, -1, 32), qa)
    terms = da[:, None, :] * (scale[None] * isum + low[None] * sa[:, None, :])
    reference, bound = terms.sum(-1), np.abs(terms).sum(-1) * 2**-21
    results = []
    for path in paths():
        layer = layer_of(kind, data, rows, cols, path)
        assert np.array_equal(layer.dense_weight().numpy(), gguf.dequantize(data, T[kind]))  # the weights
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (5, rows)
        assert (np.abs(y.double().numpy() - reference) <= bound).all(), path
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())
        results.append(y)
    assert all(torch.equal(y, results[0]) for y in results)  # VNNI, AVX2 and portable give the same bits


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_count_gives_each_row_its_own_bits(kernel, kind):
    from test_q4 import STEP_ROWS, assert_each_row_its_own

    data = random_blocks(kind, 48, 256, seed=5)
    assert_each_row_its_own(lambda path: layer_of(kind, data, 48, 256, path),
                            torch.randn(STEP_ROWS, 256, generator=torch.Generator().manual_seed(5)))


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(kernel):
    from test_q4 import assert_alone_as_among_many_on_any_thread_count

    assert_alone_as_among_many_on_any_thread_count(layer_of("Q5_K", random_blocks("Q5_K", 1536, 512, seed=1), 1536, 512),
                                                   torch.randn(40, 512, generator=torch.Generator().manual_seed(1)))


def test_siblings_of_four_and_five_bits_multiply_apart_with_their_own_bits(kernel):
    five = layer_of("Q5_1", random_blocks("Q5_1", 32, 256, seed=3), 32, 256)
    x = torch.randn(3, 256)
    four = q4.Q4Linear(*q4.layout(*(torch.from_numpy(p) for p in q4.decode_compact("Q4_1", random_blocks("Q4_1", 32, 256, seed=4), 32, 256))))
    assert linear.joint_product([four, five], torch.float32) is None  # tiles of another size: apart
    with pytest.raises(RuntimeError, match="q4_mm: codes must be"):
        torch.ops.ladechat_blocks.q4_mm(x, five.tiles[..., :300].contiguous(), five.scales, five.lows, 0)
    assert torch.equal(five(x), five.product()(x))


# -- a GGUF laid out as llama-quantize's Q5_K_M files are ----------------------------------------

LAYER_KINDS = [
    {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_K",
     "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_0", "attn_output": "Q5_K", "ffn_gate": "Q5_0",
     "ffn_up": "Q5_0", "ffn_down": "Q5_K"},
]


def write_q5_k_m_gguf(path: Path) -> Path:
    """A 2-layer Llama of Q5_K, Q5_0, Q5_1 and Q6_K Linear weights, its output layer the tied Q6_K
    input embedding; weights of ~0.05 (Q5_0, Q5_1 quantized by gguf from Gaussian ones)."""
    from test_q6 import random_blocks as q6_blocks

    def weight(layer: int, name: str, rows: int, cols: int):
        kind, seed = LAYER_KINDS[layer][name], layer * 10 + len(name)
        if kind == "Q6_K":
            return q6_blocks(rows, cols, seed, 2e-5), T.Q6_K
        if kind == "Q5_K":  # d sc q - dmin m with sc, m < 64, q < 32: ~0.05
            return random_blocks(kind, rows, cols, seed, size=3e-5), T.Q5_K
        gaussian = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quantize(gaussian, T[kind]), T[kind]

    return write_llama(path, weight, (q6_blocks(VOCAB, HIDDEN, seed=9, size=2e-5), T.Q6_K))


@pytest.mark.slow
def test_a_q5_k_m_like_layout_runs_every_tensor_at_its_own_bits_and_lookahead_answers_as_plain(kernel, tmp_path):
    from test_int4 import dense_from_gguf

    path = write_q5_k_m_gguf(tmp_path / "tiny.gguf")
    dense = dense_from_gguf(path)  # transformers' own GGUF load: every tensor dequantized
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    model = lm.model
    assert quantized.weight_layout(model).startswith(f"q4:{7 * LAYERS - 2},q6_k:{2 + 1},")
    assert "Linear from Q5_0/Q5_1/Q5_K blocks" in lm.weights and "dense" not in lm.weights
    for name, module in model.named_modules():
        if type(module) in (q4.Q4Linear, q6.Q6Linear):
            assert np.array_equal(module.dense_weight().numpy(), dense.get_submodule(name).weight.detach().numpy()), name
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, dense(ids).logits
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    again = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))  # from the kept blocks
    with torch.no_grad():
        assert torch.equal(transformers_model(again.model)(ids).logits, ours)
    assert_lookahead_answers_as_plain(model, ids[0].tolist())


@pytest.mark.slow
def test_a_cache_kept_where_the_kernels_did_not_run_serves_a_load_where_they_do(kernel, tmp_path, monkeypatch):
    """The kept file holds the 5-bit tiles whether or not the library ran when it was written (a
    first use without AVX2 or a compiler): a later load that has the kernels runs them from it."""
    path = write_q5_k_m_gguf(tmp_path / "tiny.gguf")
    with monkeypatch.context() as patch:
        patch.setattr(q4, "loaded", lambda: False)  # numpy lays the tiles out
        patch.setattr(q4, "best_path", lambda: 0)  # and nothing runs them
        first = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
        assert "Q5" not in first.weights and any("Q5_0/Q5_1/Q5_K" in n for n in first.notices)
    later = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    assert quantized.weight_layout(later.model).startswith(f"q4:{7 * LAYERS - 2},q6_k:3,")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    fresh = tmp_path / "again"
    fresh.mkdir()
    other = load(LoadSpec(model=str(write_q5_k_m_gguf(fresh / "tiny.gguf")), dtype="float32", device="cpu"))
    with torch.no_grad():
        assert torch.equal(transformers_model(later.model)(ids).logits, transformers_model(other.model)(ids).logits)  # the library's own layout
