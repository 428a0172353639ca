"""A GGUF's Q8_0 output layer at 8 bits (engine/kernels/q8.py, blocks.cpp, native.py): the kernel's
products against fp64 of the same int8 activation codes on the exact weights, the rounding those
codes cost, the same bits for a row whatever the step's size, the thread count or the instruction
set, the real blocks of the embedded model, and what happens without a compiler."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PATIENCE_S

from ladechat.engine.kernels import int4, native, q4, q8
from ladechat.engine.load.gguf import head, quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.paths import cache_root

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the Q8_0 kernel is built with x86-64 vector instructions")


# The kernel is compiled on first use; a machine without a C++ compiler runs the layer as before
# (test_without_a_compiler_the_output_layer_stays_as_it_was, which runs everywhere).
HAS_COMPILER = shutil.which(native.COMPILER) is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason=f"no C++ compiler ({native.COMPILER}) here")


@pytest.fixture(scope="module")
def kernel():
    if not HAS_COMPILER:
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build the kernel here")
    native.load(q8.SOURCE, cache_root() / "kernels")
    assert q8.usable()


def paths() -> list[int]:
    """The kernel's paths this CPU runs: portable always, AVX2, and AVX-512 VNNI where it has them."""
    return list(range(q4.best_path() + 1))


