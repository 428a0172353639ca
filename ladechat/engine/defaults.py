"""Default W, N, G per device type, chosen by measurement (see BENCHMARKS.md)."""

from __future__ import annotations

from ladechat.engine.config import LookaheadConfig


def default_lookahead(device_type: str) -> LookaheadConfig:
    if device_type == "cuda":
        # A GPU step of ~100 tokens costs about the same as one (memory-bound): the paper's
        # 7B settings.
        return LookaheadConfig(window=15, ngram=5, candidates=15, context_candidates=4, context_len=10)
    return LookaheadConfig()
