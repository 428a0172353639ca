"""Grouped-query attention under an explicit mask, without copying keys and values per head.

Given a 4D mask, transformers' SDPA path repeats every key/value head once per query head of its
group (`repeat_kv`) before attending: a copy of the whole KV cache in every layer, every step that
has a mask, i.e. every lookahead step. On this CPU
the copy costs more than the attention itself once a few thousand tokens are cached (the embedded
model, 4 rows over 3k cached tokens: ~205 -> ~148 ms a step); on a GPU it reads every slot of a
static cache, free ones too.

Here the query heads that share a key/value head are stacked as extra rows instead, and the
step's mask (one for all heads) is tiled to match:

    query (B, H, S, D)        ->  (B, H_kv, g*S, D)   g = H / H_kv; row r*S + s holds query
                                                      head h_kv*g + r at token s
    mask  (B, 1, S, K)        ->  (B, 1, g*S, K)      the same S x K mask, g times over
    out   (B, H_kv, g*S, D)   ->  (B, H, S, D)

The same dot products and softmaxes, batched differently. SDPA's own `enable_gqa` would do the
same on a CPU, but with a mask it pushes CUDA onto the slow math kernel; the stacked form is plain
SDPA that every kernel taking a mask accepts.

A one-row step (plain decoding, HF `generate` included) has no mask, and transformers then asks
SDPA for `enable_gqa`, which on this CPU in bf16 costs ~5x the stacked form (embedded model, one
row over 1500 cached tokens: 25 ms against 5 ms of attention per step, summed over 30 layers;
the same in fp32). Such a row sees every key, so it is stacked too, without a mask.
Anything else (no groups, a prefill without a mask, attention sinks, position biases, training)
goes to transformers' SDPA function unchanged.

The function is registered with transformers' attention interface, its documented way of adding
an attention implementation; the model's code stays as it is.
"""

from __future__ import annotations

import torch

NAME = "ladechat_grouped_sdpa"
# Families whose attention the tests run it on. Some others compare the implementation's name with
# "sdpa" for special cases of their own (e.g. Gemma 4's shared KV layers), and keep plain SDPA.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma"})


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    one_row = attention_mask is None and rows == 1  # sees every key: no mask needed when stacked
    plain = (groups == 1 or dropout or module.training
             or not (one_row or (attention_mask is not None and attention_mask.ndim == 4
                                 and attention_mask.shape[1] == 1))
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    stacked = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = None if one_row else attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(batch, heads, rows, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model) -> bool:
    """Switch a model of a tested family from "sdpa" to grouped_sdpa when it has grouped-query
    attention. Returns whether it did (a model without key/value groups gains nothing from it)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = model.config.get_text_config()
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    if (model.config._attn_implementation != "sdpa" or not kv_heads or kv_heads == heads
            or model.config.model_type not in FAMILIES):
        return False
    # Registering the same function under the same name again is harmless (a dict entry).
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
