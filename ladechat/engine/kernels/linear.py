"""What every Linear module of a kernel's own weight layout shares: it replaces a model's
nn.Linear for inference only, fixed to the CPU; `.weight` (and a state dict) give W dense in fp32,
computed at each read, so code that reads a Linear's weight still works, slowly."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

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

    def join_key(self) -> tuple:
        """What modules must share to be multiplied in one call: the kernel and its path, the
        inputs, each buffer's form but its rows (the outputs), and whether there is a bias."""
        return (type(self), self.path, self.in_features, self.bias is None,
                tuple((b.dtype, tuple(b.shape[1:])) for b in self._buffers_in_order()))


# -- products that share their input -------------------------------------------------------------
#
# A decoder layer multiplies one row by q, k and v, and another by gate and up. Called apart, each
# product pays a call (the dispatcher, quantizing the row, starting the threads) and quantizes the
# same row again. A block kernel computes each output alone (the row quantized one way, one
# output's sums in one fixed order), so modules of one kernel stacked into one weight give each
# output the same bits in one call. Dense products (torch's, oneDNN's, the int4 kernel's) block
# their work by the weight's width, so theirs are not joined.

def side_by_side(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The parts stacked along their first dimension, without adding memory: a view where they lie
    one after another in one allocation (as a kept file is read), a copy where each part is its
    allocation's only tensor (freed once nothing points at it), else None."""
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.is_contiguous() for p in parts):
        return None
    if all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() + a.nbytes == b.data_ptr()
           for a, b in itertools.pairwise(parts)):
        return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())
    if all(p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.nbytes for p in parts):
        return torch.cat(list(parts))
    return None


def joint_product(modules: Sequence[torch.nn.Module], dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x (rows, in) -> every module's x W^T (+ b) side by side (rows, their outputs summed) in one
    call of their kernel, each output the bits of its module's own product; the modules' buffers
    become views of the joint ones. None (call them apart) unless they are two or more modules of
    one block kernel (BlockLinear.join_key) in a model of fp32 or bf16, whose buffers side_by_side
    can stack."""
    if len(modules) < 2 or dtype not in (torch.float32, torch.bfloat16) \
            or not all(isinstance(m, BlockLinear) for m in modules) or len({m.join_key() for m in modules}) != 1:
        return None
    first = modules[0]
    wholes = [side_by_side([getattr(m, name) for m in modules]) for name in first.BUFFERS]
    if any(whole is None for whole in wholes):
        return None
    for name, whole in zip(first.BUFFERS, wholes, strict=True):
        start = 0
        for module in modules:  # a copy's parts are freed here
            rows = getattr(module, name).shape[0]
            setattr(module, name, whole[start : start + rows])
            start += rows
    op, path = getattr(torch.ops.ladechat_blocks, first.OP).default, first.path
    if first.bias is None:
        return lambda x: op(x, *wholes, path)
    bias = torch.cat([m.bias for m in modules])  # each output's add as its module's own
    start = 0
    for module in modules:
        module.bias = torch.nn.Parameter(bias[start : start + module.out_features], requires_grad=False)
        start += module.out_features
    return lambda x: op(x, *wholes, path) + bias
