"""A Llama-family model's RMSNorm modules as one operator each, by ladechat's kernel (step_ops.cpp).

transformers' RMSNorm is ~8 small tensor ops; a step of the embedded model calls it 61 times, and
with a few rows of 576 that is a noticeable share of a step, all framework work. The kernel
computes the same steps in the same precision with the sum of squares in another (fixed) order:
in bf16 its results are nearly always the module's bits, in fp32 they differ in the last bit or
so. So it replaces the norms only where the weights are already not the checkpoint's own floats
(a GGUF's 4-bit blocks, load/gguf/quantized.py), never on the dense path, which must stay token-identical to
transformers' greedy decoding. A row's result does not depend on the step's other rows or the
thread count, so lookahead still computes what plain decoding does.

`NativeRMSNorm.add_norm` is the residual add before a norm fused into the same call; the Llama
steps (engine/models/llama.py) use it, and transformers' forward calls the module as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladechat.engine.kernels import step_ops

# transformers' RMSNorm classes whose forward is exactly the computation above (tests/kernels/test_norms.py
# reads their source); Gemma's (1 + weight) and others with a different formula are not here.
REPLACEABLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})


class TorchRMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the sum in fp32, in torch's ops: transformers'
    LlamaRMSNorm's steps, so its bits (engine/models/llama.py's norm where the kernel does not
    replace it)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class NativeRMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim, as the module it replaces,
    by ladechat's kernel (step_ops.load first). x fp32 or bf16 in the weight's dtype, on the CPU."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight  # the replaced module's own parameter: the state dict is unchanged
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladechat_step.rms_norm(x.contiguous(), self.weight, self.variance_epsilon)

    def add_norm(self) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """(x, delta) -> (x + delta, self(x + delta)) in one call, bitwise what the two give."""
        op, weight, eps = torch.ops.ladechat_step.add_rms_norm.default, self.weight.detach(), self.variance_epsilon
        return lambda x, delta: op(x, delta, weight, eps)

    def _apply(self, fn, recurse=True):  # a move or cast keeps the computation (the kernel is CPU-only)
        raise TypeError("ladechat's norms stay on the CPU; load with --weights dense to move or cast the model")

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, ladechat's kernel"


def replaceable(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    if type(module) is not TorchRMSNorm and type(module).__name__ not in REPLACEABLE:  # first: other modules'
        # `weight` may be computed
        return False  # at each read (an int4 layer's dense copy takes seconds)
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype == dtype
            and weight.device.type == "cpu" and hasattr(module, "variance_epsilon"))


def apply(model) -> int:
    """Replace `model`'s RMSNorm modules by NativeRMSNorm (the kernels loaded: step_ops.load);
    returns how many."""
    if not step_ops.loaded() or model.dtype not in (torch.float32, torch.bfloat16):
        return 0
    names = [name for name, module in model.named_modules() if replaceable(module, model.dtype)]
    for name in names:
        module = model.get_submodule(name)
        model.set_submodule(name, NativeRMSNorm(module.weight, float(module.variance_epsilon)))
    return len(names)


def add_norm(module: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(x, delta) -> (x + delta, module(x + delta)): the kernel's one call for a NativeRMSNorm,
    else the add and the module's own forward."""
    if type(module) is NativeRMSNorm:
        return module.add_norm()
    forward = module.forward

    def add_then_norm(x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, forward(x)

    return add_then_norm
