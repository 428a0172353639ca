"""Grouped-query attention under an explicit mask, without copying keys and values per head.

Given a 4D mask, transformers' SDPA path repeats every key/value head once per query head of its
group (`repeat_kv`) before attending: a copy of the whole KV cache in every layer, every step that
has a mask, i.e. every lookahead step. On a CPU
the copy costs more than the attention itself once a few thousand tokens are cached (measured:
BENCHMARKS.md); on a GPU it reads every slot of a static cache, free ones too.

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
SDPA for `enable_gqa`, which on a CPU costs several times the stacked form, in bf16 and fp32
(measured: BENCHMARKS.md). Such a row sees every key, so it is stacked too, without a mask.
Anything else (no groups, a prefill without a mask, attention sinks, position biases, training)
goes to transformers' SDPA function unchanged.

Where a row's answer must not depend on the step it is in (a GGUF's 4-bit weights, whose int8
or bf16 activations can turn SDPA's step-dependent last bits into another token near a tie), the
stacked rows go to ladechat's own attention instead (`attend` in step_ops.cpp: each row over its
visible keys in order, the same bits in a one-row step and in a lookahead step): ROWWISE, also
for models without key/value groups, prefills included (no mask: causal), so a token's row is
the same whichever way it was computed.

The functions are registered with transformers' attention interface, its documented way of adding
an attention implementation; the model's code stays as it is.
"""

from __future__ import annotations

import torch

NAME = "ladechat_grouped_sdpa"
ROWWISE = "ladechat_rowwise_attention"
HEAD_DIMS = (64, 128)  # what the row-wise kernel takes
# Families whose attention the tests run it on. Some others compare the implementation's name with
# "sdpa" for special cases of their own (e.g. Gemma 4's shared KV layers), and keep plain SDPA.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma"})


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    return _grouped(module, query, key, value, attention_mask, dropout, scaling, kwargs, rowwise=False)


def rowwise_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    return _grouped(module, query, key, value, attention_mask, dropout, scaling, kwargs, rowwise=True)


def sdpa_stacked(stacked, key, value, mask, scale, rows):
    """Grouped SDPA's attention of stacked rows (`rows` tokens; no mask: one row, every key)."""
    return torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scale)


def attend_stacked(stacked, key, value, mask, scale, rows):
    """ROWWISE's attention of stacked rows (`rows` tokens; no mask: causal) by the kernel's best
    path here (step_ops loaded)."""
    return torch.ops.ladechat_step.attend(stacked, key, value, mask, scale, rows, -1)


def _grouped(module, query, key, value, attention_mask, dropout, scaling, kwargs, rowwise: bool):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    one_row = attention_mask is None and rows == 1  # sees every key: no mask needed when stacked
    # transformers leaves the mask out where SDPA's is_causal will do: one row, or a prefill of an
    # empty cache (keys = rows; a static cache's longer key length keeps SDPA, aligned as it aligns)
    causal = (attention_mask is None and rowwise and (rows == 1 or key.shape[2] == rows)
              and kwargs.get("is_causal", True) is not False)
    plain = ((groups == 1 and not rowwise) or dropout or module.training or (rowwise and batch != 1)
             or not (one_row or causal or (attention_mask is not None and attention_mask.ndim == 4
                                           and attention_mask.shape[1] == 1))
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    stacked = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)
    if scaling is None and rowwise:  # SDPA's own default (SDPA itself is given None, as before)
        scaling = dim**-0.5
    out = (attend_stacked if rowwise else sdpa_stacked)(stacked, key, value, mask, scaling, rows)
    out = out.reshape(batch, heads, rows, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model, rowwise: bool = False) -> bool:
    """Switch a model of a tested family from "sdpa" to grouped_sdpa when it has grouped-query
    attention, or (rowwise, where rowwise_supported) to rowwise_attention. Returns whether it did
    (a model without key/value groups gains nothing from grouped SDPA)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = model.config.get_text_config()
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    rowwise = rowwise and rowwise_supported(model)
    if (model.config._attn_implementation != "sdpa" or model.config.model_type not in FAMILIES
            or not rowwise and (not kv_heads or kv_heads == heads)):
        return False
    name, function = (ROWWISE, rowwise_attention) if rowwise else (NAME, grouped_sdpa)
    # Registering the same function under the same name again is harmless (a dict entry).
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return True


def rowwise_supported(model) -> bool:
    """Whether ROWWISE runs this model: on the CPU with step_ops' kernels loaded (AVX2 at least:
    the portable loops are far slower than SDPA), fp32 or bf16, a head dim the kernel takes."""
    from ladechat.engine.kernels import step_ops

    config = model.config.get_text_config()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16) and dim in HEAD_DIMS
            and step_ops.loaded() and int(torch.ops.ladechat_step.attend_best_path()) >= 1)
