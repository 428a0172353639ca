"""Linear weights packed for oneDNN (engine/load/packing.py): the same products, exact greedy decoding on
the packed model, and the way back to the model as transformers loads it."""

import gc
import random
import weakref
import zlib

import pytest
import torch
from test_exactness import hf_greedy, repetitive_prompt, run
from tiny_models import FAMILIES, tiny_model

from ladechat.engine.config import LookaheadConfig
from ladechat.engine.load import packing
from ladechat.engine.load.loading import LoadSpec, load

pytestmark = pytest.mark.skipif(not packing.supported(torch.device("cpu"), torch.float32),
                                reason="packing needs an x86-64 CPU with oneDNN (every machine the tests run on "
                                "has one)")
BF16 = packing.supported(torch.device("cpu"), torch.bfloat16)


def packed_twin(family: str, dtype=torch.float32):
    """(the tiny model as built, the same model packed)"""
    plain, packed = tiny_model(family).to(dtype), tiny_model(family).to(dtype)
    assert packing.pack(packed) == sum(type(m) is torch.nn.Linear for m in plain.modules())
    return plain, packed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_model_computes_the_same_logits(family):
    plain, packed = packed_twin(family)
    ids = torch.tensor([repetitive_prompt(random.Random(1), plain.config.vocab_size, 30)])
    with torch.inference_mode():
        want, got = plain(ids).logits, packed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the input embedding (tied to the output layer in gemma) stays as it was
    assert torch.equal(packed.get_input_embeddings().weight, plain.get_input_embeddings().weight)


