"""Tiny randomly initialised decoder-only models of several families, built from configs."""

import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.15, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16, "use_sliding_window": False}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 16}),
}


def tiny_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**COMMON, **extra)
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_tokenizer(chat_template: str | None = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                               "{% endfor %}assistant:"):
    """One token per printable ASCII character plus <unk>, <s>, </s>: built in memory, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_loaded(context_length: int = 1024):
    """A LoadedModel of a tiny random Llama with tiny_tokenizer(), for the chat's tests."""
    from ladechat.engine.load.loading import LoadedModel

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", device=model.device, dtype=model.dtype,
                       eos_ids=frozenset(), context_length=context_length)


def endless_model_folder(path):
    """A tiny random Llama folder whose answers end only at max_new_tokens: no end-of-text token at
    all (neither its config nor its tokenizer names one) and a context of a million positions. A
    test that interrupts an answer asks for a long one of it, which then cannot end first."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = tiny_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>")
    tokenizer.chat_template = tiny_tokenizer().chat_template
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer), "num_hidden_layers": 1,
                            "max_position_embeddings": 1_000_000})
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
