"""What every Linear module of a kernel's own weight layout shares: it replaces a model's
nn.Linear for inference only, fixed to the CPU; `.weight` (and a state dict) give W dense in fp32,
computed at each read, so code that reads a Linear's weight still works, slowly."""

from __future__ import annotations

from collections.abc import Callable

import torch


class FixedLinear(torch.nn.Module):
    """A Linear module whose weight lives in a kernel's layout. Subclasses give dense_weight();
    WEIGHTS names them in the refusal to move or cast the model."""

    WEIGHTS = "these"
    bias: torch.nn.Parameter | None

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def product(self, dtype: torch.dtype | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """x (rows, in) contiguous, in a model of `dtype` (None: fp32) -> x W^T (+ b) in x's dtype:
        what a step calls, hundreds of times; here the forward, where a subclass has nothing
        leaner."""
        return self.forward

    @property
    def weight(self) -> torch.Tensor:
        """W (out, in) in fp32: a dense copy per read."""
        return self.dense_weight()

    def keep_bias(self, bias: torch.Tensor | None) -> None:
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dense_weight()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn, recurse=True):
        raise TypeError(f"{self.WEIGHTS} weights stay on the CPU; load with --weights dense to move or cast the model")


class BlockLinear(FixedLinear):
    """y = x W^T + b by one of blocks.cpp's operators, OP(x, *BUFFERS, path), x's rows quantized to
    int8 per 32 inputs: fp32 and bf16 rows run as they are, others through fp32; the result is in
    x's dtype. `path`: the kernel's (q4.PATHS)."""

    OP = ""
    BUFFERS: tuple[str, ...] = ()
    path: int
    in_features: int
    out_features: int

    def keep(self, buffers: tuple[torch.Tensor, ...], bias: torch.Tensor | None, path: int) -> None:
        self.path = path
        for name, value in zip(self.BUFFERS, buffers, strict=True):
            self.register_buffer(name, value, persistent=False)
        self.keep_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):  # the kernels read these two
            rows = rows.float()
        y = getattr(torch.ops.ladechat_blocks, self.OP)(rows.contiguous(), *self._buffers_in_order(), self.path)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def product(self, dtype: torch.dtype | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """FixedLinear.product: for fp32 or bf16 rows the kernel called directly, without the
        forward's reshapes and casts (which do nothing to a step's rows, each contiguous)."""
        if dtype not in (None, torch.float32, torch.bfloat16):
            return self.forward
        op, buffers, path, bias = getattr(torch.ops.ladechat_blocks, self.OP).default, self._buffers_in_order(), \
            self.path, self.bias
        if bias is None:
            return lambda x: op(x, *buffers, path)
        return lambda x: op(x, *buffers, path) + bias

    def _buffers_in_order(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.BUFFERS)
