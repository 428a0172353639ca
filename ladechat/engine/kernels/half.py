"""A GGUF file's F16 and BF16 Linear weights at their own 16 bits, multiplied by ladechat's kernel
(blocks.cpp's half_mm, the library of the block kernels).

Dense, such a weight would be widened to the model's fp32 at load: twice the file's bytes in memory
and on every step. Here it stays as the file holds it and is widened as the kernel reads it, the
activations in fp32, each output's sum in one fixed order (16 partial sums, then added pairwise):
a row gives the same bits alone or among a step's rows, on one thread or two, on every path.
"""

from __future__ import annotations

import numpy as np
import torch

from ladechat.engine.kernels import q4
from ladechat.engine.kernels.linear import BlockLinear

OUT = q4.OUT  # outputs per tile
KINDS = {"F16": torch.float16, "BF16": torch.bfloat16}


class HalfError(ValueError):
    """A weight cannot run on the 16-bit kernel (the message says why, one line)."""


def check_shape(rows: int, cols: int) -> None:
    if rows % OUT or cols % q4.GROUP:
        raise HalfError(f"a {rows}x{cols} weight does not fit the 16-bit kernel (outputs a multiple of {OUT}, "
                        f"inputs of {q4.GROUP})")


def decode(kind: str, data: np.ndarray, rows: int, cols: int, order: np.ndarray | None = None) -> torch.Tensor:
    """A GGUF tensor's F16 or BF16 data (rows, cols, or its bytes (rows, 2 cols)) -> (rows, cols)
    in torch's fp16 or bf16, the same bits (one copy out of the file's mapping), row r from the
    data's row order[r] where an order is given."""
    if kind not in KINDS:
        raise HalfError(f"{kind} is not a 16-bit float type (only {', '.join(KINDS)})")
    halves = np.ascontiguousarray(data).view(np.uint16)
    if halves.shape != (rows, cols):
        raise HalfError(f"{kind} data of shape {data.shape} does not make {rows}x{cols} weights")
    return torch.from_numpy(halves.copy() if order is None else halves[order]).view(KINDS[kind])


class HalfLinear(BlockLinear):
    """y = x W^T + b with W in fp16 or bf16 as the file holds it, by ladechat's kernel (its library
    loaded: q4.load()), the rows in fp32; the result in x's dtype. Inference only, fixed to the CPU
    (linear.FixedLinear). path: the kernel's (q4.PATHS), default the best here."""

    OP, BUFFERS, WEIGHTS = "half_mm", ("halves",), "16-bit"

    def __init__(self, halves: torch.Tensor, bias: torch.Tensor | None = None, path: int | None = None):
        super().__init__()
        if halves.dim() != 2 or halves.dtype not in KINDS.values():
            raise HalfError(f"16-bit weights {halves.dtype} {tuple(halves.shape)} are not fp16 or bf16 (out, in)")
        self.out_features, self.in_features = halves.shape
        check_shape(self.out_features, self.in_features)
        self.kind = "F16" if halves.dtype == torch.float16 else "BF16"
        self.keep((halves.contiguous(),), bias, q4.best_path() if path is None else path)

    def dense_weight(self) -> torch.Tensor:
        return self.halves.float()  # exact

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind} weights, ladechat's {q4.PATHS[self.path]} kernel with fp32 activations")


BUFFERS = HalfLinear.BUFFERS
