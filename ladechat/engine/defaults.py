"""Default W, N, G per device type, chosen by measurement (see BENCHMARKS.md)."""

from __future__ import annotations

from ladechat.engine.config import LookaheadConfig

GPU_NGRAM = 5
GPU_MAX_BRANCH = 15  # the paper's W = G = 15 for 7B-70B models: acceptance gains flatten beyond
GPU_SLACK = 0.3  # "where cost starts rising steeply": the largest step within 1.3x a one-token step


def default_lookahead(device_type: str, step_cost: dict[int, float] | None = None) -> LookaheadConfig:
    if device_type == "cuda":
        return gpu_lookahead(step_cost)
    # CPU (2-core EPYC, SmolLM2-135M, bf16, 9 real prompts x 128 tokens, paired with plain decoding):
    # W=5 N=4 G=5 1.13x, W=3 N=4 G=2 1.17x, W=4 N=3 G=2 1.19x, W=2 N=3 G=1 1.25x (compression 1.64),
    # context candidates alone 1.30x (compression 1.54). Small windows win: every extra row costs.
    # With the model's recycled top-k as a draft source (fp32, 2-core AVX2 EPYC, 9 prompts x 128
    # tokens, against plain decoding): without it 1.18x (compression 1.74), with 16 recycled nodes
    # 1.26-1.30x (compression 2.09-2.11); whether W is 1 or 2 made no measurable difference.
    return LookaheadConfig(window=2, ngram=3, candidates=1, context_candidates=2, context_len=12, recycle=16)


def gpu_lookahead(step_cost: dict[int, float] | None) -> LookaheadConfig:
    """W = G from the loaded model's measured step-cost curve: the window and the candidates split
    the largest step that costs at most 1.3x a one-token step (N = 5), capped at the paper's 15.
    Without a curve, the paper's 7B setting."""
    branch = GPU_MAX_BRANCH
    if step_cost:
        from ladechat.engine.step_cost import affordable_size  # torch: only once a model is loaded

        branch = min(GPU_MAX_BRANCH, max(1, affordable_size(step_cost, GPU_SLACK) // (2 * (GPU_NGRAM - 1))))
    return LookaheadConfig(window=branch, ngram=GPU_NGRAM, candidates=branch, context_candidates=4, context_len=10)
