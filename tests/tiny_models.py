"""Tiny randomly initialised decoder-only models of several families, built from configs."""

import torch
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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
