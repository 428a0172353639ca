"""A GGUF file's 4-bit and 5-bit Linear weights multiplied by ladechat's own kernel (blocks.cpp), with
the activations quantized to int8 per 32 inputs, as llama.cpp multiplies these blocks.

load/gguf/quantized.py reads the blocks (Q4_0, Q4_1, Q4_K, and Q5_0, Q5_1, Q5_K: w = scale * q + low per
32 weights, q in 0..15 or 0..31) and keeps them in this kernel's layout; this module makes the
layout and the Linear module that runs it. A 5-bit code is a 4-bit one and a top bit kept in a
plane of its own beside the tile, so a step streams the file's 5.5 bits a weight, not a byte. A step reads
every weight once, so the bytes it streams set its floor: the scales and lows are kept as the file
keeps them, Q4_0's fp16 d alone (the kernel makes the low, -8 d; 0.5625 bytes a weight with the
codes), Q4_1's fp16 scale and low (0.625), Q4_K's 6-bit integers per 32 weights, packed, with an
fp16 d and dmin per 256 (0.5625), the kernel widening them as it reads (exactly: the same fp32
values, so the same products, as the fp32 form that any scales can take, 0.75 bytes a weight).

Why not torch's int4 kernel (int4.Int4Linear, still the path where no compiler builds this one):
it widens the codes to floats for every 4 rows of a step and multiplies in fp32, so each extra
row of a lookahead step cost nearly what the first did; here the codes meet int8 activations in
integer dot products, four multiply-adds per instruction (measured: BENCHMARKS.md,
scripts/kernel_bench.py).

What it changes: the activations' int8 codes carry ~1/254 of each 32-input group's largest value
as their rounding, where torch's kernel rounded them to bf16 (8 bits of mantissa): an error of the
same order (tests/kernels/test_q4.py bounds it), and the one llama.cpp's users run. What it keeps: every
row is computed alone in a fixed order, so a row gives the same bits in any step, on any thread
count, and on the kernel's three paths (AVX-512 VNNI, AVX2, portable C++).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.kernels import native
from ladechat.engine.kernels.linear import BlockLinear

SOURCE = Path(__file__).with_name("blocks.cpp")  # also Q8_0's kernel (q8.py): one library
GROUP = 32  # inputs per scale and low
SUPER = 8  # groups per d and dmin in the Q4_K form (256 inputs)
OUT = 16  # outputs per tile
TILE_BYTES = OUT * GROUP // 2
FIVE_BIT_TILE_BYTES = TILE_BYTES + OUT * GROUP // 8  # the nibbles, then a plane of the codes' top bits
PATHS = {0: "portable", 1: "AVX2", 2: "AVX-512 VNNI"}
KINDS = ("Q4_0", "Q4_1", "Q4_K")  # GGUF block types with an exact 4-bit form
# ... and with a 5-bit one: w = scale * q + low, q in 0..31 (this library only: torch has no kernel)
FIVE_BIT_KINDS = ("Q5_0", "Q5_1", "Q5_K")
K_FORMS = ("Q4_K", "Q5_K")  # 6-bit sc and m per 32 weights, d and dmin per 256
K_SCALE_BYTES = OUT + 8  # a group's share of its sc and m in the Q4_K form (pack_k)


class Q4Error(ValueError):
    """A tensor's blocks are not what their type says (the message says why, one line)."""


def load(kernels: Path, progress: Callable[[str], AbstractContextManager] | None = None,
         compiler: str = native.COMPILER) -> str | None:
    """Load the kernel (compiled into `kernels` if not yet): None, or why it cannot run (one line)."""
    return native.why_not_loaded(SOURCE, kernels, compiler, progress)


def loaded() -> bool:
    return native.loaded(SOURCE)


def best_path() -> int:
    """The fastest of the kernel's paths this CPU runs (its library loaded)."""
    return int(torch.ops.ladechat_blocks.best_path())


def check_shape(rows: int, cols: int) -> None:
    if rows % OUT or cols % GROUP:
        raise Q4Error(f"a {rows}x{cols} weight does not fit the 4-bit kernel (output features a multiple of "
                         f"{OUT}, input features of {GROUP})")


