"""A GGUF's 4-bit blocks run at 4 bits (engine/load/gguf/quantized.py, engine/kernels/q4.py and int4.py): the exact 4-bit form of Q4_0, Q4_1
and Q4_K blocks, on ladechat's kernel (q4.py; tests/kernels/test_q4.py tests the kernel itself) or torch's
int4 kernel where none is built, products within int8 / bf16 rounding of the dense weights `gguf`
dequantizes, rows independent of the step's size (so lookahead answers equal plain decoding's on
these weights), and what happens with files and choices it cannot run."""

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PATIENCE_S

from ladechat import templates
from ladechat.engine import cost_envelope
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.defaults import default_lookahead
from ladechat.engine.kernels import attention, int4, native, q4
from ladechat.engine.load import packing
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadError, LoadSpec, load
from ladechat.engine.models import transformers_model
from ladechat.paths import cache_root

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="torch's int4 CPU kernel is measured and used on x86-64 only")

# Relative to sum |x| |w| of each output: bf16 rounds activations, scales and zeros, and the result,
# each by at most 2^-9; a misread block (nibble order, scale, zero, row) is off by tens of percent.
BF16_ERROR = 2**-7
# int8 activations round each input by up to 1/254 of its group's largest (tests/kernels/test_q4.py bounds
# it exactly); against sum |x| |w| per output of random rows that stays well under 2^-5
INT8_ERROR = 2**-5

HAS_COMPILER = shutil.which(native.COMPILER) is not None