@pytest.mark.skipif(not BF16, reason="no oneDNN bf16 kernels here")
@pytest.mark.parametrize("features", [(576, 1536), (1536, 576), (576, 49152)], ids=["up", "down", "vocabulary"])
def test_packed_bf16_products_are_bit_identical_to_linear(features):
    """In bf16 both go through oneDNN; packing only moves the weight's reorder to load time. The
    embedded model's shapes: up/gate projection, down projection (1536-long sums), output layer."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(*features, bias=True).to(torch.bfloat16)
    packed = packing.PackedLinear(linear)
    for rows in (1, 3, 8, 17):
        x = torch.randn(1, rows, features[0]).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(packed(x), linear(x)), rows


def test_a_packed_model_saves_as_built_and_refuses_to_move():
    """Its state dict loads into the model as built (the same keys, nn.Linear's `weight`), and
    `.to()`/`.half()` fail with a message instead of handing oneDNN's tensor to a cast."""
    plain, packed = packed_twin("llama")
    saved = packed.state_dict()
    assert saved.keys() == plain.state_dict().keys()
    fresh = tiny_model("llama")
    fresh.load_state_dict(saved)
    ids = torch.tensor([repetitive_prompt(random.Random(2), plain.config.vocab_size, 12)])
    with torch.inference_mode():
        assert torch.equal(fresh(ids).logits, plain(ids).logits)
    for move in (lambda m: m.to(torch.float64), lambda m: m.half()):
        with pytest.raises(TypeError, match="load with pack_weights=False to move or cast the model"):
            move(packed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lookahead_on_packed_weights_is_identical_to_hf_greedy_on_them(family):
    _, model = packed_twin(family)
    rng = random.Random(zlib.crc32(f"packed-{family}".encode()))
    for w, n, g in [(1, 2, 0), (3, 3, 2), (5, 4, 5), (2, 5, 7)]:
        prompt = repetitive_prompt(rng, model.config.vocab_size, rng.randint(5, 40))
        max_new = rng.randint(20, 50)
        la = LookaheadConfig(window=w, ngram=n, candidates=g, context_candidates=2, recycle=8)
        ours, _, _ = run(model, prompt, la, max_new)
        assert ours == hf_greedy(model, prompt, max_new), (family, w, n, g)


def test_unpack_restores_the_weights_exactly():
    plain, packed = packed_twin("gemma")  # tied input and output embeddings
    assert packing.is_packed(packed) and not packing.is_packed(plain)
    assert packing.unpack(packed) == sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert not packing.is_packed(packed)
    want = dict(plain.named_parameters(remove_duplicate=False))
    for name, value in packed.named_parameters(remove_duplicate=False):
        assert torch.equal(value, want[name]), name
    assert want.keys() == dict(packed.named_parameters(remove_duplicate=False)).keys()


def test_pack_frees_each_plain_weight_as_it_goes():
    """A replaced Linear's weight is freed before the walk ends (holding them all until then would
    need a second copy of the model's weights while packing); a tied input embedding is kept."""
    model = tiny_model("gemma")  # tied input and output embeddings
    total = sum(type(m) is torch.nn.Linear for m in model.modules())
    packed_when_freed = []
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and name != "lm_head":
            weakref.finalize(m.weight, lambda: packed_when_freed.append(
                sum(type(x) is packing.PackedLinear for x in model.modules())))
    embedding = model.get_input_embeddings().weight
    packing.pack(model)
    gc.collect()
    assert len(packed_when_freed) == total - 1 and min(packed_when_freed) < total
    assert model.get_input_embeddings().weight is embedding


def test_pack_leaves_linear_subclasses_and_other_dtypes_alone():
    class Quantized(torch.nn.Linear):  # as bitsandbytes' Linear4bit and Linear8bitLt are
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Quantized(8, 8), torch.nn.Linear(8, 8).half())
    assert packing.pack(model) == 1
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Quantized", "Linear"]


def test_layout_switch_runs_the_model_as_loaded_and_packs_it_again():
    plain, packed = packed_twin("llama")
    switch = packing.LayoutSwitch(packed)
    prompt = repetitive_prompt(random.Random(3), plain.config.vocab_size, 20)
    before = [m for m in packed.modules() if type(m) is packing.PackedLinear]
    with switch.as_loaded() as model:
        assert not packing.is_packed(model)
        assert hf_greedy(model, prompt, 30) == hf_greedy(plain, prompt, 30)
        with torch.inference_mode():
            assert torch.equal(model(torch.tensor([prompt])).logits, plain(torch.tensor([prompt])).logits)
    assert [m for m in packed.modules() if type(m) is packing.PackedLinear] == before  # the same modules back


@pytest.mark.parametrize("device,dtype,machine,bf16_kernels,expected", [
    ("cpu", torch.float32, "x86_64", False, True),  # fp32 packs on every x86-64 CPU (AVX2 ones too)
    ("cpu", torch.float32, "x86_64", True, True),
    ("cpu", torch.bfloat16, "AMD64", True, True),  # bf16 where oneDNN has bf16 kernels (AVX-512, AVX-NE-CONVERT)
    ("cpu", torch.bfloat16, "x86_64", False, False),  # ...and not on an AVX2-only CPU, where packing fails
    ("cpu", torch.float16, "x86_64", True, False), ("cpu", torch.float32, "aarch64", True, False),
    ("cuda", torch.bfloat16, "x86_64", True, False), ("meta", torch.float32, "x86_64", True, False),
])
def test_packing_is_for_x86_cpus_in_fp32_and_bf16(device, dtype, machine, bf16_kernels, expected):
    """The decision for each kind of CPU, given its capabilities: the same on every machine."""
    assert packing.supported(torch.device(device), dtype, machine, bf16_kernels) is expected


def test_this_cpu_packs_bf16_as_onednn_says():
    assert packing.supported(torch.device("cpu"), torch.bfloat16) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.fixture()
def tiny_folder(tmp_path):
    from tiny_models import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_load_packs_cpu_weights_unless_told_not_to(tiny_folder):
    assert packing.is_packed(load(LoadSpec(model=tiny_folder, dtype="float32", device="cpu")).model)
    assert not packing.is_packed(load(LoadSpec(model=tiny_folder, dtype="float32", device="cpu",
                                               pack_weights=False)).model)


def test_compile_loads_the_weights_as_they_are_and_refuses_packed_ones(tiny_folder):
    from ladechat.backends.opener import load_model
    from ladechat.engine.runner import CompiledForward

    def load_for(compile):
        return load_model(LoadSpec(model=tiny_folder, dtype="float32", device="cpu"), None, compile=compile)

    assert not packing.is_packed(load_for(compile=True).model)
    with pytest.raises(ValueError, match="compiling needs the model's own Linear modules"):
        CompiledForward(load_for(compile=False).model)


def test_bench_refuses_hf_packed_on_weights_that_are_not_packed(tiny_folder):
    from ladechat.bench.prompts import BenchError
    from ladechat.bench.prompts import run as bench_run
    from ladechat.settings import Settings

    loaded = load(LoadSpec(model=tiny_folder, dtype="float32", device="cpu", pack_weights=False))
    with pytest.raises(BenchError, match=r"hf-packed needs packed \(oneDNN\) weights"):
        bench_run(loaded, ["mtbench"], ["hf-packed", "plain"], Settings(), limit=1)


def test_step_cost_curves_of_packed_and_plain_weights_are_cached_apart(tmp_path, monkeypatch):
    from ladechat.engine.step_cost import cached_curve
    from ladechat.paths import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plain, packed = packed_twin("llama")
    cached_curve(plain, "tiny-llama", context=16)
    cached_curve(packed, "tiny-llama", context=16)
    assert len(list((cache_root() / "step-cost").iterdir())) == 2


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16, reason="no oneDNN bf16 kernels here"))])
def test_a_packed_linear_still_shows_its_weight(dtype):
    """Some families' layers read a Linear's `.weight` themselves (its dtype, or a product with it):
    a packed one gives the same values, dense, in its dtype."""
    linear = torch.nn.Linear(24, 40, bias=False).to(dtype)
    packed = packing.PackedLinear(linear)
    assert packed.weight.dtype == dtype and torch.equal(packed.weight, linear.weight)
    assert "weight" not in dict(packed.named_parameters())  # the packed buffer is what it computes with
