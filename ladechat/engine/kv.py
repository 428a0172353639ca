"""The KV cache across steps: keep what was accepted, drop the rest, never recompute."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    # Plain full-attention layers: lookahead passes its own 4D mask, so every layer sees the
    # same explicit mask and the cache must keep every position the mask can point at.
    return DynamicCache()


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: lookahead needs per-layer keys/values")
    return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def cache_length(cache) -> int:
    layers = _layers(cache)
    return layers[0].keys.shape[-2] if layers else 0


def truncate(cache, length: int) -> None:
    """Keep the first `length` positions of every layer (layers a broken step left longer, too)."""
    for layer in _layers(cache):
        if layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def commit_kv(cache, past: int, keep_rows: list[int]) -> None:
    """After a step of S rows appended at `past`, keep only `keep_rows` (ascending, row 0 first).

    Accepted rows are gathered down to past, past+1, ... so the cache again holds exactly the
    committed sequence. When the kept rows are already a prefix, this is a plain crop.
    """
    kept = len(keep_rows)
    if keep_rows == list(range(kept)):
        truncate(cache, past + kept)
        return
    with torch.inference_mode():  # the forward pass made these inference tensors
        for layer in _layers(cache):
            index = torch.tensor(keep_rows, device=layer.keys.device) + past
            for name in ("keys", "values"):
                states = getattr(layer, name)
                states[..., past : past + kept, :] = states.index_select(-2, index)
                setattr(layer, name, states[..., : past + kept, :])
