"""--quantize: a Hugging Face checkpoint's weights quantized as it loads into the GGUF blocks
ladechat's CPU kernels run (engine/load/requantize.py): each weight is exactly its blocks, lookahead
equals plain decoding on them, the layout is kept and read back, and what cannot go is a one-line error."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quants
from tiny_models import tiny_tokenizer
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.kernels import q4, q8
from ladechat.engine.kernels.embedding import BlockEmbedding
from ladechat.engine.load import loading, placement, requantize
from ladechat.engine.load.loading import LoadError, LoadSpec, load
from ladechat.engine.models import transformers_model
from ladechat.paths import cache_root

# head dim 64: the row-wise attention kernel's (attention.HEAD_DIMS), so every row is computed alone
SHAPE = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05)
# a Llama with its own output layer; a Qwen2 with q/k/v biases and an output layer tied to the embedding
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "use_sliding_window": False})}
# Gemma: an embedding that scales its rows (not kept as blocks), a scale that is a buffer
GEMMA = (GemmaConfig, GemmaForCausalLM, {"tie_word_embeddings": True})


def checkpoint(folder, family: str, dtype: torch.dtype = torch.float32, **shape) -> str:
    config_cls, model_cls, extra = GEMMA if family == "gemma" else FAMILIES[family]
    torch.manual_seed(3)
    model = model_cls(config_cls(**{**SHAPE, **shape}, **extra))
    with torch.no_grad():  # biases are zero at initialisation: give them values the blocks must leave alone
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.to(dtype).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def kernels(kernel, step_kernel):
    if q4.best_path() < 1:
        pytest.skip("--quantize runs on ladechat's AVX2 or AVX-512 kernels; this CPU has neither")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, kernels):
    return {family: checkpoint(tmp_path_factory.mktemp(family), family) for family in FAMILIES}


def blocks(weight: torch.Tensor, kind: str) -> np.ndarray:
    return quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType[kind])


def test_blocks_are_gguf_pys_whatever_the_slices(monkeypatch):
    """Quantized a slice of rows at a time, a weight's blocks are those of the whole at once."""
    weight = torch.randn(10, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    monkeypatch.setattr(requantize, "ROWS_AT_ONCE", 3)
    for kind in ("Q4_0", "Q8_0"):
        assert np.array_equal(requantize.blocks_of(weight, kind), blocks(weight, kind))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantize", ["q4", "q8"])
def test_each_weight_is_exactly_its_blocks(folders, family, quantize):
    """Every Linear runs on a kernel and its weight is its blocks' (gguf-py's dequantization, bit for
    bit): the layers' at q4's or q8's type, the output layer and the token embedding Q8_0; biases
    and norms as the checkpoint has them, in fp32; no dense weight left."""
    dense = AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32)
    lm = load(LoadSpec(model=folders[family], device="cpu", quantize=quantize))
    kind = requantize.KINDS[quantize]
    model, weights = lm.model, dict(dense.named_parameters())
    assert lm.dtype == torch.float32 and model.config.dtype == torch.float32
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    head_weight = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    for name, module in model.named_modules():
        if name == "lm_head":
            assert type(module) is q8.Q8Linear
            expected = dequantize(blocks(head_weight, "Q8_0"), GGMLQuantizationType.Q8_0)
        elif isinstance(module, (q4.Q4Linear, q8.Q8Linear)):
            assert type(module) is (q4.Q4Linear if kind == "Q4_0" else q8.Q8Linear)
            assert kind == "Q8_0" or module.kind == kind
            expected = dequantize(blocks(weights[f"{name}.weight"], kind), GGMLQuantizationType[kind])
            if f"{name}.bias" in weights:
                assert torch.equal(module.bias, weights[f"{name}.bias"])
        else:
            continue
        assert torch.equal(module.dense_weight(), torch.from_numpy(expected)), name
    embedding = model.get_input_embeddings()
    assert type(embedding) is BlockEmbedding
    table = weights["model.embed_tokens.weight"]
    assert torch.equal(embedding.weight, torch.from_numpy(dequantize(blocks(table, "Q8_0"), GGMLQuantizationType.Q8_0)))
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])
    assert "Q8_0 blocks" in lm.weights and (kind == "Q8_0" or f"from {kind} blocks" in lm.weights)


