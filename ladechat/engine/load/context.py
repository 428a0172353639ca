"""The most tokens a conversation holds: --ctx, or the model's own context up to a cap."""

from __future__ import annotations

from ladechat.engine.load.spec import LoadError

DEFAULT_CONTEXT = 8192  # a 128k-context model's cache would otherwise grow until memory runs out


def context_cap(model_length: int, asked: int | None) -> int:
    """The tokens a conversation may hold: --ctx where given (no more than the model's own length),
    else the model's length up to DEFAULT_CONTEXT."""
    if asked is None:
        return min(model_length, DEFAULT_CONTEXT)
    if asked > model_length:
        raise LoadError(f"--ctx {asked} is more than the model's context of {model_length} tokens")
    return asked


def context_length(config) -> int:
    length = getattr(config, "max_position_embeddings", None) or 2048
    window = getattr(config, "sliding_window", None)
    # Our 4D mask is full attention for every layer, so a sliding-window model is exact only
    # while the whole conversation fits in its window.
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, window)
    return int(length)