def random_layer(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
    scales = (torch.rand(rows, cols // q8.GROUP, generator=generator) * 0.01).half().float()  # fp16, as GGUF's
    return codes, scales


def test_products_are_the_int8_rows_times_the_exact_weights(kernel):
    from test_q4 import quantized

    codes, scales = random_layer(64, 96)
    codes[0, :32] = -128  # a code Q8_0 files do not hold, but one the kernel takes
    dense = codes.double() * scales.double().repeat_interleave(q8.GROUP, dim=1)
    x = torch.randn(5, 96) * torch.tensor([1.0, 0.01, 30.0, 1e-6, 1.0])[:, None]
    qa, da, _ = quantized(x)
    isum = np.einsum("ngk,mgk->mng", codes.double().numpy().reshape(64, 3, 32), qa)
    terms = da[:, None, :] * scales.double().numpy()[None] * isum  # per group; exact integer sums
    reference, bound = terms.sum(-1), np.abs(terms).sum(-1) * 2**-21  # then 2 fp32 roundings a group
    results = []
    for path in paths():
        layer = q8.Q8Linear(*q8.kernel_layout(codes, scales), path=path)
        assert torch.equal(layer.dense_weight().double(), dense)  # the weights, exactly
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (5, 64)
        assert (np.abs(y.double().numpy() - reference) <= bound).all(), path
        results.append(y)
        # bf16 activations (the dtype of CPUs with native bf16): read as fp32, rounded once at the end
        assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())
        # a step's extra dimensions are kept
        assert torch.equal(layer(x[None]), y[None])
    assert all(torch.equal(y, results[0]) for y in results)  # VNNI, AVX2 and portable give the same bits


def int8_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What int8 rows may cost against x W^T: each input moves by at most half its group's step
    (max |x| / 254), so an output by at most that times the group's |w|, summed (and fp32's roundings)."""
    step = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1) / 254
    return step @ weight.double().abs().reshape(weight.shape[0], -1, 32).sum(-1).t() * 1.001 + 1e-6


def test_every_row_count_gives_each_row_its_own_bits(kernel):
    from test_q4 import STEP_ROWS, assert_each_row_its_own

    tiles = q8.kernel_layout(*random_layer(48, 96, seed=5))
    assert_each_row_its_own(lambda path: q8.Q8Linear(*tiles, path=path),
                            torch.randn(STEP_ROWS, 96, generator=torch.Generator().manual_seed(5)))


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(kernel):
    """What lets a lookahead step's rows equal one-row steps' (plain decoding) bit for bit."""
    # 128 blocks of 16 outputs: at::parallel_for splits them between threads (it does not below 16)
    codes, scales = random_layer(2048, 576, seed=1)
    layer = q8.Q8Linear(*q8.kernel_layout(codes, scales))
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(1))
    together = layer(x)
    assert all(torch.equal(layer(x[i:i + 1]), together[i:i + 1]) for i in range(16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_decode_reads_q8_0_blocks_as_gguf_dequantizes_them(kernel):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((32, 64)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    codes, scales = q8.decode(blocks, 32, 64)
    dequantized = gguf.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert codes.dtype == np.int8 and np.array_equal(codes * np.repeat(scales, q8.GROUP, axis=1), dequantized)
    with pytest.raises(q8.Q8Error, match="do not make 32x96 weights"):
        q8.decode(blocks, 32, 96)
    with pytest.raises(q8.Q8Error, match="does not fit the Q8_0 kernel"):
        q8.kernel_layout(torch.from_numpy(codes[:24]), torch.from_numpy(scales[:24]))
    with pytest.raises(q8.Q8Error, match="its scales are not fp16 values"):  # the kept form is the file's fp16 d
        q8.kernel_layout(torch.from_numpy(codes), torch.from_numpy(scales) * (1 + 2**-20))
    tiles, kept = q8.kernel_layout(torch.from_numpy(codes), torch.from_numpy(scales))
    assert kept.dtype == torch.float16 and torch.equal(q4.per_row(kept).float(), torch.from_numpy(scales))
    with pytest.raises(RuntimeError, match="q8_mm: scales must be .* fp16"):  # the kernel takes no other
        torch.ops.ladechat_blocks.q8_mm(torch.randn(1, 64), tiles, kept.float(), 0)
    assert torch.equal(q8.codes_of(tiles), torch.from_numpy(codes))
    # the tile as blocks.cpp draws it: byte 64 c + 4 j + i holds q[j][4 c + i]
    assert tiles[1, 1, 64 * 5 + 4 * 7 + 2] == codes[16 + 7, 32 + 4 * 5 + 2]


@pytest.mark.slow
def test_the_embedded_models_output_layer_runs_its_q8_0_blocks(kernel):
    """Its output layer is tied to the Q8_0 input embedding: at 8 bits, exactly those weights (the
    dense fp32 copy the converted model holds), and the model's logits as the dense layer gives them."""
    lm = load(LoadSpec(dtype="float32", device="cpu"))
    head = lm.model.lm_head
    assert type(head) is q8.Q8Linear and head.out_features == 49152 and head.in_features == 576
    assert torch.equal(head.dense_weight(), lm.model.model.embed_tokens.weight)
    assert quantized.weight_layout(lm.model).startswith("q4:210,q8_0:1,")  # no packed copy of the embedding any more
    assert f", the output layer from Q8_0 blocks (ladechat's {q4.PATHS[q4.best_path()]} kernel), " in lm.weights
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    weight = lm.model.model.embed_tokens.weight.double()
    assert ((head(hidden).double() - hidden.double() @ weight.t()).abs() <= int8_bound(hidden, weight)).all()
    # with --weights dense or packed, the layer is as transformers loads it
    assert type(load(LoadSpec(dtype="float32", device="cpu", weights="packed")).model.lm_head) is not q8.Q8Linear


@needs_compiler
def test_a_kernel_that_cannot_be_built_is_one_line(tmp_path):
    source = tmp_path / "blocks.cpp"  # a copy: this process may have loaded q8.SOURCE's library already
    source.write_bytes(q8.SOURCE.read_bytes())
    with pytest.raises(native.BuildError, match=r"^no C\+\+ compiler \(no-such-c\+\+\) to build blocks\.cpp$"):
        native.load(source, tmp_path, compiler="no-such-c++")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(native.BuildError, match=r"^c\+\+ could not compile broken\.cpp: .*error") as caught:
        native.load(broken, tmp_path)
    assert "\n" not in str(caught.value) and not list(tmp_path.glob("*.so"))  # nothing half-built


@pytest.mark.slow
def test_without_a_compiler_the_output_layer_stays_as_it_was(tmp_path):
    """In a fresh process (this one has the kernel loaded): the model loads, with one notice."""
    script = (
        "from pathlib import Path\n"
        "import torch\n"
        "from ladechat.engine.load.gguf import head\n"
        "from ladechat.engine.load.gguf.files import embedded_gguf\n"
        "from transformers import AutoModelForCausalLM\n"
        "gguf = embedded_gguf()\n"
        "model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)\n"
        f"applied = head.apply(model, gguf, Path({str(tmp_path)!r}), Path({str(tmp_path)!r}), compiler='no-such-c++')\n"
        "print(applied.replaced, type(model.lm_head).__name__)\n"
        "print(*applied.notices, sep='\\n')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE_S, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "False Linear"
    assert lines[1:] == [("the output layer of SmolLM2-135M-Instruct.Q4_1.gguf runs dense: "
                          "no C++ compiler (no-such-c++) to build blocks.cpp")]


def test_the_library_is_built_once_per_source_and_torch(kernel):
    built = native.load(q8.SOURCE, cache_root() / "kernels")
    assert built.is_file() and built.parent == cache_root() / "kernels" and torch.__version__ in built.name
    stamp = built.stat().st_mtime_ns
    for compiler in (native.COMPILER, "no-such-c++"):  # a compiler gone since: the library still serves
        script = ("from ladechat.engine.kernels import native, q8\n"
                  "from ladechat.paths import cache_root\n"
                  f"print(native.load(q8.SOURCE, cache_root() / 'kernels', compiler={compiler!r}))")
        again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE_S,
                               check=False)
        assert again.returncode == 0, again.stderr
        assert Path(again.stdout.strip()) == built and built.stat().st_mtime_ns == stamp


def test_a_gguf_with_an_output_layer_of_its_own(kernel, tmp_path):
    """Untied: the file's output.weight (Q8_0, 96 x 256) runs on the kernel, the same weights as the
    dense layer transformers makes of it; a second load reads the kept blocks; a corrupt block
    leaves the layer dense, with one notice."""
    from test_int4 import dense_from_gguf, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    dense = dense_from_gguf(path)
    ids = torch.tensor([[1, 5, 9, 40, 77, 3]])
    with torch.inference_mode():
        expected = dense(ids).logits
    for attempt in ("read from the GGUF", "read from the kept blocks"):
        model = dense_from_gguf(path)
        applied = head.apply(model, path, tmp_path, cache_root() / "kernels")
        assert applied == head.Applied(True, ()), attempt
        assert type(model.lm_head) is q8.Q8Linear and torch.equal(model.lm_head.weight, dense.lm_head.weight)
        with torch.inference_mode():
            logits = model(ids).logits
        with torch.inference_mode():
            hidden = model.model(ids).last_hidden_state[0]  # normed: the head's input
        bound = int8_bound(hidden, dense.lm_head.weight)  # the logits: the head's product of the same rows
        assert ((logits[0].double() - expected[0].double()).abs() <= bound).all(), attempt
        assert head.cache_path(tmp_path).is_file()

    corrupt = tmp_path / "corrupt" / "tiny.gguf"
    corrupt.parent.mkdir()
    corrupt.write_bytes(path.read_bytes())
    output = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    with corrupt.open("r+b") as fh:  # the first block's fp16 scale: NaN
        fh.seek(output.data_offset)
        fh.write(np.array([np.nan], dtype=np.float16).tobytes())
    model = dense_from_gguf(path)
    applied = head.apply(model, corrupt, corrupt.parent, cache_root() / "kernels")
    assert not applied.replaced and type(model.lm_head) is torch.nn.Linear
    assert applied.notices == (("the output layer of tiny.gguf runs dense: some of its scales are not finite "
                                "numbers (a corrupt block)"),)


@pytest.mark.slow
@needs_compiler
def test_a_load_waits_for_the_prebuild_instead_of_compiling_again(tmp_path):
    """prebuild() compiles on a background thread while the model converts; a load() meanwhile
    waits for that build: one compile in all (counted by a compiler wrapper), one library."""
    # a library of its own: a second library with a loaded one's operator namespace aborts the process
    namespace = f"ladechat_prebuild_{abs(hash(str(tmp_path)))}"
    source = tmp_path / "prebuild.cpp"
    source.write_text("#include <torch/library.h>\n"
                      "int64_t twice(int64_t x) { return 2 * x; }\n"
                      f"TORCH_LIBRARY({namespace}, m) {{ m.def(\"twice(int x) -> int\", &twice); }}\n")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "counting-c++"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -shared "*) echo built >> {log} ;; esac\nexec c++ "$@"\n')
    wrapper.chmod(0o755)
    built = tmp_path / "built"
    thread = native.prebuild([source], built, compiler=str(wrapper))
    path = native.load(source, built, compiler=str(wrapper))
    thread.join(timeout=PATIENCE_S)
    assert log.read_text().splitlines() == ["built"]
    assert list(built.glob("*.so")) == [path]
    assert getattr(torch.ops, namespace).twice(21) == 42


def test_q8_0_linear_weights_run_on_the_kernel_with_their_bias(kernel, tmp_path):
    """A GGUF's Q8_0 Linear weights (what llama-quantize gives a Q8_0 file, and a K-quant file's
    tensors whose rows do not split into 256) run on the kernel too: exactly the weights
    transformers dequantizes, each product within int8 rounding, the step's rows each their own."""
    from test_int4 import INT8_ERROR, dense_from_gguf, relative_error
    from test_q4 import assert_each_row_its_own
    from test_q6 import LAYERS, write_q4_k_m_gguf

    path = write_q4_k_m_gguf(tmp_path / "q8.gguf", more_bits="Q8_0")
    dense = dense_from_gguf(path)
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    linears = {name: m for name, m in lm.model.named_modules() if type(m) is q8.Q8Linear}
    assert len(linears) == LAYERS + 1 and "lm_head" not in linears  # ffn_down of each layer, attn_v of layer 0
    assert f"{LAYERS + 1} Linear from Q8_0 blocks (ladechat's" in lm.weights
    for name, module in linears.items():
        reference = dense.get_submodule(name).weight.detach()
        assert torch.equal(module.dense_weight(), reference), name
        assert relative_error(module, reference, torch.randn(5, module.in_features)) < INT8_ERROR, name
    tiles = next(iter(linears.values()))
    bias = torch.randn(tiles.out_features)
    with_bias = q8.Q8Linear(tiles.tiles, tiles.scales, bias=bias)
    x = torch.randn(7, tiles.in_features)
    assert torch.equal(with_bias(x), tiles(x) + bias) and torch.equal(with_bias.product()(x), with_bias(x))
    assert_each_row_its_own(lambda p: q8.Q8Linear(tiles.tiles, tiles.scales, p, bias), x)