def answer(lm, prompt: str, la: LookaheadConfig) -> list[int]:
    ids = lm.tokenizer(prompt)["input_ids"]
    return list(list(generate(Session(lm.model, la), ids, SamplingConfig(max_new_tokens=48), lm.eos_ids))[-1].text_tokens)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lookahead_is_plain_decoding_on_the_quantized_weights(folders, family):
    """On the quantized weights each row is computed alone (block products, row-wise attention), so
    the Llama prefills in parts and decodes, and a lookahead answer is plain decoding's, token for token."""
    lm = load(LoadSpec(model=folders[family], device="cpu", quantize="q4"))
    assert lm.model.bind().rows_alone
    for prompt in ("the cat sat on the mat. the cat sat on", "abcabcabcabc"):
        plain = answer(lm, prompt, LookaheadConfig(enabled=False))
        assert len(plain) == 48
        assert answer(lm, prompt, LookaheadConfig(window=4, ngram=4, candidates=4)) == plain


def test_the_layout_is_kept_and_read_back(folders, monkeypatch):
    """A first load quantizes and keeps the layout in the cache; a later one reads it (quantizing
    nothing) and computes the same logits; once a file of the checkpoint changes, a load quantizes
    afresh and its layout replaces the one before."""
    folder = folders["llama"]
    shutil.rmtree(cache_root() / "quantized", ignore_errors=True)
    first = load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    kept = list((cache_root() / "quantized").glob("*/quantized-Q4_0-*.safetensors"))
    assert len(kept) == 1
    ids = torch.tensor([[5, 17, 33, 2, 64]])
    with torch.no_grad():
        logits = transformers_model(first.model)(ids).logits
    made = requantize.quantize

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(requantize, "quantize", refuse)
    again = load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    with torch.no_grad():
        assert torch.equal(transformers_model(again.model)(ids).logits, logits)
    (Path(folder) / "config.json").touch()
    with pytest.raises(AssertionError, match="quantized again"):
        load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    monkeypatch.setattr(requantize, "quantize", made)
    load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    now = list((cache_root() / "quantized").glob("*/quantized-Q4_0-*.safetensors"))
    assert len(now) == 1 and now != kept and now[0].parent == kept[0].parent


def test_the_products_are_the_dequantized_weights(folders):
    """The quantized model's logits are those of the dense model holding the blocks' dequantized
    weights, but for the int8 rounding of the activations (q/k/v and gate/up run joined): far
    closer to them than to the checkpoint's own float logits."""
    folder = folders["qwen2"]
    lm = load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, module in lm.model.named_modules():
            if isinstance(module, (q4.Q4Linear, q8.Q8Linear)):
                dense.get_submodule(name).weight.copy_(module.dense_weight())
        dense.get_input_embeddings().weight.copy_(lm.model.get_input_embeddings().weight)
        ids = torch.tensor([[5, 17, 33, 2, 64, 9, 81]])
        ours, theirs, floats = (m(ids).logits for m in (lm.model, dense, original))
    assert (ours - theirs).abs().max() < 0.25 * (floats - theirs).abs().max()


def test_a_bf16_checkpoint_is_read_in_bf16_and_runs_in_fp32(tmp_path, kernels, monkeypatch):
    """A bf16 checkpoint is read as it is (no float32 copy of the weights), its blocks made from
    its bf16 values, and the rest runs in fp32 (--dtype auto, as for a GGUF)."""
    folder = checkpoint(tmp_path, "llama", torch.bfloat16)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    seen = set()
    blocks_of = requantize.blocks_of

    def recorded(weight, kind):
        seen.add(weight.dtype)
        return blocks_of(weight, kind)

    monkeypatch.setattr(requantize, "blocks_of", recorded)
    lm = load(LoadSpec(model=folder, device="cpu", quantize="q8"))
    assert seen == {torch.bfloat16}
    assert lm.dtype == torch.float32 and lm.model.model.norm.weight.dtype == torch.float32
    down = lm.model.model.layers[1].mlp.down_proj
    expected = dequantize(blocks(dense.model.layers[1].mlp.down_proj.weight, "Q8_0"), GGMLQuantizationType.Q8_0)
    assert torch.equal(down.dense_weight(), torch.from_numpy(expected))


