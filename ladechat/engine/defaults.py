"""Default W, N, G per device type, chosen by measurement (see BENCHMARKS.md): a CPU's are
LookaheadConfig's own defaults, a GPU's follow from its step-cost curve."""

from __future__ import annotations

from ladechat.engine.config import LookaheadConfig

GPU_NGRAM = 5
GPU_MAX_BRANCH = 15  # the paper's W = G = 15 for 7B-70B models: acceptance gains flatten beyond
GPU_SLACK = 0.3  # "where cost starts rising steeply": the largest step within 1.3x a one-token step


def default_lookahead(device_type: str, step_cost: dict[int, float] | None = None) -> LookaheadConfig:
    """A GPU's from its step-cost curve; elsewhere LookaheadConfig's own defaults, measured on a CPU."""
    if device_type == "cuda":
        return gpu_lookahead(step_cost)
    return LookaheadConfig()


def gpu_lookahead(step_cost: dict[int, float] | None) -> LookaheadConfig:
    """W = G from the loaded model's measured step-cost curve: the window and the candidates split
    the largest step that costs at most 1.3x a one-token step (N = 5), capped at the paper's 15.
    Without a curve, the paper's 7B setting."""
    branch = GPU_MAX_BRANCH
    if step_cost:
        from ladechat.engine.step_cost import affordable_size  # torch: only once a model is loaded

        branch = min(GPU_MAX_BRANCH, max(1, affordable_size(step_cost, GPU_SLACK) // (2 * (GPU_NGRAM - 1))))
    return LookaheadConfig(window=branch, ngram=GPU_NGRAM, candidates=branch, context_candidates=4, context_len=10)


def compiles_by_default(device_type: str, quantized: bool, mapped: bool, weights: str) -> bool:
    """Whether the steps are compiled (--compile) when neither --compile nor --no-compile is given:
    on a CUDA GPU, for a model on one device with its own Linear modules. On a GPU the embedded
    model's eager steps are host-bound and compiled ones answer several times faster than HF
    greedy, for a compile at start-up once per process (measured: BENCHMARKS.md). bitsandbytes'
    layers and device maps are not what the fixed-shape step compiles."""
    return device_type == "cuda" and not quantized and not mapped and weights in ("auto", "dense")
