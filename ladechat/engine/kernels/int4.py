"""torch's int4 CPU kernel for a GGUF's 4-bit blocks: the path where no C++ compiler builds
ladechat's own (q4.py). The same blocks are torch's int4 packed format with groups of 32
("tinygemm": w = (q - 8) * scale + zero, zero = low + 8 scale), packed once at load
(`_convert_weight_to_int4pack_for_cpu`) and multiplied by `_weight_int4pack_mm_for_cpu`, whose
scales and zeros are bf16 and whose vectorized path takes bf16 activations, so `Int4Linear` casts a
step's activations to bf16 at the product. Each row is computed on its own, in the same order
whatever the step's size.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import numpy as np
import torch

from ladechat.engine.kernels import q4
from ladechat.engine.kernels.linear import FixedLinear

GROUP = 32  # weights per scale and low
KERNEL = "_weight_int4pack_mm_for_cpu"


class Int4Error(ValueError):
    """A tensor's blocks cannot run on the int4 kernel (the message says why, one line)."""


def supported(device: torch.device, machine: str | None = None) -> bool:
    """Whether int4 weights run here: a CPU with torch's int4 kernel, measured on x86-64 (on
    other CPUs torch has other int4 paths, unmeasured here)."""
    machine = (machine or platform.machine()).lower()
    ops = torch.ops.aten
    return (device.type == "cpu" and machine in ("x86_64", "amd64")
            and hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(ops, KERNEL))


def pack_codes(q: np.ndarray) -> np.ndarray:
    """Codes (rows, cols) in 0..15 -> bytes (rows, cols / 2), even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """pack_codes undone, as the int32 (rows, cols) the kernel's packing takes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def check_shape(rows: int, cols: int) -> None:
    # the kernel works on blocks of 16 (or 32, 64) output features and groups of 32 inputs
    if rows % 16 or cols % GROUP:
        raise Int4Error(f"a {rows}x{cols} weight does not fit the int4 kernel (output features a multiple of 16, "
                        f"input features of {GROUP})")


# -- the module --------------------------------------------------------------------------------

class Int4Linear(FixedLinear):
    """y = x W^T + b with W as 4-bit codes and a bf16 scale and zero per 32 weights (w = (q - 8) *
    scale + zero), multiplied by
    torch's int4 CPU kernel with bf16 activations (the result is cast back to x's dtype). Inference
    only, fixed to the CPU (linear.FixedLinear)."""

    WEIGHTS = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None = None,
                 kind: str = "Q4"):
        """packed, scales_and_zeros: the kernel's buffers, as from_codes makes them."""
        super().__init__()
        groups, self.out_features, _ = scales_and_zeros.shape
        self.in_features = groups * GROUP
        check_shape(self.out_features, self.in_features)
        if packed.dtype != torch.uint8 or packed.numel() * 2 != self.out_features * self.in_features \
                or scales_and_zeros.dtype != torch.bfloat16 or scales_and_zeros.shape[-1] != 2:
            raise Int4Error(f"int4 buffers {packed.dtype} {tuple(packed.shape)} and {scales_and_zeros.dtype} "
                            f"{tuple(scales_and_zeros.shape)} do not make a {self.out_features}x{self.in_features} weight")
        self.kind = kind
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        self.keep_bias(bias)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
                   bias: torch.Tensor | None = None, kind: str = "Q4") -> Int4Linear:
        """codes: (out, in / 2) uint8 as pack_codes makes them; scales, lows: (out, in / 32), with
        w = scale * q + low."""
        rows, cols = codes.shape[0], codes.shape[1] * 2
        check_shape(rows, cols)
        if scales.shape != (rows, cols // GROUP) or lows.shape != scales.shape:
            raise Int4Error(f"scales {tuple(scales.shape)} and lows {tuple(lows.shape)} do not fit "
                            f"a {rows}x{cols} weight")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(codes.cpu()), 1)
        zeros = lows.double() + 8 * scales.double()  # exact in fp64, then one rounding to bf16
        # (in / 32, out, 2): the kernel's order
        groups = torch.stack([scales.t().double(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(packed, groups, bias, kind)

    @classmethod
    def from_kernel_layout(cls, tiles: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
                           bias: torch.Tensor | None = None, kind: str = "Q4") -> Int4Linear:
        """The same blocks from ladechat's kernel's buffers (q4.layout's, q4.layout_d's or q4.layout_k's)."""
        codes = torch.from_numpy(pack_codes(q4.codes_of(tiles).numpy()))
        return cls.from_codes(codes, *map(q4.per_row, q4.expand(scales, lows)), bias, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, GROUP, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def product(self, dtype: torch.dtype | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """FixedLinear.product: in a bf16 model without a bias, the kernel called directly (~400
        calls a step fewer); else the rows cast to bf16 and the result back."""
        packed, scales, bias = self.packed_weight, self.scales_and_zeros, self.bias
        mm = getattr(torch.ops.aten, KERNEL)
        if dtype == torch.bfloat16 and bias is None:
            return lambda x: mm(x, packed, GROUP, scales)

        def int4_product(x: torch.Tensor) -> torch.Tensor:
            y = mm(x.to(torch.bfloat16), packed, GROUP, scales).to(x.dtype)
            return y if bias is None else y + bias

        return int4_product

    def dense_weight(self) -> torch.Tensor:
        """W (out, in) in fp32 exactly as the kernel sees it: its scalar fp32 path over an identity
        matrix, each output one code times its scale plus its zero."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        with torch.no_grad():
            dense = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed_weight, GROUP,
                                                               self.scales_and_zeros.float())
        return dense.t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind} blocks as int4, groups of {GROUP}")