PROMPTS = ["Write a haiku about autumn leaves.", "How do I reverse a list in Python?",
           "Explain what a prime number is to a child.", "List three uses of a paperclip.",
           "What causes the seasons on Earth?", "Give me a short recipe for pancakes."]


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of `kind` with every code and 6-bit scale random and finite fp16 scales and minimums."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2, "Q5_0": 1, "Q5_1": 2, "Q5_K": 2}[kind]
    scales = (rng.standard_normal((rows, cols // block, halves)) * 0.02).astype(np.float16)
    data[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return data.reshape(rows, -1)


def blocks_of(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_0 and Q4_1 blocks quantized by gguf from random weights; Q4_K (gguf-py cannot quantize
    it) random."""
    if kind == "Q4_K":
        return random_blocks(kind, rows, cols, seed)
    dense = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gguf.quantize(dense, T[kind])


def relative_error(module, weight: torch.Tensor, x: torch.Tensor) -> float:
    """Largest |module(x) - x W^T| over sum |x| |W|, per output."""
    with torch.no_grad():
        return float(((module(x) - x @ weight.t()).abs() / (x.abs() @ weight.abs().t())).max())


@pytest.mark.parametrize("kind", q4.KINDS)
def test_blocks_decode_to_what_gguf_dequantizes(kind):
    rows, cols = 48, 512
    for seed, data in enumerate((blocks_of(kind, rows, cols), random_blocks(kind, rows, cols, seed=7))):
        q, scale, low = q4.decode(kind, data, rows, cols)
        assert q.dtype == np.uint8 and q.max() <= 15 and scale.shape == low.shape == (rows, cols // 32)
        mine = q.astype(np.float64).reshape(rows, -1, 32) * scale[..., None] + low[..., None]
        reference = gguf.dequantize(data, T[kind]).astype(np.float64)
        # exact for Q4_0/Q4_1; Q4_K's d * sc and dmin * m are products gguf rounds to fp32 on the way
        assert np.abs(mine.reshape(rows, cols) - reference).max() <= 1e-6 * np.abs(reference).max(), (kind, seed)


@pytest.mark.parametrize("kind", q4.KINDS)
def test_blocks_are_kept_in_the_files_own_precision(kind):
    """The kernel's buffers hold the file's own bytes: Q4_0's fp16 d alone (and a factor a tile),
    Q4_1's fp16 scale and low, Q4_K's packed 6-bit integers with an fp16 d and dmin per 256; and
    give back decode()'s fp32 values exactly: no larger than needed, no rounding."""
    rows, cols = 48, 512
    data = random_blocks(kind, rows, cols, seed=3)
    q, *parts = (torch.from_numpy(part) for part in q4.decode_compact(kind, data, rows, cols))
    tiles, scales, lows = q4.layout_k(q, *parts) if kind == "Q4_K" else q4.layout_d(q, parts[0], kind) \
        if kind == "Q4_0" else q4.layout(q, *parts)
    assert q4.form(scales, lows) == {"Q4_K": "Q4_K", "Q4_0": "fp16 d", "Q4_1": "fp16"}[kind]
    _, scale, low = q4.decode(kind, data, rows, cols)
    wide = q4.expand(scales, lows)
    assert torch.equal(q4.per_row(wide[0]), torch.from_numpy(scale)) and torch.equal(q4.per_row(wide[1]),
                                                                                       torch.from_numpy(low))
    kept = tiles.nbytes + scales.nbytes + lows.nbytes
    assert kept == data.nbytes + (rows // 16 if kind == "Q4_0" else 0)  # Q4_0: and its factor, a byte a tile


def test_a_q4_0_scale_whose_low_leaves_fp16_keeps_fp32():
    data = random_blocks("Q4_0", 16, 64, seed=4).copy()
    data.reshape(16, 2, 18)[3, 1, :2] = np.frombuffer(np.float16(9000.0).tobytes(), np.uint8)  # -8 d = -72000
    _, scale, low = q4.decode_compact("Q4_0", data, 16, 64)
    assert scale.dtype == low.dtype == np.float32 and low[3, 1] == -72000.0


@pytest.mark.parametrize("kind", q4.KINDS)
def test_int4_linear_matches_the_dense_linear_of_the_same_blocks(kind):
    rows, cols = 96, 768 if kind == "Q4_K" else 320
    data = blocks_of(kind, rows, cols, seed=1)
    q, scale, low = q4.decode(kind, data, rows, cols)
    bias = torch.randn(rows)
    module = int4.Int4Linear.from_codes(torch.from_numpy(int4.pack_codes(q)), torch.from_numpy(scale),
                                        torch.from_numpy(low), bias, kind)
    dense = torch.from_numpy(gguf.dequantize(data, T[kind]))
    x = torch.randn(7, cols)
    with torch.no_grad():
        error = ((module(x) - (x @ dense.t() + bias)).abs() / (x.abs() @ dense.abs().t())).max()
    assert error < BF16_ERROR
    # .weight is the dense weight the kernel computes with: gguf's, with scale and zero rounded to bf16
    s = torch.from_numpy(scale).bfloat16().float().repeat_interleave(32, dim=1)
    zero = torch.from_numpy(low).double() + 8 * torch.from_numpy(scale).double()  # tinygemm's zero
    z = zero.bfloat16().float().repeat_interleave(32, dim=1)
    assert torch.equal(module.weight, (torch.from_numpy(q).float() - 8) * s + z)
    assert (module.weight - dense).abs().max() <= 2**-8 * (dense.abs().max() + s.abs().max() * 8)
    # the state dict holds it as nn.Linear's weight; moving or casting is refused
    state = module.state_dict()
    assert torch.equal(state["weight"], module.weight) and torch.equal(state["bias"], bias)
    with pytest.raises(TypeError, match="int4 weights stay on the CPU"):
        module.to(torch.float16)


def test_a_row_does_not_depend_on_how_many_rows_its_step_has():
    data = blocks_of("Q4_1", 160, 576, seed=2)
    q, scale, low = q4.decode("Q4_1", data, 160, 576)
    module = int4.Int4Linear.from_codes(torch.from_numpy(int4.pack_codes(q)), torch.from_numpy(scale),
                                        torch.from_numpy(low))
    x = torch.randn(37, 576)
    with torch.no_grad():
        whole = module(x)
        for rows in (1, 2, 3, 4, 5, 8, 13, 36):
            assert torch.equal(module(x[:rows]), whole[:rows]), rows
            assert torch.equal(module(x[-rows:]), whole[-rows:]), rows


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_a_step_calls_is_the_forward(with_bias):
    """Int4Linear.product(dtype), what a Llama step binds once and calls per row block: the forward's
    bits in an fp32 and a bf16 model, the bf16 one without a bias calling the kernel directly."""
    data = blocks_of("Q4_1", 64, 256, seed=3)
    q, scale, low = q4.decode("Q4_1", data, 64, 256)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):  # a model's bias is of its dtype
            bias = torch.randn(64).to(dtype) if with_bias else None
            module = int4.Int4Linear.from_codes(torch.from_numpy(int4.pack_codes(q)), torch.from_numpy(scale),
                                                torch.from_numpy(low), bias)
            x = torch.randn(5, 256).to(dtype)
            y = module.product(dtype)(x)
            assert y.dtype == dtype and torch.equal(y, module(x)), dtype


def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(int4.Int4Error, match="does not fit the int4 kernel"):
        int4.check_shape(40, 64)
    with pytest.raises(q4.Q4Error, match="do not make 48x512 weights"):
        q4.decode("Q4_0", np.zeros((48, 10), np.uint8), 48, 512)
    with pytest.raises(q4.Q4Error, match="Q8_0 has no exact 4-bit or 5-bit form"):
        q4.decode("Q8_0", np.zeros((48, 34 * 16), np.uint8), 48, 512)


# -- a small GGUF file of every kind, through transformers' own GGUF loading --------------------

HIDDEN, FFN, VOCAB, LAYERS = 256, 512, 96, 2
KIND_OF = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_K", "attn_output": "F16", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_1", "ffn_down": "Q4_0"}


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama in GGUF with Q4_0, Q4_1, Q4_K, F16 and Q8_0 tensors (q and k are permuted on
    loading, as llama.cpp's files need)."""
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(VOCAB - 3)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)
    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    output = gguf.quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.1, T.Q8_0)
    writer.add_tensor("output.weight", output, raw_dtype=T.Q8_0)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, kind in KIND_OF.items():
            rows, cols = shapes[name]
            if kind == "F16":
                writer.add_tensor(f"blk.{layer}.{name}.weight",
                                  (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))
            else:
                writer.add_tensor(f"blk.{layer}.{name}.weight", blocks_of(kind, rows, cols, seed=layer * 10 + len(name)),
                                  raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def dense_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def kernels_for(kernel: str) -> Path | None:
    """quantized.apply's `kernels`: ladechat's built into the suite's cache, or None for torch's."""
    if kernel == "torch":
        return None
    if not HAS_COMPILER:
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build ladechat's 4-bit kernel here")
    return cache_root() / "kernels"


@pytest.mark.parametrize("kernel", ["ladechat", "torch"])
def test_every_4bit_kind_of_a_gguf_runs_at_4_bits_and_the_rest_stays_dense(tiny_gguf, tmp_path, kernel):
    dense, model = dense_from_gguf(tiny_gguf), dense_from_gguf(tiny_gguf)
    kernels = kernels_for(kernel)
    applied = quantized.apply(model, tiny_gguf, tmp_path, kernels)
    # the F16 o_proj on ladechat's 16-bit kernel, or dense beside torch's int4 kernel
    replaced, kinds = (7 * LAYERS, ("F16", "Q4_0", "Q4_1", "Q4_K")) if kernels else (6 * LAYERS, ("Q4_0", "Q4_1", "Q4_K"))
    assert applied.replaced == replaced and applied.kinds == kinds and applied.notices == ()
    module_type, bound = (q4.Q4Linear, INT8_ERROR) if kernels else (int4.Int4Linear, BF16_ERROR)
    layout = f"q4:{6 * LAYERS},half:{LAYERS},dense:1" if kernels else f"int4:{6 * LAYERS},dense:{LAYERS + 1}"
    assert quantized.weight_layout(model) == layout  # the Q8_0 lm_head: head.apply's, not called here
    assert ("Linear from Q4_0/Q4_1/Q4_K blocks (ladechat's" if kernels
            else "Linear int4 from Q4_0/Q4_1/Q4_K blocks (torch") in quantized.describe(model)
    torch.manual_seed(0)
    checked = 0
    for name, module in model.named_modules():
        if type(module) is module_type:
            # transformers dequantized (and un-permuted: q, k) these blocks into the dense model
            reference = dense.get_submodule(name).weight.detach()
            assert relative_error(module, reference, torch.randn(5, module.in_features)) < bound, name
            checked += 1
    assert checked == 6 * LAYERS
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, dense(ids).logits
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    # the 4-bit form was kept (outside a load, written at once): a second model reads it without the GGUF
    cached = list(tmp_path.glob("int4-*.safetensors"))
    assert len(cached) == 1
    again = dense_from_gguf(tiny_gguf)
    assert quantized.apply(again, tmp_path / "missing.gguf", tmp_path, kernels).replaced == replaced
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)


def test_without_a_compiler_the_4bit_weights_run_on_torchs_kernel(tiny_gguf, tmp_path):
    """In a fresh process (this one may have ladechat's kernel loaded): one notice, torch's kernel."""
    script = (
        "from pathlib import Path\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from ladechat.engine.load.gguf import quantized\n"
        f"gguf = Path({str(tiny_gguf)!r})\n"
        "model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)\n"
        f"tmp = Path({str(tmp_path)!r})\n"
        "applied = quantized.apply(model, gguf, tmp, tmp / 'kernels', compiler='no-such-c++')\n"
        "print(applied.replaced, quantized.weight_layout(model))\n"
        "print(*applied.notices, sep='\\n')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE_S, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{6 * LAYERS} int4:{6 * LAYERS},dense:{LAYERS + 1}",
        "the 4-bit weights of tiny.gguf run on torch's int4 kernel: no C++ compiler (no-such-c++) to build blocks.cpp"]


def test_a_gguf_is_built_from_its_blocks_with_no_dense_copy_kept(tiny_gguf, tmp_path):
    """load() of a GGUF builds the model from the file as it is: the same tensors, bit for bit, as
    transformers' own GGUF load (every tensor dequantized) then quantized.apply; the cache holds its config,
    tokenizer, where its tensors lie and the kernels' layout, never a dense copy of the weights; a
    second load, from what is kept, gives the same logits."""
    from ladechat.engine.load.gguf import files as gguf_files

    copy = tmp_path / "tiny.gguf"  # a file of its own: its own cache folder
    shutil.copyfile(tiny_gguf, copy)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    weights = "int4" if HAS_COMPILER else "auto"
    first = load(LoadSpec(model=str(copy), dtype="float32", device="cpu", weights=weights))
    folder = gguf_files.prepared_dir(copy)
    full = dense_from_gguf(copy)
    quantized.apply(full, copy, folder, cache_root() / "kernels" if HAS_COMPILER else None)
    kept = sorted(f.name for f in folder.iterdir())
    assert all(name.startswith(("int4-", "q8-")) or name in ("config.json", "generation_config.json", "tokenizer.json",
                                                            "tokenizer_config.json", "tensors.json", "complete")
               for name in kept), kept
    assert sum(f.stat().st_size for f in folder.glob("*.safetensors")) < copy.stat().st_size
    second = load(LoadSpec(model=str(copy), dtype="float32", device="cpu", weights=weights))
    wanted = full.state_dict()  # once: each call computes every 4-bit module's dense weight
    compared = [name for name in wanted if not name.startswith("lm_head.")]  # there: the Q8_0 kernel
    for built in (first.model, second.model):
        assert not any(t.is_meta for t in (*built.parameters(), *built.buffers()))
        assert quantized.weight_layout(built).split(",")[0] == quantized.weight_layout(full).split(",")[0]
        state = built.state_dict()
        assert all(torch.equal(state[name], wanted[name]) for name in compared)
    with torch.no_grad():
        assert torch.equal(transformers_model(first.model)(ids).logits, transformers_model(second.model)(ids).logits)
    # bf16: the dense tensors read in the model's dtype
    bf16 = load(LoadSpec(model=str(copy), dtype="bfloat16", device="cpu", weights="dense"))
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16


def corrupt_copy(source: Path, target: Path, tensor_name: str, offset: int, value: bytes) -> Path:
    """A copy of `source` with `value` written `offset` bytes into one tensor's data, and a folder
    beside it for its 4-bit form."""
    target.with_suffix("").mkdir()
    reader = gguf.GGUFReader(source)
    start = next(t for t in reader.tensors if t.name == tensor_name).data_offset
    shutil.copyfile(source, target)
    with open(target, "r+b") as fh:
        fh.seek(start + offset)
        fh.write(value)
    return target


def test_a_corrupt_block_keeps_its_tensor_dense_with_a_notice(tiny_gguf, tmp_path):
    nan = np.array([np.nan], np.float16).tobytes()
    broken = corrupt_copy(tiny_gguf, tmp_path / "nan.gguf", "blk.1.ffn_up.weight", 0, nan)
    model = dense_from_gguf(tiny_gguf)
    applied = quantized.apply(model, broken, broken.with_suffix(""), None)
    assert applied.replaced == 6 * LAYERS - 1
    assert applied.notices == (("blk.1.ffn_up.weight (Q4_1) runs dense: some of its scales are not finite "
                               "numbers (a corrupt block)"),)
    assert type(model.get_submodule("model.layers.1.mlp.up_proj")) is torch.nn.Linear
    # the notices come again with every load of the kept 4-bit form
    again = quantized.apply(dense_from_gguf(tiny_gguf), broken, broken.with_suffix(""), None)
    assert again.notices == applied.notices and again.replaced == applied.replaced


def test_a_file_that_cannot_be_read_leaves_the_model_dense_with_one_notice(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    model = dense_from_gguf(tiny_gguf)
    applied = quantized.apply(model, cut, tmp_path, None)
    assert applied.replaced == 0 and len(applied.notices) == 1
    assert applied.notices[0].startswith("cannot read the 4-bit blocks of cut.gguf (")
    assert applied.notices[0].endswith("); running its dense weights") and "\n" not in applied.notices[0]
    assert quantized.weight_layout(model) == f"dense:{7 * LAYERS + 1}"


# -- the embedded model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded_int4():
    return load(LoadSpec(dtype="float32", device="cpu", weights="int4"))


def test_auto_runs_the_embedded_model_as_int4(embedded_int4):
    lm = embedded_int4
    # Q4_1 Linears on ladechat's kernel; the output layer tied to the Q8_0 embedding runs its blocks
    # (tests/kernels/test_q8.py) and its norms by ladechat's kernel (tests/kernels/test_norms.py), where a C++
    # compiler built them; else torch's int4 kernel, the output layer packed, transformers' norms
    layout = "q4:210,q8_0:1,norm:61" if HAS_COMPILER else "int4:210,packed:1"
    assert quantized.weight_layout(lm.model) == layout
    if HAS_COMPILER:
        path = q4.PATHS[q4.best_path()]
        assert lm.weights.startswith(f"210 Linear from Q4_1 blocks (ladechat's {path} kernel, int8 activations), ")
    else:
        assert lm.weights.startswith("210 Linear int4 from Q4_1 blocks (torch _weight_int4pack_mm_for_cpu, bf16 "
                                     "activations), ")
    assert lm.notices == () if HAS_COMPILER else len(lm.notices) == 3
    auto = load(LoadSpec(device="cpu"))  # --weights auto, --dtype auto
    assert quantized.weight_layout(auto.model) == layout
    # ladechat's kernels quantize rows to int8 whatever the dtype: auto is fp32 there (bf16 saves
    # nothing); on torch's int4 kernel, as for any model (bf16 where the CPU has it natively)
    from ladechat.engine.load.placement import resolve_dtype

    assert auto.dtype == (torch.float32 if HAS_COMPILER else resolve_dtype("auto", torch.device("cpu")))


def test_the_embedded_model_is_built_with_the_weights_of_transformers_own_gguf_load(embedded_int4):
    """load() builds the embedded model from its file's blocks (the fixture's load): every tensor
    transformers' own GGUF load (every tensor dequantized) then quantized.apply gives, bit for bit, its
    output layer on the Q8_0 kernel; a second load, from what is kept, the same logits."""
    from ladechat.engine.load.gguf import files as gguf_files

    folder = gguf_files.prepared_dir(gguf_path())
    full = dense_from_gguf(gguf_path())
    quantized.apply(full, gguf_path(), folder, cache_root() / "kernels" if HAS_COMPILER else None)
    built = embedded_int4.model.state_dict()
    wanted = full.state_dict()  # once: each call computes every 4-bit module's dense weight
    compared = [name for name in wanted if not name.startswith("lm_head.")]
    assert compared and all(torch.equal(built[name], wanted[name]) for name in compared)
    assert embedded_int4.model.generation_config.eos_token_id == full.generation_config.eos_token_id
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        again = load(LoadSpec(dtype="float32", device="cpu", weights="int4")).model
        assert torch.equal(again(ids).logits, transformers_model(embedded_int4.model)(ids).logits)


def test_embedded_int4_products_match_gguf_dequantize(embedded_int4):
    """The real blocks: each int4 Linear against the dense Linear of gguf's dequantize of its blocks
    (q and k through transformers' un-permutation, as the dense model has them)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(gguf_path())
    processor = LlamaTensorProcessor(config=embedded_int4.model.config.to_dict())
    torch.manual_seed(0)
    for layer in (0, 17, 29):
        for gguf_name, module_name in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                                       ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                                       ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                                       ("ffn_down", "mlp.down_proj")):
            tensor = next(t for t in reader.tensors if t.name == f"blk.{layer}.{gguf_name}.weight")
            name = f"blk.{layer}.{gguf_name}.weight"
            dense = processor.process(weights=gguf.dequantize(tensor.data, tensor.tensor_type), name=name).weights
            module = embedded_int4.model.get_submodule(f"model.layers.{layer}.{module_name}")
            assert type(module) is (q4.Q4Linear if HAS_COMPILER else int4.Int4Linear) and module.kind == "Q4_1"
            error = relative_error(module, torch.from_numpy(np.ascontiguousarray(dense)),
                                   torch.randn(4, module.in_features))
            assert error < (INT8_ERROR if HAS_COMPILER else BF16_ERROR), (layer, gguf_name)


def gguf_path() -> Path:
    from ladechat.engine.load.gguf.files import embedded_gguf

    return embedded_gguf()


def answer(lm, text: str, la: LookaheadConfig, step_cost=None, max_new: int = 40):
    ids = templates.encode(lm.tokenizer, [{"role": "user", "content": text}])
    session = Session(lm.model, la, step_cost=step_cost)
    done = list(generate(session, ids, SamplingConfig(max_new_tokens=max_new), lm.eos_ids))[-1]
    return ids, list(done.text_tokens), done.stats


# How far apart plain decoding's two best tokens may be where a lookahead answer on torch's int4
# kernel parts from it (no compiler: SDPA's attention too). SDPA's rows depend in fp32's last bits
# on how many rows a step has and how many keys it masks (the int4 kernel's rows do not, see
# above); bf16 activations round such differences up to ~0.05 in the embedded model's logits. A
# wrong accepted token parts at any margin. With ladechat's kernels, attention included, every row
# is computed alone: no parting at all.
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def embedded_int4_bf16():
    return load(LoadSpec(dtype="bfloat16", device="cpu", weights="int4"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookahead_on_4bit_weights_answers_as_plain_decoding(dtype, request):
    """Greedy, the embedded model on its 4-bit weights: lookahead's steps of many rows (full ones,
    and the CPU defaults planned with this layout's own step-cost curve) give plain decoding's
    tokens. On ladechat's kernels (products, norms and attention each computing a row alone) all
    of them, in fp32 and in bf16 (the default where the CPU has native bf16); on torch's int4
    kernel and SDPA (no compiler) they may part after a near tie."""
    lm = request.getfixturevalue("embedded_int4" if dtype == "float32" else "embedded_int4_bf16")
    rowwise = lm.model.config._attn_implementation == attention.ROWWISE
    assert rowwise == (HAS_COMPILER and int(torch.ops.ladechat_step.attend_best_path()) >= 1)
    configs = {"full": (LookaheadConfig(window=5, ngram=4, candidates=5, store=False), None),
               "planned": (default_lookahead("cpu", None), cost_envelope.cost_model(lm))}
    multi, identical, tried = 0, 0, 0
    for text in PROMPTS:
        ids, plain, _ = answer(lm, text, LookaheadConfig(enabled=False, store=False))
        assert len(plain) >= 20
        for name, (la, costs) in configs.items():
            _, ahead, stats = answer(lm, text, la, step_cost=costs)
            multi += sum(n for k, n in stats.accepted_histogram.items() if k >= 2)
            tried += 1
            if ahead == plain:
                identical += 1
                continue
            assert not rowwise, (name, text, "a lookahead answer parted from plain decoding")
            at = next(k for k in range(min(len(plain), len(ahead))) if plain[k] != ahead[k])
            with torch.inference_mode():
                logits = transformers_model(lm.model)(input_ids=torch.tensor([ids + plain[:at]])).logits[0, -1]
            margin = float(logits[plain[at]] - logits[ahead[at]])
            assert abs(margin) < NEAR_TIE, (name, text, at, margin)
    assert multi > 0, "no step accepted more than one token: the comparison proved nothing"
    assert identical == tried if rowwise else identical > 0


def test_weights_choices_that_cannot_run_are_one_line_errors(tmp_path):
    with pytest.raises(LoadError, match=r"unknown --weights 'int8' \(choose auto, dense, packed, int4\)"):
        load(LoadSpec(weights="int8"))
    with pytest.raises(LoadError, match="--weights int4 cannot be combined with --load-in-4bit"):
        load(LoadSpec(weights="int4", load_in_4bit=True))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LoadError, match=r"--weights int4 runs a \.gguf file's 4-bit .* is not a GGUF file"):
        load(LoadSpec(model=str(folder), weights="int4", device="cpu"))
    assert not int4.supported(torch.device("cuda")) and not int4.supported(torch.device("cpu"), machine="aarch64")


def test_dense_and_packed_stay_as_they_were():
    dense = load(LoadSpec(dtype="float32", device="cpu", weights="dense"))
    assert quantized.weight_layout(dense.model) == "dense:211" and dense.weights == ""
    if packing.supported(torch.device("cpu"), torch.float32):
        packed = load(LoadSpec(dtype="float32", device="cpu", weights="packed"))
        assert quantized.weight_layout(packed.model) == "packed:211"
        assert packed.weights == "211 packed float32 (oneDNN)"
    # --compile's loads keep every Linear as loaded, whatever --weights says
    assert quantized.weight_layout(load(LoadSpec(dtype="float32", device="cpu", pack_weights=False)).model) == "dense:211"


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A copy of the embedded GGUF and a cache folder of its own (the suite's compiled kernels linked)."""
    from ladechat.engine.load.gguf import files as gguf_files

    user_kernels = cache_root() / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache_root().mkdir(parents=True)
    (cache_root() / "kernels").symlink_to(user_kernels)
    copy = tmp_path / "own.gguf"
    shutil.copyfile(gguf_files.embedded_gguf(), copy)
    return copy


def test_a_ggufs_verdicts_are_kept_once_though_its_blocks_are_written_meanwhile(own_cache, monkeypatch):
    """The first load of a GGUF writes its kept blocks in a thread while the mask and thread probes
    run; those files are the GGUF's own, so the verdicts' keys leave them out: the second load
    (the blocks now there) finds the first's verdicts rather than probing again."""
    from ladechat.engine.load.gguf import files as gguf_files
    from ladechat.engine.load.gguf import kept

    copy = own_cache
    # the blocks written only once both probes have run, as a 7B's are: deterministic here
    from ladechat.engine.load import loading

    probed, keep, governed = threading.Event(), kept.keep_beside, loading.governed
    monkeypatch.setattr(kept, "keep_beside",  # (head.py keeps its small file at once, as before)
                        lambda *a: (threading.current_thread() is threading.main_thread() or probed.wait()) and keep(*a))
    monkeypatch.setattr(loading, "governed", lambda *a: (governed(*a), probed.set())[0])
    from ladechat.engine import thread_probe

    for _ in range(2):
        load(LoadSpec(model=str(copy), device="cpu"), probe=thread_probe.cached_verdict)
        verdicts = {kind: sorted(p.name for p in (cache_root() / kind).glob("*")) for kind in ("mask-probe", "thread-probe")}
        if _ == 0:
            first = verdicts
    assert len(first["mask-probe"]) == 1 and verdicts == first
    assert list(gguf_files.prepared_dir(copy).glob("int4-*.safetensors"))


def test_blocks_that_cannot_be_kept_are_one_notice_and_the_model_runs(own_cache, monkeypatch):
    """A cache folder that cannot take the kept blocks (a full disk): the load says so in one notice,
    leaves no part of the file behind, and the model answers as the GGUF's own."""
    import errno

    from ladechat.engine.load.gguf import files as gguf_files
    from ladechat.engine.load.gguf import kept

    copy = own_cache
    write = kept.write

    def full(path, arrays, metadata):
        if any(".tiles" in key for key in arrays):  # the 4-bit blocks, not the small output-layer file
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, arrays, metadata)

    monkeypatch.setattr(kept, "write", full)
    loaded = load(LoadSpec(model=str(copy), device="cpu"))
    folder = gguf_files.prepared_dir(copy)
    assert [n for n in loaded.notices if "cannot keep" in n] == [
        f"cannot keep the kernels' layout in {folder} (No space left on device): the next load reads the GGUF again"]
    assert not list(folder.glob("int4-*")) and "q4:" in quantized.weight_layout(loaded.model)
    monkeypatch.setattr(kept, "write", write)
    again = load(LoadSpec(model=str(copy), device="cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(transformers_model(loaded.model)(ids).logits, transformers_model(again.model)(ids).logits)
    assert list(folder.glob("int4-*.safetensors")) and not any("cannot keep" in n for n in again.notices)