def test_buffers_and_what_stays_dense(tmp_path, kernels):
    """A bf16 Gemma: its embedding scales its rows, so it stays dense (the tied output layer still
    gets Q8_0 blocks of it), and its scale, a buffer, is sqrt(hidden) in fp32 as an fp32 model makes
    it, not the bf16 rounding the checkpoint was read with; a Linear whose inputs are not a
    multiple of 32 stays dense, with a notice, and the model still runs."""
    folder = checkpoint(tmp_path / "gemma", "gemma", torch.bfloat16, head_dim=64)
    lm = load(LoadSpec(model=folder, device="cpu", quantize="q8"))
    embedding = lm.model.get_input_embeddings()
    assert type(embedding) is not BlockEmbedding and embedding.weight.dtype == torch.float32
    assert embedding.embed_scale.dtype == torch.float32 and embedding.embed_scale.item() == SHAPE["hidden_size"] ** 0.5
    assert type(lm.model.lm_head) is q8.Q8Linear
    odd = checkpoint(tmp_path / "odd", "llama", intermediate_size=48)
    lm = load(LoadSpec(model=odd, device="cpu", quantize="q4"))
    assert not isinstance(lm.model.model.layers[0].mlp.down_proj, (q4.Q4Linear, q8.Q8Linear))  # dense (packed)
    assert type(lm.model.model.layers[0].mlp.up_proj) is q4.Q4Linear
    assert any("mlp.down_proj (256x48) stays dense" in notice for notice in lm.notices)
    with torch.no_grad():
        assert torch.isfinite(transformers_model(lm.model)(torch.tensor([[3, 4, 5]])).logits).all()


def test_what_cannot_be_quantized_is_a_one_line_error(folders, monkeypatch, tmp_path):
    folder = folders["llama"]
    with pytest.raises(LoadError, match=r"unknown --quantize 'q3' \(choose q4, q8\)"):
        load(LoadSpec(model=folder, quantize="q3"))
    with pytest.raises(LoadError, match="is a GGUF file, already quantized: --quantize takes a Hugging Face model"):
        load(LoadSpec(quantize="q4"))
    with pytest.raises(LoadError, match="--quantize cannot be combined with --load-in-4bit"):
        load(LoadSpec(model=folder, quantize="q4", load_in_4bit=True))
    with pytest.raises(LoadError, match="--weights packed cannot go with it"):
        load(LoadSpec(model=folder, quantize="q8", weights="packed"))
    with pytest.raises(LoadError, match="--compile .* cannot run --quantize"):
        LoadSpec(model=folder, quantize="q4").for_steps(compiled=True)
    monkeypatch.setattr(placement, "resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(LoadError, match="--quantize runs on ladechat's CPU kernels, not on cuda"):
        load(LoadSpec(model=folder, quantize="q4", device="cuda"))
    monkeypatch.undo()
    monkeypatch.setattr(q4, "load", lambda kernels, progress=None, compiler=None: "the compiler failed: x.cpp:1")
    with pytest.raises(LoadError, match="--quantize runs on ladechat's CPU kernels, which cannot run here: the comp"):
        load(LoadSpec(model=folder, quantize="q4", device="cpu"))
    monkeypatch.setattr(loading.shutil, "which", lambda name: None)
    with pytest.raises(LoadError, match=r"--quantize runs on ladechat's CPU kernels, which need a C\+\+ compiler"):
        load(LoadSpec(model=folder, quantize="q4", device="cpu"))
    monkeypatch.undo()
    config = json.loads((Path(folder) / "config.json").read_text())
    quantized = tmp_path / "gptq"
    shutil.copytree(folder, quantized)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"gptq is already quantized \(gptq weights\): --quantize takes a model of float"):
        load(LoadSpec(model=str(quantized), quantize="q4"))


def test_the_command_quantizes_once_and_answers_as_plain_decoding(folders):
    """`ladechat ask --quantize q4` in a process of its own: the first run quantizes and keeps the
    layout (a notice-free answer on stdout), the second reads it; both runs' greedy tokens, with
    lookahead and without, are the in-process plain decoding's on the same blocks."""
    import subprocess

    from conftest import PATIENCE_S, ladechat_bin

    folder = folders["qwen2"]
    shutil.rmtree(cache_root() / "quantized", ignore_errors=True)
    lm = load(LoadSpec(model=folder, device="cpu", quantize="q4"))
    shutil.rmtree(cache_root() / "quantized", ignore_errors=True)
    prompt = "the cat sat on the mat. the cat sat on"
    expected = answer(lm, lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                           add_generation_prompt=True), LookaheadConfig(enabled=False))
    runs = []
    for flag in ("--lookahead", "--no-lookahead"):
        r = subprocess.run([ladechat_bin(), "ask", "--json", "--keep-alive", "0", "--no-store", flag, "--quantize", "q4",
                            "--model", folder, "--max-new-tokens", "48", prompt],
                           capture_output=True, timeout=PATIENCE_S, env={**os.environ, "NO_COLOR": ""})
        assert r.returncode == 0, r.stderr.decode()
        runs.append(json.loads(r.stdout)["token_ids"])
        assert len(list((cache_root() / "quantized").glob("*/quantized-Q4_0-*.safetensors"))) == 1
    assert runs[0] == runs[1] == expected[: len(runs[0])] and len(runs[0]) == 48
