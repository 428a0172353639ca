"""A GGUF tensor's blocks dequantized by torch, on whatever device holds the bytes.

gguf-py's `dequantize` runs in numpy on one CPU thread; reading a large file onto a GPU that way
spends most of the load on the host. Here the same arithmetic runs as torch operations where the
raw bytes are: on the GPU they cross the bus as blocks (a quarter of bf16's bytes for 4-bit types)
and dequantize there; on a CPU torch's operations use every thread. Each result has the same bits
as gguf-py's (tests/test_dequantize.py checks every type), because every step is one float32
multiply or add rounded on its own, in gguf-py's order: no operation here may fuse two of them.
"""

from __future__ import annotations

QK_K = 256  # weights in a K-quant super-block


def supported(kind: int) -> bool:
    """Whether `dequantize` handles this GGMLQuantizationType (the others: gguf-py's numpy)."""
    return int(kind) in _BLOCK_BYTES


def dequantize(raw, kind: int):
    """`raw`: a uint8 torch tensor (rows, bytes of a row) of GGML type `kind` -> float32 (rows,
    weights of a row) on the same device, bit for bit what gguf-py's dequantize gives."""
    import torch

    kind = int(kind)
    block_bytes, unpack = _BLOCK_BYTES[kind]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, block_bytes)
    if unpack is None:  # F32, F16, BF16: the bytes are the numbers
        dtype = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[kind]
        return blocks.contiguous().view(dtype).float().reshape(rows, -1)
    return unpack(blocks).reshape(rows, -1)


def _half(blocks, start: int):
    """The fp16 at byte `start` of each block, as float32 (n, 1)."""
    import torch

    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs, group: int):
    """(n, bytes) -> (n, 2 * bytes) codes: per `group` bytes, their low nibbles, then their high ones."""
    n = qs.shape[0]
    pairs = qs.reshape(n, -1, 1, group)
    both = (pairs >> _shifts(qs, (0, 4)).reshape(1, 1, 2, 1)) & 0x0F
    return both.reshape(n, -1)


def _bits(masks, count: int):
    """(n, count/8) bytes -> (n, count) bits, little-endian within each byte."""
    n = masks.shape[0]
    return ((masks.reshape(n, -1, 1) >> _shifts(masks, range(8)).reshape(1, 1, 8)) & 1).reshape(n, count)


def _shifts(like, amounts):
    import torch

    return torch.tensor(list(amounts), dtype=torch.uint8, device=like.device)


def _q4_0(b):
    return _half(b, 0) * (_nibbles(b[:, 2:18], 16).float() - 8)


def _q4_1(b):
    return _half(b, 0) * _nibbles(b[:, 4:20], 16).float() + _half(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22], 16) | (_bits(b[:, 2:6], 32) << 4)
    return _half(b, 0) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24], 16) | (_bits(b[:, 4:8], 32) << 4)
    return _half(b, 0) * q.float() + _half(b, 2)


def _q8_0(b):
    import torch

    return b[:, 2:34].contiguous().view(torch.int8).float() * _half(b, 0)


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _half(b, 80), _half(b, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(b, (0, 2, 4, 6)).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _half(b, 108)
    low = ((packed[:, :8].reshape(n, 1, 8) >> _shifts(b, (0, 4)).reshape(1, 2, 1)) & 0x0F).reshape(n, 16)
    high = ((packed[:, 8:].reshape(n, 1, 4) >> _shifts(b, (0, 2, 4, 6)).reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32
    dl = (d * scales).reshape(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts(b, (0, 2, 4, 6)).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, 1, 1, 32) >> _shifts(b, range(8)).reshape(1, 1, 8, 1)) & 1).reshape(n, 16, 16)
    q = ql.float() - ((qh ^ 1) << 2).float()  # a set bit means no offset
    return (dl * q).reshape(n, QK_K)


def _k_scales(b):
    """Q4_K's and Q5_K's 6-bit scales and mins (bytes 4-15) -> two float32 (n, 8, 1)."""
    import torch

    n = b.shape[0]
    packed = b[:, 4:16].reshape(n, 3, 4)
    d, m, md = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float().reshape(n, 8, 1), mins.float().reshape(n, 8, 1)


def _q4_k(b):
    n = b.shape[0]
    sc, mins = _k_scales(b)
    scale = _half(b, 0).reshape(n, 1, 1) * sc
    low = _half(b, 2).reshape(n, 1, 1) * mins
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32)
    return (scale * q.float() - low).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    sc, mins = _k_scales(b)
    scale = _half(b, 0).reshape(n, 1, 1) * sc
    low = _half(b, 2).reshape(n, 1, 1) * mins
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(b, range(8)).reshape(1, 8, 1)) & 1
    q = _nibbles(b[:, 48:176], 32).reshape(n, 8, 32) | (qh << 4)
    return (scale * q.float() - low).reshape(n, QK_K)


def _q6_k(b):
    import torch

    n = b.shape[0]
    ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    scale = (_half(b, 208) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = ((ql.reshape(n, 2, 1, 64) >> _shifts(b, (0, 4)).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> _shifts(b, (0, 2, 4, 6)).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).float() - 32
    return (scale * q.reshape(n, 16, 16)).reshape(n, QK_K)


# GGMLQuantizationType -> (bytes a block, its unpacking into float32); None: the bytes are numbers
_BLOCK_BYTES = {
    0: (4, None),  # F32
    1: (2, None),  # F16
    30: (2, None),  # BF16
    2: (18, _q4_0),
    3: (20, _q4_1),
    6: (22, _q5_0),
    7: (24, _q5_1),
    8: (34, _q8_0),
    10: (84, _q2_k),
    11: (110, _q3_k),
    12: (144, _q4_k),
    13: (176, _q5_k),
    14: (210, _q6_k),
}
