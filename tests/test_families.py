"""The model families GGUF users meet, each from a tiny file written here with gguf-py in the
tensor names and metadata llama.cpp's converter gives them (random weights, the embedded model's
tokenizer): ladechat builds each, its logits are transformers' own GGUF load's, and lookahead
answers equal plain decoding's, with float weights and with 4-bit blocks. A file of an architecture
that cannot be built is one line naming it. (Llama itself: tests/test_int4.py, test_q6.py.)"""

import contextlib
import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done
from ladechat.engine.kernels import int4
from ladechat.engine.load.gguf.files import embedded_gguf
from ladechat.engine.load.loading import LoadError, LoadSpec, load
from ladechat.engine.models import llama, transformers_model

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


@functools.cache  # gguf-py takes seconds to parse the 49k tokens and merges; every family writes them
def tokenizer_fields() -> tuple:
    reader = gguf.GGUFReader(embedded_gguf())
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            out.append((key, field.contents(), kind, field.types[1] if kind == gguf.GGUFValueType.ARRAY else None))
    return tuple(out)


def write_family(arch: str, path: Path, four_bit: bool) -> Path:
    """A 2-layer model of `arch`: float32 weights, or Q4_0 Linear weights with a Q8_0 embedding and
    output layer. Qwen3's head size is 128 (what transformers assumes: its GGUF config has none)."""
    head_dim = 128 if arch == "qwen3" else HIDDEN // HEADS
    rng = np.random.default_rng(0)
    fields = tokenizer_fields()
    vocab = len(next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(4096)
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub_type=sub)

    def matrix(name: str, rows: int, cols: int, scale: float = 0.05) -> None:
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if four_bit:
            kind = T.Q8_0 if name.startswith(("token_embd", "output")) else T.Q4_0
            writer.add_tensor(name, gguf.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, np.float32))

    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    matrix("token_embd.weight", vocab, HIDDEN, scale=0.5)
    ones("output_norm.weight", HIDDEN)
    if arch not in ("gemma2", "gemma3"):  # Gemma ties its output layer to the embedding
        matrix("output.weight", vocab, HIDDEN)
    for layer in range(LAYERS):
        block = f"blk.{layer}."
        ones(block + "attn_norm.weight", HIDDEN)
        ones(block + "ffn_norm.weight", HIDDEN)
        if arch == "phi3":  # q, k and v in one tensor, gate and up in another
            matrix(block + "attn_qkv.weight", q + 2 * kv, HIDDEN)
            matrix(block + "ffn_up.weight", 2 * FFN, HIDDEN)
        else:
            matrix(block + "attn_q.weight", q, HIDDEN)
            matrix(block + "attn_k.weight", kv, HIDDEN)
            matrix(block + "attn_v.weight", kv, HIDDEN)
            matrix(block + "ffn_gate.weight", FFN, HIDDEN)
            matrix(block + "ffn_up.weight", FFN, HIDDEN)
        matrix(block + "attn_output.weight", HIDDEN, q)
        matrix(block + "ffn_down.weight", HIDDEN, FFN)
        if arch == "qwen2":
            for name, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"{block}{name}.bias", (rng.standard_normal(size) * 0.05).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            ones(block + "attn_q_norm.weight", head_dim)
            ones(block + "attn_k_norm.weight", head_dim)
        if arch in ("gemma2", "gemma3"):
            ones(block + "post_attention_norm.weight", HIDDEN)
            ones(block + "post_ffw_norm.weight", HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def answer(lm, ids: list[int], lookahead: bool) -> list[int]:
    session = Session(lm.model, LookaheadConfig(enabled=lookahead))
    for event in generate(session, ids, SamplingConfig(max_new_tokens=24), lm.eos_ids, lm.tokenizer.decode):
        if isinstance(event, Done):
            return list(event.text_tokens)
    raise AssertionError("no answer")


@pytest.mark.parametrize("four_bit", [False, True], ids=["float", "4-bit"])
@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_each_family_builds_as_transformers_does_and_lookahead_keeps_its_answer(arch, four_bit, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_family(arch, tmp_path / f"{arch}.gguf", four_bit)
    lm = load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    assert type(transformers_model(lm.model)).__name__ == CLASSES[arch]
    assert isinstance(lm.model, llama.Llama) is (arch in llama.FAMILIES)  # ladechat's own file runs those
    if int4.supported(torch.device("cpu")):
        assert ("Q4_0 blocks" in lm.weights) is four_bit
    # the embedding stays as its blocks, but Gemma's, which scales its rows in its own module
    assert ("the token embedding as" in lm.weights) is not arch.startswith("gemma"), lm.weights
    assert lm.tokenizer.chat_template  # the file's own template
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about lighthouses."}],
                                           add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = transformers_model(lm.model)(torch.tensor([ids])).logits[0, -1]
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    # 4-bit: ladechat's kernels round the activations to int8 codes, transformers' dense product does not
    tolerance = 5e-2 if four_bit else 1e-4
    assert torch.allclose(ours, theirs, rtol=0, atol=tolerance * float(theirs.abs().max()))
    plain = answer(lm, ids, lookahead=False)
    assert answer(lm, ids, lookahead=True) == plain and len(plain) >= 8


# "mistral": transformers configures it but gguf-py names no tensors for it (llama.cpp writes Mistral's
# files as "llama"); "deepseek2": transformers has no config for it from a GGUF
@pytest.mark.parametrize("arch", ["mistral", "deepseek2"])
def test_a_family_that_cannot_be_built_is_one_line_naming_it(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    for key, value, kind, sub in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.add_tensor("token_embd.weight", np.zeros((49152, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match=rf"{arch}.gguf is a model of architecture '{arch}', which ladechat cannot "
                                        r"build from a GGUF \(it builds: .*llama.*qwen2"):
        load(LoadSpec(model=str(path), dtype="float32", device="cpu"))


@pytest.mark.parametrize("arch", sorted(CLASSES) + ["llama"])
def test_the_weights_map_is_transformers_own(arch, tmp_path):
    """files.weights_map (one name map, milliseconds) maps every tensor as transformers'
    get_gguf_hf_weights_map (a name map per module, seconds at 7B) does."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from ladechat.engine.load.gguf import files as gguf_files

    path = gguf_files.embedded_gguf() if arch == "llama" else write_family(arch, tmp_path / f"{arch}.gguf", False)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    file_arch = gguf_files.read(path).arch
    processor = gguf_files.tensor_processor(file_arch, model.config.to_dict())
    ours = gguf_files.weights_map(model, processor, file_arch)
    assert ours and ours == get_gguf_hf_weights_map(model, gguf_files.tensor_processor(file_arch, model.config.to_dict()))


@pytest.mark.parametrize("arch", sorted(CLASSES) + ["llama"])
def test_config_and_tokenizer_are_transformers_own_from_one_parse(arch, tmp_path, monkeypatch):
    """The prepared folder (config, generation config, tokenizer) is byte for byte what transformers
    writes when it parses the file for the config and again for the tokenizer; it parsed it once."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from ladechat.engine.load.gguf import files as gguf_files

    path = gguf_files.embedded_gguf() if arch == "llama" else write_family(arch, tmp_path / f"{arch}.gguf", False)
    parses = []
    original = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: parses.append(a) or original(*a, **k))
    gguf_files._prepare(path, tmp_path / "once")
    assert len(parses) <= 1
    monkeypatch.setattr(gguf_files, "_metadata_parsed_once", contextlib.nullcontext)  # transformers' own two parses
    gguf_files._prepare(path, tmp_path / "twice")
    once = {p.name: p.read_bytes() for p in (tmp_path / "once").iterdir() if p.name != "complete"}
    twice = {p.name: p.read_bytes() for p in (tmp_path / "twice").iterdir() if p.name != "complete"}
    assert "config.json" in once and "tokenizer.json" in once and once == twice


def test_a_gguf_whose_dense_tensors_do_not_fit_is_one_line_before_it_is_read(tmp_path, monkeypatch):
    """Tensors without a kernel for their blocks are read dense; where they would not fit in the
    memory available the load stops with one line naming them, before reading any (the OOM killer
    would end the process without a word)."""
    from ladechat.engine.load import memory
    from ladechat.engine.load.gguf import files as gguf_files

    path = write_family("qwen2", tmp_path / "big.gguf", False)
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)
    monkeypatch.setattr(gguf_files, "read_tensors", lambda *a, **k: pytest.fail("read before the check"))
    with pytest.raises(LoadError) as caught:
        load(LoadSpec(model=str(path), dtype="float32", device="cpu"))
    message = str(caught.value)
    assert message.startswith("not enough memory for big.gguf: its F32 tensors run dense here, ")
    assert message.endswith("MiB in float32, and 1 MiB is available") and "\n" not in message
