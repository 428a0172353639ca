"""A GGUF file's Q6_K weights kept at their own 6 bits, multiplied by ladechat's kernel (blocks.cpp,
the library of the 4-bit and Q8_0 kernels).

Q6_K is the type `llama-quantize` gives nearly every file's output layer and, in a Q4_K_M file,
half of the layers' ffn_down and attn_v. Per 256 weights along a row it stores a 6-bit code q, an
int8 scale sc per 16 weights and one fp16 d: w = d * sc * (q - 32) (exact in fp32: at most 23
significant bits). Dense in fp32 such a weight is ~4.9 times its blocks, read whole on every step;
here it stays ~0.83 bytes a weight (the file's 0.82).

The kernel quantizes each row to int8 per 32 inputs (as for the other blocks, q4.py) and sums each
half-group's codes exactly: per output and group, d * (sc_0 * (S_0 - 32 A_0) + sc_1 * (S_1 - 32 A_1))
with S_h the integer dot product of codes and activation codes over inputs 16 h .. 16 h + 15 and
A_h their activation codes' sum, then y = fma(that, da, y) group after group: the same fixed steps
on every path, so a row gives the same bits alone or among a step's rows, on any thread count.
"""

from __future__ import annotations

import numpy as np
import torch

from ladechat.engine.kernels import q4
from ladechat.engine.kernels.linear import BlockLinear

SOURCE = q4.SOURCE
GROUP = q4.GROUP  # inputs per activation scale, and per tile
OUT = q4.OUT  # outputs per tile
SUPER = 256  # weights per d (a Q6_K block)
BLOCK_BYTES = 210  # 128 low nibbles, 64 bytes of top bits, 16 int8 scales, an fp16 d
TILE_BYTES = q4.TILE_BYTES + OUT * GROUP // 4 + 2 * OUT  # nibbles, top bits, scales: 416


class Q6Error(ValueError):
    """A tensor's Q6_K blocks cannot run on the kernel (the message says why, one line)."""