def layout(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
           five_bit: bool = False) -> tuple[torch.Tensor, ...]:
    """codes (N, K) uint8 in 0..15 (five_bit: 0..31), scales and lows (N, K / 32) -> the kernel's
    tiles (N / 16, K / 32, 256; five_bit: 320) uint8 and scales, lows (N / 16, K / 32, 16), fp16
    where both are fp16 (the compact form), else fp32 (blocks.cpp draws the tile)."""
    return tiles_of(codes, five_bit), *layout_scales(scales, lows)


def layout_scales(scales: torch.Tensor, lows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layout()'s scales and lows."""
    half = scales.dtype == torch.float16 and lows.dtype == torch.float16
    dtype = torch.float16 if half else torch.float32
    return per_tile(scales, dtype), per_tile(lows, dtype)


def layout_k(codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
             dmin: torch.Tensor, five_bit: bool = False) -> tuple[torch.Tensor, ...]:
    """Q4_K's and Q5_K's own form: codes (N, K) in 0..15 (0..31), sc and m (N, K / 32) integers in 0..63, d and dmin
    (N, K / 256) fp16 values (w = d sc q - dmin m per 32 weights) -> tiles, scales (N / 16, K / 32, 24)
    uint8 and lows (N / 16, K / 256, 32) fp16 (pack_k)."""
    rows, cols = codes.shape
    if cols % (GROUP * SUPER):
        raise ValueError(f"a {rows}x{cols} weight does not fit the Q4_K form (input features a multiple of "
                         f"{GROUP * SUPER})")
    return tiles_of(codes, five_bit), *layout_k_scales(sc, m, d, dmin)


def layout_k_scales(sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """layout_k()'s scales and lows."""
    parts = (per_tile(sc, torch.uint8), per_tile(m, torch.uint8), per_tile(d), per_tile(dmin))
    return tuple(torch.from_numpy(part) for part in pack_k(*(part.numpy() for part in parts)))


D_FACTORS = {"Q4_0": -8, "Q5_0": -16}  # low = factor * d: the kinds kept as their d alone (d_form)


def layout_d(codes: torch.Tensor, d: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """Q4_0's and Q5_0's own form: codes (N, K) in 0..15 (Q5_0: 0..31), d (N, K / 32) fp16 values ->
    tiles, scales (N / 16, K / 32, 16) fp16 and lows (N / 16, 1, 1) int8 (d_form)."""
    scales, lows = d_form(per_tile(d).numpy(), kind)
    return tiles_of(codes, kind in FIVE_BIT_KINDS), torch.from_numpy(scales), torch.from_numpy(lows)


def d_form(d: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0's or Q5_0's d per tile (per_tile's layout, (T, G, 16), fp16 values) -> the kernel's d
    form, the file's bytes: scales fp16 (T, G, 16) and lows int8 (T, 1, 1), the factor (D_FACTORS)
    the kernel multiplies d by for the low, exactly. ValueError where d is not an fp16 value."""
    scales = _as_fp16(d, "the d form holds d as fp16")
    return np.ascontiguousarray(scales), np.full((d.shape[0], 1, 1), D_FACTORS[kind], dtype=np.int8)


def _as_fp16(values: np.ndarray, why: str) -> np.ndarray:
    """`values` as fp16, which must hold them exactly (a form that rounded them would change the
    weights): ValueError saying `why` otherwise."""
    half = values.astype(np.float16)
    if not np.array_equal(half.astype(values.dtype), values):
        raise ValueError(f"{why}: these are not fp16 values")
    return half


def pack_k(sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's parts per tile (per_tile's layout): sc and m (T, G, 16) integers in 0..63, d and dmin
    (T, G / 8, 16) fp16 values -> the Q4_K form blocks.cpp reads (its KForm), the file's 12 bytes of
    sc and m and 4 of d and dmin per 256 weights: scales (T, G, 24) uint8, per 8 groups a record of
    192 bytes for the values v = sc of the 8 groups' 16 outputs, then m likewise: bytes 0..127 the
    low 4 bits of v (low nibble) and of 128 + v (high nibble), bytes 128..191 bits 2 s of byte b the
    top 2 bits of value 64 s + b; lows (T, G / 8, 32) fp16, d then -dmin. ValueError where d or dmin
    is not an fp16 value (the form would change the weights)."""
    tiles, groups, _ = sc.shape
    values = np.concatenate([sc.reshape(tiles, groups // SUPER, -1), m.reshape(tiles, groups // SUPER, -1)],
                            axis=-1).astype(np.uint8)  # (T, G / 8, 256)
    if values.max(initial=0) > 63:
        raise ValueError("Q4_K's sc and m are 6-bit integers")
    half = values.shape[-1] // 2
    low = (values[..., :half] & 0x0F) | ((values[..., half:] & 0x0F) << 4)
    tops = (values >> 4).reshape(tiles, groups // SUPER, 4, -1)
    plane = tops[:, :, 0] | (tops[:, :, 1] << 2) | (tops[:, :, 2] << 4) | (tops[:, :, 3] << 6)
    scales = np.concatenate([low, plane], axis=-1).reshape(tiles, groups, K_SCALE_BYTES)
    lows = _as_fp16(np.concatenate([d, -dmin], axis=-1), "the Q4_K form holds d and dmin as fp16")
    return np.ascontiguousarray(scales), np.ascontiguousarray(lows)


def unpack_k(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_k's scales -> sc and m (T, G, 16) uint8 again."""
    tiles, groups, _ = scales.shape
    record = scales.reshape(tiles, groups // SUPER, SUPER * K_SCALE_BYTES)
    low, plane = record[..., :SUPER * OUT], record[..., SUPER * OUT:]
    tops = torch.stack([(plane >> (2 * s)) & 3 for s in range(4)], dim=2).reshape(tiles, groups // SUPER, -1)
    values = torch.cat([low & 0x0F, low >> 4], dim=-1) | (tops << 4)
    half = values.shape[-1] // 2
    return values[..., :half].reshape(tiles, groups, OUT), values[..., half:].reshape(tiles, groups, OUT)


def tiles_of(codes: torch.Tensor, five_bit: bool = False) -> torch.Tensor:
    """codes (N, K) uint8 in 0..15 -> the kernel's tiles (N / 16, K / 32, 256) uint8; five_bit:
    codes in 0..31 -> (N / 16, K / 32, 320), the low 4 bits so, then the plane of top bits (byte
    8 c + b, bit t: input 4 c + i of output j, 4 j + i = 8 b + t)."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    tiles, groups = rows // OUT, cols // GROUP
    # [tile, output j, group, 4 inputs c, i]: c < 4 the low nibbles, c >= 4 the high ones
    q = codes.to(torch.uint8).reshape(tiles, OUT, groups, 8, 4)
    low = q & 0x0F
    packed = (low[:, :, :, :4] | (low[:, :, :, 4:] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, p, j, i]
    nibbles = packed.reshape(tiles, groups, TILE_BYTES)
    if not five_bit:
        return nibbles.contiguous()
    top = (q >> 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8, 8, 8)  # [tile, group, c, b, t]
    plane = (top << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([nibbles, plane.reshape(tiles, groups, 64)], dim=2).contiguous()


def per_tile(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row values (N, G) -> the kernels' (N / 16, G, 16) in `dtype` (q6's d and q8's scales too)."""
    rows, groups = values.shape
    return values.to(dtype).reshape(rows // OUT, OUT, groups).transpose(1, 2).contiguous()


def form(scales: torch.Tensor, lows: torch.Tensor) -> str:
    """Which of the kernel's forms the buffers are: 'fp32', 'fp16', 'fp16 d' or 'Q4_K' (ValueError if none)."""
    count, groups = scales.shape[:2]
    if scales.dtype == torch.uint8 and lows.dtype == torch.float16 and scales.shape == (count, groups, K_SCALE_BYTES) \
            and groups % SUPER == 0 and lows.shape == (count, groups // SUPER, 2 * OUT):
        return "Q4_K"
    if scales.dtype == torch.float16 and lows.dtype == torch.int8 and scales.shape == (count, groups, OUT) \
            and lows.shape == (count, 1, 1):
        return "fp16 d"
    if scales.dtype == lows.dtype and scales.dtype in (torch.float32, torch.float16) \
            and scales.shape == lows.shape == (count, groups, OUT):
        return "fp32" if scales.dtype == torch.float32 else "fp16"
    raise ValueError(f"4-bit scales {scales.dtype} {tuple(scales.shape)} and lows {lows.dtype} {tuple(lows.shape)} "
                     "are none of the kernel's forms")


def expand(scales: torch.Tensor, lows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any form's buffers -> the fp32 form's scales and lows (N / 16, K / 32, 16), the values the
    kernel computes with."""
    kind = form(scales, lows)
    if kind == "fp16 d":
        return scales.float(), scales.float() * lows.float()  # exact: d times -8 or -16
    if kind not in K_FORMS:
        return scales.float(), lows.float()
    supers = lows.float().repeat_interleave(SUPER, dim=1)  # (count, groups, 32): d, -dmin per group
    sc, m = unpack_k(scales)
    return supers[..., :OUT] * sc.float(), supers[..., OUT:] * m.float()


def codes_of(tiles: torch.Tensor) -> torch.Tensor:
    """layout's tiles (4-bit or 5-bit) -> the codes (N, K) uint8 again."""
    count, groups, size = tiles.shape
    packed = tiles[..., :TILE_BYTES].reshape(count, groups, 4, OUT, 4).permute(0, 3, 1, 2, 4)  # [tile, j, group, p, i]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=3)  # [tile, j, group, c, i]
    if size == FIVE_BIT_TILE_BYTES:
        plane = tiles[..., TILE_BYTES:].reshape(count, groups, 8, 8, 1)  # [tile, group, c, b, t]
        bits = (plane >> torch.arange(8, dtype=torch.uint8)) & 1
        q = q | (bits.reshape(count, groups, 8, OUT, 4).permute(0, 3, 1, 2, 4) << 4)
    return q.reshape(count * OUT, groups * GROUP)


def per_row(values: torch.Tensor) -> torch.Tensor:
    """per_tile's values -> (N, K / 32) again."""
    count, groups, _ = values.shape
    return values.transpose(1, 2).reshape(count * OUT, groups)


# -- a GGUF's Q4 blocks -------------------------------------------------------------------------------

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float64: (rows, blocks, 1)."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16).astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., 16) of a 32-weight group: weights 0-15 in the low nibbles, 16-31 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit (5-bit) form of a GGUF tensor's blocks: codes q (rows, cols) uint8 in 0..15
    (0..31), and per group of 32 weights along a row the scale and low (rows, cols / 32) float32,
    such that w = scale * q + low is the weight `gguf.dequantize` gives (the scales and lows
    exactly: fp16 values, or for Q4_K and Q5_K an fp16 times a 6-bit integer). `data` is the
    tensor's bytes, (rows, bytes per row)."""
    q, *parts = decode_compact(kind, data, rows, cols)
    if kind not in K_FORMS:
        return q, parts[0].astype(np.float32), parts[1].astype(np.float32)
    sc, m, d, dmin = parts
    d, dmin = np.repeat(d, SUPER, axis=1), np.repeat(dmin, SUPER, axis=1)
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)  # exact: fp16 times an integer < 64


def decode_compact(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """A GGUF tensor's blocks in the precision the file holds them, for q4.layout / q4.layout_k:
    Q4_0, Q4_1, Q5_0 and Q5_1: (q, scale, low), the scale and low (rows, cols / 32) fp16 (fp32 where
    Q4_0's -8 d or Q5_0's -16 d leaves fp16's range); Q4_K and Q5_K: (q, sc, m, d, dmin), sc and m
    (rows, cols / 32) uint8, d and dmin (rows, cols / 256) fp32; q as decode()'s."""
    blocks = _blocks(kind, data, rows, cols)
    if kind in K_FORMS:
        # 4 chunks of 32 bytes: the low nibbles are sub-block 2j, the high ones 2j + 1
        qs = blocks[..., 16 if kind == "Q4_K" else 48:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":  # bit 4 of sub-block s's weight l: bit s of qh's byte l
            qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
        q = q.reshape(rows, cols)
    else:
        at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
        q = _nibbles(blocks[..., at:at + 16])
        if kind in FIVE_BIT_KINDS:  # qh: a little-endian uint32 before the nibbles, bit k for weight k
            qh = np.ascontiguousarray(blocks[..., at - 4:at]).view(np.uint32)
            q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        q = q.reshape(rows, cols)
    return q, *compact_scales(kind, data, rows, cols)


def compact_scales(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """decode_compact's parts but the codes: what q4.layout / q4.layout_k take beside the tiles
    (gguf_tiles makes those from the blocks)."""
    from gguf.quants import Q4_K

    blocks = _blocks(kind, data, rows, cols)
    if kind in ("Q4_0", "Q5_0"):  # w = d (q - 8), d (q - 16)
        d = _f16(blocks, 0).reshape(rows, cols // GROUP)
        low = D_FACTORS[kind] * d
        dtype = np.float16 if (np.abs(low) <= np.finfo(np.float16).max).all() else np.float32  # else past fp16's range
        return d.astype(dtype), low.astype(dtype)
    if kind in ("Q4_1", "Q5_1"):
        return tuple(_f16(blocks, at).reshape(rows, cols // GROUP).astype(np.float16) for at in (0, 2))
    d, dmin = _f16(blocks, 0).reshape(rows, -1), _f16(blocks, 2).reshape(rows, -1)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    return (sc.reshape(rows, -1).astype(np.uint8), m.reshape(rows, -1).astype(np.uint8),
            d.astype(np.float32), dmin.astype(np.float32))


def _blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A tensor's bytes (rows, bytes a row) as (rows, blocks, bytes a block); Q4Error where they do
    not make a rows x cols weight of `kind`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind not in (*KINDS, *FIVE_BIT_KINDS):
        raise Q4Error(f"{kind} has no exact 4-bit or 5-bit form (only {', '.join(KINDS + FIVE_BIT_KINDS)})")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if cols % block or data.shape != (rows, cols // block * size):
        raise Q4Error(f"{kind} blocks of {data.shape[-1]} bytes a row do not make {rows}x{cols} weights")
    return np.asarray(data, dtype=np.uint8).reshape(rows, cols // block, size)


TILED_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "Q6_K": 3, "Q5_0": 4, "Q5_1": 5, "Q5_K": 6}  # blocks.cpp's gguf_tiles


def gguf_tiles(kind: str, data: np.ndarray, rows: int, cols: int, order: np.ndarray | None = None,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's tiles of a tensor's blocks (rows, bytes a row) of a TILED_KINDS kind, by the
    library's gguf_tiles (loaded: load()): layout()'s / q6.layout()'s tiles, without the codes;
    row r from the blocks' row order[r] where an order is given; written into `into` (uint8, the
    tiles' size) where given."""
    import warnings

    with warnings.catch_warnings():  # the file's mapped pages are read-only, and gguf_tiles only reads them
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
    rows_from = None if order is None else torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
    return torch.ops.ladechat_blocks.gguf_tiles(blocks, TILED_KINDS[kind], rows, cols, rows_from, into)


class Q4Linear(BlockLinear):
    """y = x W^T + b with W as 4-bit (or 5-bit) codes and a scale and low per 32 weights (in one of the
    kernel's forms), by ladechat's kernel (its library loaded: load()), the rows quantized to int8
    per 32 inputs. fp32 and bf16 rows run as they are, others through fp32; the result is in x's
    dtype. Inference only, fixed to the CPU (linear.FixedLinear)."""

    OP, BUFFERS, WEIGHTS = "q4_mm", ("tiles", "scales", "lows"), "4-bit"

    def __init__(self, tiles: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
                 bias: torch.Tensor | None = None, kind: str = "Q4", path: int | None = None):
        """tiles, scales, lows: as layout() or layout_k() makes them; path: the kernel's (PATHS),
        default the best here."""
        super().__init__()
        count, groups, size = tiles.shape
        self.out_features, self.in_features = count * OUT, groups * GROUP
        if tiles.dtype != torch.uint8 or size not in (TILE_BYTES, FIVE_BIT_TILE_BYTES) or scales.shape[:2] != (count, groups):
            raise ValueError(f"4-bit buffers {tiles.dtype} {tuple(tiles.shape)}, {scales.dtype} {tuple(scales.shape)} "
                             f"and {lows.dtype} {tuple(lows.shape)} do not make one weight")
        self.form = form(scales, lows)
        if self.form == "fp16 d" and not bool((lows == (-16 if size == FIVE_BIT_TILE_BYTES else -8)).all()):
            raise ValueError("the d form's factors must be -8 (4-bit tiles) or -16 (5-bit tiles)")
        self.kind = kind
        self.keep((tiles, scales, lows), bias, best_path() if path is None else path)

    def dense_weight(self) -> torch.Tensor:
        q = codes_of(self.tiles).float()
        scales, lows = expand(self.scales, self.lows)
        return q * per_row(scales).repeat_interleave(GROUP, 1) + per_row(lows).repeat_interleave(GROUP, 1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind} blocks ({self.form} scales), ladechat's {PATHS[self.path]} kernel with int8 activations")


BUFFERS = Q4Linear.BUFFERS
