"""A GGUF file's Q8_0 output layer kept at 8 bits, multiplied by ladechat's own kernel
(blocks.cpp, the library of the 4-bit kernel too).

The output layer is the largest product of a small model's step: the embedded model's is
49152 x 576, 28 M weights, read whole on every step for every row's logits (lookahead reads them
all). The GGUF stores it (tied to the input embedding) as Q8_0 blocks, w = d * q with an int8
code q per weight and an fp16 scale d per 32 weights; dense it would be 57 MB a step in bf16,
113 MB in fp32 (the dtype of CPUs without native bf16), plus a packed copy of the tied embedding.
At 8 bits it is 30 MB, read once a step whatever its rows. torch has no kernel for blocks of 32
with their own scales (its int8 weight kernel takes one scale per output), so ladechat compiles
one (engine/kernels/native.py).

As for the 4-bit weights (q4.py), each row is quantized to int8 per 32 inputs and meets the codes
in integer dot products, as llama.cpp multiplies these blocks: a float kernel spent one
multiply-add per weight and row. The exact integer sums times the scales, in one fixed order: a
row gives the same bits alone or among a step's rows, on one thread or two, on every path of the
kernel. The codes and scales, in the kernel's layout, are kept in the GGUF's cache folder after
the first read (the GGUF's metadata takes seconds to read); the model's code is untouched, its
output module is replaced. Anything it cannot take (no Q8_0 output tensor, a shape the kernel
does not fit, no compiler, a CPU without AVX2) leaves the layer as it was, with a one-line notice
where that is a surprise.
"""

from __future__ import annotations

import numpy as np
import torch

from ladechat.engine.kernels import q4
from ladechat.engine.kernels.linear import BlockLinear

SOURCE = q4.SOURCE
GROUP = q4.GROUP  # weights per scale
OUT = q4.OUT  # outputs per tile: the 4-bit kernel's, the same library
BLOCK_BYTES = 2 + GROUP  # fp16 scale, 32 int8 codes


class Q8Error(ValueError):
    """The output layer cannot run on the Q8_0 kernel (the message says why, one line)."""


def decode(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks (rows, bytes per row) -> codes (rows, cols) int8 and scales (rows, cols / 32)
    float32, with w = scale * code the weight `gguf.dequantize` gives (exactly)."""
    if cols % GROUP or data.shape != (rows, cols // GROUP * BLOCK_BYTES):
        raise Q8Error(f"Q8_0 blocks of {data.shape[-1]} bytes a row do not make {rows}x{cols} weights")
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // GROUP, BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return codes, scales


def kernel_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) int8 and scales (N, K / 32), fp16 values as a Q8_0 block's d is -> the kernel's
    tiles (N / 16, K / 32, 512) int8 and scales (N / 16, K / 32, 16) fp16: the file's 34 bytes per
    32 weights (blocks.cpp draws the tile). Q8Error for scales that fp16 does not hold."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    half = scales.half()
    if not torch.equal(half.to(scales.dtype), scales):
        raise Q8Error("its scales are not fp16 values (a Q8_0 block's d is)")
    tiles, groups = rows // OUT, cols // GROUP
    # [tile, output j, group, 4 inputs c, i] -> [tile, group, c, j, i]
    grouped = codes.to(torch.int8).reshape(tiles, OUT, groups, 8, 4)
    packed = grouped.permute(0, 2, 3, 1, 4).reshape(tiles, groups, OUT * GROUP).contiguous()
    return packed, q4.per_tile(half, torch.float16)


def codes_of(tiles: torch.Tensor) -> torch.Tensor:
    """kernel_layout's tiles -> the codes (N, K) int8 again."""
    count, groups, _ = tiles.shape
    return tiles.reshape(count, groups, 8, OUT, 4).permute(0, 3, 1, 2, 4).reshape(count * OUT, groups * GROUP)


def check_shape(rows: int, cols: int) -> None:
    if rows % OUT or cols % GROUP:
        raise Q8Error(f"a {rows}x{cols} weight does not fit the Q8_0 kernel (outputs a multiple of {OUT}, "
                      f"inputs of {GROUP})")


class Q8Linear(BlockLinear):
    """y = x W^T + b with W as Q8_0 blocks, by ladechat's kernel (its library must be loaded:
    native.load(SOURCE, ...)), the rows quantized to int8 per 32 inputs; the result in x's dtype.
    Inference only, fixed to the CPU (linear.FixedLinear). path: the kernel's (q4.PATHS), default the
    best here."""

    OP, BUFFERS, WEIGHTS = "q8_mm", ("tiles", "scales"), "Q8_0"

    def __init__(self, tiles: torch.Tensor, scales: torch.Tensor, path: int | None = None,
                 bias: torch.Tensor | None = None):
        """tiles, scales: the kernel's layout, as kernel_layout makes it."""
        super().__init__()
        count, groups, size = tiles.shape
        self.out_features, self.in_features = count * OUT, groups * GROUP
        if tiles.dtype != torch.int8 or size != OUT * GROUP or scales.dtype != torch.float16 \
                or scales.shape != (count, groups, OUT):
            raise Q8Error(f"Q8_0 buffers {tiles.dtype} {tuple(tiles.shape)} and {scales.dtype} "
                          f"{tuple(scales.shape)} do not make one weight")
        self.kind = "Q8_0"
        self.keep((tiles, scales), bias, q4.best_path() if path is None else path)

    def dense_weight(self) -> torch.Tensor:
        """W (out, in) in fp32, exactly scale * code."""
        return codes_of(self.tiles).float() * q4.per_row(self.scales).float().repeat_interleave(GROUP, dim=1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"Q8_0 blocks, "
                f"ladechat's {q4.PATHS[self.path]} kernel with int8 activations")


def usable() -> bool:
    """Whether the kernel's library, once loaded, runs here fast: AVX2, FMA and F16C at least (its
    portable path is for tests and odd CPUs; the dense layer serves those better)."""
    return q4.best_path() >= 1


BUFFERS = Q8Linear.BUFFERS
