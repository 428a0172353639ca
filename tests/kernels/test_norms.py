"""ladechat's kernels for a step's small ops (engine/kernels/step_ops.cpp): RMSNorm (norms.py) against
transformers' module on the same inputs, the same bits for a row whatever the step's rows or
threads, the fused residual add, which models get it (4-bit weights only); the rows' top-k against
torch's; and what happens without a compiler. The rotation is tested in test_llama.py (bitwise the
model's forward)."""

import inspect
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import PATIENCE_S
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ladechat.engine.kernels import int4, native, norms
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load

HAS_COMPILER = shutil.which(native.COMPILER) is not None


def pair(dtype: torch.dtype, hidden: int = 576, seed: int = 0) -> tuple[LlamaRMSNorm, norms.NativeRMSNorm]:
    generator = torch.Generator().manual_seed(seed)
    module = LlamaRMSNorm(hidden, eps=1e-5)
    module.weight.data = (torch.rand(hidden, generator=generator) * 2).to(dtype)
    return module.to(dtype), norms.NativeRMSNorm(module.weight, 1e-5)


def rows(count: int, dtype: torch.dtype, hidden: int = 576, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, hidden, generator=generator) * 4).to(dtype)


@pytest.mark.parametrize("hidden", [576, 64, 37])  # the embedded model's, a tiny model's, one with a tail
def test_the_kernel_computes_the_modules_norm(step_kernel, hidden):
    """fp32: within the last bits (the sum of squares is added in another order); bf16: the
    module's bits but where a product lands within a rounding of a tie."""
    for dtype in (torch.float32, torch.bfloat16):
        module, ours = pair(dtype, hidden)
        x = rows(64, dtype, hidden)
        expected, got = module(x), ours(x)
        assert got.dtype == dtype and got.shape == x.shape
        relative = ((got.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-30)).max()
        if dtype == torch.float32:
            assert relative <= 4e-7
        else:  # a bf16 result may round the other way at a near tie: one unit in the last place at most
            assert relative <= 2 ** -7 and (got != expected).float().mean() < 0.01
        assert torch.equal(ours(x[None])[0], got)  # any leading dims


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(step_kernel):
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        _, ours = pair(dtype)
        x = rows(300, dtype)  # more rows than a thread's share: the rows split between threads
        try:
            torch.set_num_threads(2)
            together = ours(x)
            torch.set_num_threads(1)
            alone = torch.cat([ours(x[i:i + 1]) for i in range(0, 300, 37)])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, together[0:300:37])


def test_the_fused_add_is_the_add_then_the_norm(step_kernel):
    for dtype in (torch.float32, torch.bfloat16):
        module, ours = pair(dtype)
        x, delta = rows(9, dtype), rows(9, dtype, seed=2)
        total, normed = ours.add_norm()(x, delta)
        assert torch.equal(total, x + delta) and torch.equal(normed, ours(x + delta))
        fallback_total, fallback_normed = norms.add_norm(module)(x, delta)  # a module the kernel does not replace
        assert torch.equal(fallback_total, x + delta) and torch.equal(fallback_normed, module(x + delta))


def test_the_replaced_classes_compute_what_the_kernel_does():
    """The classes norms.apply replaces have transformers' Llama RMSNorm forward, word for word."""
    import importlib

    llama = inspect.getsource(LlamaRMSNorm.forward)
    for name in norms.REPLACEABLE:
        family = name.removesuffix("RMSNorm").lower()
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        assert inspect.getsource(cls.forward) == llama, name


@pytest.mark.slow
def test_the_embedded_model_on_4bit_weights_runs_its_norms_on_the_kernel(step_kernel):
    if not int4.supported(torch.device("cpu")):
        pytest.skip("the embedded model's 4-bit path runs on x86-64 only")
    lm = load(LoadSpec(dtype="float32", device="cpu", weights="int4"))
    found = [m for m in lm.model.modules() if type(m) is norms.NativeRMSNorm]
    assert len(found) == 61 and "61 RMSNorm by ladechat's kernel" in lm.weights
    assert quantized.weight_layout(lm.model).endswith(",norm:61")
    # the dense and packed paths keep transformers' norms: they must stay token-identical to HF greedy
    for weights in ("packed", "dense"):
        model = load(LoadSpec(dtype="float32", device="cpu", weights=weights)).model
        assert not any(type(m) is norms.NativeRMSNorm for m in model.modules()), weights
        assert "norm" not in quantized.weight_layout(model)


@pytest.mark.slow
def test_without_a_compiler_everything_runs_on_torchs_ops(tmp_path):
    """In a fresh process (this one may have the kernels loaded): the reason in one line, the
    norms stay transformers' modules, the Llama's steps rotate and the runner ranks with torch's ops."""
    script = (
        "from pathlib import Path\n"
        "import torch\n"
        "from ladechat.engine import runner\n"
        "from ladechat.engine.models import llama\n"
        "from ladechat.engine.kernels import norms, step_ops\n"
        "from ladechat.engine.load.gguf.files import embedded_gguf\n"
        "from transformers import AutoModelForCausalLM\n"
        "from ladechat.engine.kernels.attention import use_grouped_sdpa\n"
        "gguf = embedded_gguf()\n"
        "model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)\n"
        "use_grouped_sdpa(model)\n"
        f"print(step_ops.load(Path({str(tmp_path)!r}), compiler='no-such-c++'))\n"
        "print(norms.apply(model), type(model.model.norm).__name__)\n"
        "print(llama.Llama.adopt(model).bind().rope is llama._torch_rope)\n"
        "print(sorted(runner.top_k(torch.tensor([[0.5, 2.0, 1.0] * 4]))[0][:4].tolist()))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE_S, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["no C++ compiler (no-such-c++) to build step_ops.cpp", "0 LlamaRMSNorm",
                                        "True", "[1, 4, 7, 10]"]


def test_norms_stay_on_the_cpu(step_kernel):
    _, ours = pair(torch.float32)
    with pytest.raises(TypeError, match="stay on the CPU"):
        ours.to(torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_llama_steps_with_kernel_norms_are_the_forward(step_kernel, family, dtype):
    """Every norm of a tiny model of each family the Llama file takes replaced: its steps' logits
    and cache (the residual add fused into the norm's call) equal the model's own forward's."""
    from test_llama import assert_steps_match, grouped

    model = grouped(family).to(dtype)
    assert norms.apply(model) == 2 * model.config.num_hidden_layers + 1
    assert_steps_match(model, list(range(3, 40)))


def test_finding_the_norms_reads_no_other_modules_weight(step_kernel):
    """An int4 or Q8_0 layer's `weight` is a dense copy computed at each read (seconds for the
    embedded model's 210 int4 layers): finding the norms must not read it."""
    from test_llama import grouped

    class ComputedWeight(torch.nn.Module):
        @property
        def weight(self):
            raise AssertionError("a computed weight was read")

    model = grouped("llama")
    model.model.layers[0].set_submodule("mlp", ComputedWeight())
    assert norms.apply(model) == 2 * model.config.num_hidden_layers + 1
