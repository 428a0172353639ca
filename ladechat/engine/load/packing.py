"""Linear weights stored in oneDNN's packed layout, for CPU steps of a few rows.

On a CPU, `torch.nn.Linear` hands its weight to the BLAS as it lies in memory (out x in, row-major)
on every call: bf16 matmuls are reordered into oneDNN's blocked layout each time, fp32 ones go to
MKL, with which a step of a few rows costs far more than a one-row step. Reordering each weight
once, at load, into the layout oneDNN's kernels read (`torch.ops.mkldnn._reorder_linear_weight`, as
inductor's weight freezing does for bf16) and calling the packed kernel (`_linear_pointwise`)
removes both (measured: BENCHMARKS.md, scripts/packed_weights.py).

A plain step gets cheaper, and a step of a few rows costs about what one row does, which is what
lookahead needs. bf16 results are bit for bit those of `nn.Linear` (the same oneDNN kernel, minus
the per-call reorder); fp32 ones differ in the last bits (oneDNN's sums instead of MKL's). As with
`nn.Linear`, a row's last bits can depend on how many rows its step has (the down projection's
1536-long sums here), so greedy exactness is checked against HF greedy on the same packed weights.

The model's code is untouched: each plain `nn.Linear` module is replaced by a `PackedLinear` that
computes the same product, as transformers' own quantizers replace Linear modules. Subclasses of
Linear (bitsandbytes' quantized layers) and tensor-subclass weights are left alone. The replaced
weights are freed, except an output layer tied to the input embedding, whose packed copy is extra
memory (the embedded model: +113 MB in fp32). `LayoutSwitch` runs the model with plain Linear
modules again (the bench times HF `generate` on the model as transformers loads it).
"""

from __future__ import annotations

import platform
from contextlib import contextmanager

import torch

DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W reordered once for oneDNN. Inference only, fixed to the CPU and its
    dtype: the packed weight is a buffer without gradient; `.weight` and a state dict give it as a
    plain dense tensor again, and moving or casting the model (`.to`, `.half`) is refused with a
    clear error (load with `pack_weights=False` to do that)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # batch size hint None: a layout for any number of rows (a hint of 1 makes 2+ rows slower in fp32)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(),
                                                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        # for model code that reads a Linear's weight itself (its dtype, or a product with it, as a
        # few families' layers do): a dense copy at each read, none kept beside the packed one
        return self.packed_weight.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # saved as nn.Linear's `weight`, so a state dict of a packed model loads into the model as built
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() and the like would hand the opaque oneDNN tensor to `fn`
        raise TypeError("packed Linear weights stay on the CPU in their dtype; "
                        "load with pack_weights=False to move or cast the model")

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def supported(device: torch.device, dtype: torch.dtype, machine: str | None = None,
              bf16_kernels: bool | None = None) -> bool:
    """Whether weights of this dtype on this device are packed: on an x86-64 CPU with oneDNN
    (measured there; on other CPUs torch's oneDNN runs through other backends, unmeasured), in
    bf16 only where oneDNN has bf16 kernels (AVX-512 or AVX-NE-CONVERT; elsewhere packing fails).
    machine and bf16_kernels: this machine's (platform.machine(), oneDNN's own answer) unless given."""
    machine = (machine or platform.machine()).lower()
    ops = torch.ops.mkldnn
    if dtype == torch.bfloat16 and bf16_kernels is None:
        bf16_kernels = bool(ops._is_mkldnn_bf16_supported())
    return (device.type == "cpu" and dtype in DTYPES and machine in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
            and (dtype != torch.bfloat16 or bool(bf16_kernels)))


def _names(model, kind) -> list[str]:
    # names, not modules: holding every replaced module until the walk ends would keep a second
    # copy of the weights alive while packing (14 GB more for a 7B model in bf16)
    return [name for name, m in model.named_modules() if type(m) is kind]


def pack(model) -> int:
    """Replace every plain nn.Linear whose weight is a plain tensor of a device and dtype
    `supported` packs by a PackedLinear. Returns how many were replaced."""
    count = 0
    with torch.no_grad():
        for name in _names(model, torch.nn.Linear):
            linear = model.get_submodule(name)
            weight = linear.weight.data
            if type(weight) is torch.Tensor and supported(weight.device, weight.dtype):
                model.set_submodule(name, PackedLinear(linear))
                count += 1
    return count


def unpack(model) -> int:
    """Replace every PackedLinear by a plain nn.Linear with the same weight and bias. Returns how
    many were replaced."""
    names = _names(model, PackedLinear)
    for name in names:
        model.set_submodule(name, _as_linear(model.get_submodule(name)))
    return len(names)


def _as_linear(packed: PackedLinear) -> torch.nn.Linear:
    with torch.no_grad():
        linear = torch.nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(packed.weight, requires_grad=False)
        if packed.bias is not None:
            linear.bias = packed.bias
    return linear


def is_packed(model) -> bool:
    return any(type(m) is PackedLinear for m in model.modules())


class LayoutSwitch:
    """A packed model and plain Linear twins of its packed modules, to run it either way without
    reordering weights at each switch (slow, and the bench switches for every
    turn it gives HF). Holds a second copy of the Linear weights. It swaps the modules of the one
    model, so no other forward pass may run on it while `as_loaded` is open."""

    def __init__(self, model):
        self.model = model
        self.packed = {name: model.get_submodule(name) for name in _names(model, PackedLinear)}
        self.plain = {name: _as_linear(packed) for name, packed in self.packed.items()}

    @contextmanager
    def as_loaded(self):
        """The model with plain Linear modules for the duration (as transformers loads it)."""
        for name, linear in self.plain.items():
            self.model.set_submodule(name, linear)
        try:
            yield self.model
        finally:
            for name, packed in self.packed.items():
                self.model.set_submodule(name, packed)
