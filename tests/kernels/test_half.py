"""F16 and BF16 weights at their own 16 bits (engine/kernels/half.py, blocks.cpp's half_mm): the
products against fp64 of the exact weights, the same bits for a row whatever the step's size,
thread count or instruction set, and a GGUF of F16 and BF16 weights loaded onto the kernel, its
lookahead answers plain decoding's."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import HIDDEN, VOCAB, assert_lookahead_answers_as_plain, write_llama
from test_q4 import paths

from ladechat.engine.kernels import half, int4
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.models import transformers_model

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the 16-bit kernel is built with x86-64 vector instructions")
DTYPES = [torch.float16, torch.bfloat16]


def weights(rows: int, cols: int, dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_products_are_the_fp32_rows_times_the_exact_weights(kernel, dtype):
    w = weights(48, 512, dtype, seed=1)
    x = torch.randn(5, 512) * torch.tensor([1.0, 0.01, 30.0, 1e-6, 1.0])[:, None]  # rows of any scale
    exact = x.double() @ w.double().t()
    # 32 fp32 roundings a sum at most (its partial sums, then the fold), each within 2^-24 of what it adds
    bound = (x.double().abs() @ w.double().abs().t()) * 2**-24 * 40
    results = []
    for path in paths():
        layer = half.HalfLinear(w, path=path)
        assert torch.equal(layer.dense_weight(), w.float()) and layer.kind == ("F16" if dtype == torch.float16 else "BF16")
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (5, 48)
        assert ((y.double() - exact).abs() <= bound).all(), path
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())
        assert torch.equal(layer.product()(x), y)
        results.append(y)
    assert all(torch.equal(y, results[0]) for y in results)  # AVX-512, AVX2 and portable: the same bits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_row_count_gives_each_row_its_own_bits(kernel, dtype):
    from test_q4 import STEP_ROWS, assert_each_row_its_own

    w = weights(48, 256, dtype, seed=5)
    assert_each_row_its_own(lambda path: half.HalfLinear(w, path=path),
                            torch.randn(STEP_ROWS, 256, generator=torch.Generator().manual_seed(5)))


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(kernel):
    from test_q4 import assert_alone_as_among_many_on_any_thread_count

    assert_alone_as_among_many_on_any_thread_count(half.HalfLinear(weights(1536, 512, torch.bfloat16, seed=2)),
                                                   torch.randn(40, 512, generator=torch.Generator().manual_seed(2)))


def test_weights_the_kernel_cannot_take_are_refused(kernel):
    with pytest.raises(half.HalfError, match="does not fit the 16-bit kernel"):
        half.HalfLinear(weights(40, 512, torch.float16))
    with pytest.raises(half.HalfError, match="not fp16 or bf16"):
        half.HalfLinear(weights(32, 512, torch.float32))
    with pytest.raises(half.HalfError, match="does not make 32x256 weights"):
        half.decode("F16", np.zeros((32, 128), np.float16), 32, 256)
    layer = half.HalfLinear(weights(32, 256, torch.float16))
    with pytest.raises(TypeError, match="16-bit weights stay on the CPU"):
        layer.to(torch.float32)
    with pytest.raises(RuntimeError, match="half_mm: w must be"):
        torch.ops.ladechat_blocks.half_mm(torch.randn(2, 256), layer.halves.float(), 0)


# -- a GGUF of F16 and BF16 weights ---------------------------------------------------------------

def write_sixteen_bit_gguf(path: Path) -> Path:
    """A 2-layer Llama: layer 0's Linear weights F16, layer 1's BF16, a Q8_0 embedding and an F16
    output layer."""
    rng = np.random.default_rng(4)

    def weight(layer: int, name: str, rows: int, cols: int):
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return (values.astype(np.float16), None) if layer == 0 else (gguf.quantize(values, T.BF16), T.BF16)

    embedding = gguf.quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), T.Q8_0), T.Q8_0
    return write_llama(path, weight, embedding, ((rng.standard_normal((VOCAB, HIDDEN)) * 0.05).astype(np.float16), None))


@pytest.mark.slow
def test_a_gguf_of_16_bit_weights_runs_them_as_they_are_and_lookahead_answers_as_plain(kernel, tmp_path):
    from test_int4 import dense_from_gguf

    path = write_sixteen_bit_gguf(tmp_path / "sixteen.gguf")
    dense = dense_from_gguf(path)  # transformers' own GGUF load: every tensor in fp32
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    model = lm.model
    assert quantized.weight_layout(model).startswith("half:15,"), quantized.weight_layout(model)
    assert "15 Linear from BF16/F16 weights as they are" in lm.weights
    assert not [n for n in lm.notices if "no kernel" in n]
    for name, module in model.named_modules():
        if type(module) is half.HalfLinear:
            assert torch.equal(module.dense_weight(), dense.get_submodule(name).weight.detach()), name
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, dense(ids).logits
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4 * float(theirs.abs().max()))
    again = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))  # from the kept weights
    with torch.no_grad():
        assert torch.equal(transformers_model(again.model)(ids).logits, ours)
    assert_lookahead_answers_as_plain(model, ids[0].tolist())
