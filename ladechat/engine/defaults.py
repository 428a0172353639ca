"""Default W, N, G per device type, chosen by measurement (see BENCHMARKS.md)."""

from __future__ import annotations

from ladechat.engine.config import LookaheadConfig


def default_lookahead(device_type: str) -> LookaheadConfig:
    if device_type == "cuda":
        # A GPU step of ~100 tokens costs about the same as one (memory-bound), so the paper's
        # 7B settings; the step planner trims nothing on a flat cost curve. Not yet measured here.
        return LookaheadConfig(window=15, ngram=5, candidates=15, context_candidates=4, context_len=10)
    # CPU (2-core EPYC, SmolLM2-135M, bf16, 9 real prompts x 128 tokens, paired with plain decoding):
    # W=5 N=4 G=5 1.13x, W=3 N=4 G=2 1.17x, W=4 N=3 G=2 1.19x, W=2 N=3 G=1 1.25x (compression 1.64),
    # context candidates alone 1.30x (compression 1.54). Small windows win: every extra row costs.
    return LookaheadConfig(window=2, ngram=3, candidates=1, context_candidates=2, context_len=8)