def decode(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks (rows, bytes per row) -> codes (rows, cols) uint8 in 0..63, scales sc (rows,
    cols / 16) int8 and d (rows, cols / 256) float32, with w = d * sc * (code - 32) the weight
    `gguf.dequantize` gives (exactly)."""
    blocks = _blocks(data, rows, cols)
    n = blocks.shape[0]
    # a block's two halves of 128 weights: 64 bytes of nibbles (l and l + 32) and 32 bytes of top bits
    low = blocks[:, :128].reshape(n, 2, 2, 32)
    top = blocks[:, 128:192].reshape(n, 2, 1, 32)
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=2)  # weights 32 m + l, m = 0..3
    tops = (top >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    codes = (nibbles | (tops << 4)).reshape(rows, cols)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).reshape(rows, cols // 16)
    return codes, scales, d_of(data, rows, cols)


def d_of(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """decode()'s d alone (q4.gguf_tiles makes the tiles of the codes and scales)."""
    blocks = _blocks(data, rows, cols)
    return np.ascontiguousarray(blocks[:, 208:210]).view(np.float16).astype(np.float32).reshape(rows, cols // SUPER)


def _blocks(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    if cols % SUPER or data.shape != (rows, cols // SUPER * BLOCK_BYTES):
        raise Q6Error(f"Q6_K blocks of {data.shape[-1]} bytes a row do not make {rows}x{cols} weights")
    return np.asarray(data, dtype=np.uint8).reshape(rows * (cols // SUPER), BLOCK_BYTES)


def check_shape(rows: int, cols: int) -> None:
    if rows % OUT or cols % SUPER:
        raise Q6Error(f"a {rows}x{cols} weight does not fit the Q6_K kernel (outputs a multiple of {OUT}, "
                      f"inputs of {SUPER})")


def layout(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) in 0..63, scales (N, K / 16) int8, d (N, K / 256), fp16 values as a Q6_K
    block's d is -> the kernel's tiles (N / 16, K / 32, 416) uint8 and d (N / 16, K / 256, 16) fp16
    (blocks.cpp draws the tile). Q6Error for a d that fp16 does not hold."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    fp16_d(d.numpy())
    tiles, groups = rows // OUT, cols // GROUP
    codes = codes.to(torch.uint8)
    nibbles = q4.tiles_of(codes & 0x0F)
    # [tile, j, group, v, p, i] -> byte 64 v + 4 j + i, bits 2 p: the top 2 bits of input 4 (4 v + p) + i
    top = (codes >> 4).reshape(tiles, OUT, groups, 2, 4, 4)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 1, 1, 4, 1)
    packed = (top << shifts).sum(4, dtype=torch.uint8).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 128)
    sc = scales.to(torch.int8).view(torch.uint8).reshape(tiles, OUT, groups, 2).permute(0, 2, 3, 1)
    whole = torch.cat([nibbles, packed, sc.reshape(tiles, groups, 2 * OUT)], dim=2).contiguous()
    return whole, q4.per_tile(d, torch.float16)


def fp16_d(d: np.ndarray) -> np.ndarray:
    """d as fp16, the kept form's, which holds a Q6_K block's d exactly: Q6Error for values it
    does not hold (they would change the weights)."""
    half = d.astype(np.float16)
    if not np.array_equal(half.astype(d.dtype), d):
        raise Q6Error("its d are not fp16 values (a Q6_K block's d is)")
    return half


def parts_of(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layout's tiles -> codes (N, K) uint8 and scales (N, K / 16) int8 again."""
    count, groups, _ = tiles.shape
    low = q4.codes_of(tiles[..., : q4.TILE_BYTES].contiguous())
    packed = tiles[..., q4.TILE_BYTES : q4.TILE_BYTES + 128].reshape(count, groups, 2, OUT, 4)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 1, 4, 1, 1)
    top = (packed.unsqueeze(3) >> shifts) & 3  # [tile, group, v, p, j, i]
    top = top.permute(0, 4, 1, 2, 3, 5).reshape(count * OUT, groups * GROUP)
    sc = tiles[..., -2 * OUT:].reshape(count, groups, 2, OUT).permute(0, 3, 1, 2).reshape(count * OUT, groups * 2)
    return low | (top << 4), sc.contiguous().view(torch.int8)


class Q6Linear(BlockLinear):
    """y = x W^T + b with W as Q6_K blocks, by ladechat's kernel (its library loaded: q4.load()),
    the rows quantized to int8 per 32 inputs; fp32 and bf16 rows run as they are, others through
    fp32; the result in x's dtype. Inference only, fixed to the CPU (linear.FixedLinear)."""

    OP, BUFFERS, WEIGHTS = "q6_mm", ("tiles", "d"), "Q6_K"

    def __init__(self, tiles: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                 path: int | None = None):
        """tiles, d: as layout() makes them; path: the kernel's (q4.PATHS), default the best here."""
        super().__init__()
        count, groups, size = tiles.shape
        self.out_features, self.in_features = count * OUT, groups * GROUP
        if tiles.dtype != torch.uint8 or size != TILE_BYTES or d.dtype != torch.float16 \
                or d.shape != (count, self.in_features // SUPER, OUT) or self.in_features % SUPER:
            raise Q6Error(f"Q6_K buffers {tiles.dtype} {tuple(tiles.shape)} and {d.dtype} {tuple(d.shape)} "
                          "do not make one weight")
        self.kind = "Q6_K"
        self.keep((tiles, d), bias, q4.best_path() if path is None else path)

    def dense_weight(self) -> torch.Tensor:
        codes, sc = parts_of(self.tiles)
        d = q4.per_row(self.d).float().repeat_interleave(SUPER, 1)
        return d * sc.float().repeat_interleave(16, 1) * (codes.float() - 32)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"Q6_K blocks, ladechat's {q4.PATHS[self.path]} kernel with int8 activations")


BUFFERS = Q6Linear.BUFFERS
