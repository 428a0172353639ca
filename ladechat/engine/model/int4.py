"""A GGUF file's 4-bit weights kept at 4 bits: read once, multiplied by ladechat's kernel (q4.py)
or, where no compiler builds it, by torch's int4 kernel on the CPU.

GGUF's Q4_0, Q4_1 and Q4_K blocks store, for every 32 weights along a row, 4-bit codes q (0..15)
and one scale and offset, which this module reads as w = scale * q + low:

    Q4_0  w = d * (q - 8)             scale d,       low -8 d
    Q4_1  w = d * q + m               scale d,       low m
    Q4_K  w = d sc_j * q - dmin m_j   scale d sc_j,  low -dmin m_j   (per 32-weight sub-block j)

Each such tensor is read from the file as it is (the `gguf` package's reader, no dequantized fp32
copy) and kept in q4.py's layout in the file's own precision (fp16 scales and lows; Q4_K's 6-bit
sc and m with d and dmin per 256 weights), which the kernel widens to fp32 exactly. ladechat's kernel multiplies them with int8 activations (q4.py says why). Without it, the
same blocks are torch's int4 packed format with groups of 32 ("tinygemm": w = (q - 8) * scale +
zero, zero = low + 8 scale), packed once at load (`_convert_weight_to_int4pack_for_cpu`) and
multiplied by `_weight_int4pack_mm_for_cpu`, whose scales and zeros are bf16 and whose vectorized
path takes bf16 activations, so `Int4Linear` casts a step's activations to bf16 at the product.
Q6_K and Q8_0 Linear weights (and an output layer tied to an embedding of such blocks) are read
here too and run at their own bits on ladechat's kernels (q6.py, q8.py; torch has none for them:
without ladechat's they are dense); a Q8_0 output layer is q8.apply's. Everything else (norms,
attention, the residual stream) stays in the model's dtype, and tensors of other types (the
embedded model's Q8_0 embedding; Q5/F16 tensors) keep the path they had: dense, packed for oneDNN
where that applies.

Both kernels compute each row on its own, in the same order whatever the step's size. SDPA's rows
depend in fp32's last bits on how many rows and masked keys a step has, and the rounding of the
next product's input (int8 codes, or bf16) turns such a difference into a visible one now and then,
so where ladechat's kernels load, model loading also switches attention to its row-wise kernel
(attention.py): a lookahead answer on these weights is then plain decoding's, token for token,
where every Linear is such blocks or a Q8_0 output layer (the embedded model; other tensor types
run packed, whose rows can depend on the step's size). On torch's kernel with SDPA (no compiler)
it can part after a near tie (tests/test_int4.py checks both).

Reading a GGUF's metadata takes seconds on a small CPU, so the first load writes the blocks in the
kernel's layout (in the model's own row order: llama.cpp permutes the rows of q and k, and
transformers' GGUF tensor processor says how) into one safetensors file in the GGUF's cache folder
(gguf.py), named for this module's code; later loads only read it. The model's code is untouched:
Linear modules are replaced, as transformers' quantizers do.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.model import attention, native, q4, q6, q8

GROUP = 32  # weights per scale and low
KINDS = ("Q4_0", "Q4_1", "Q4_K")  # GGUF block types with an exact int4 form
BLOCK_KINDS = (*KINDS, "Q6_K", "Q8_0")  # those ladechat's kernels run at their own bits (q6.py, q8.py)
CACHE_PREFIX = "int4-"
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


# -- the blocks --------------------------------------------------------------------------------

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float64: (rows, blocks, 1)."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16).astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., 16) of a 32-weight group: weights 0-15 in the low nibbles, 16-31 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit form of a GGUF tensor's blocks: codes q (rows, cols) uint8 in 0..15, and per group
    of 32 weights along a row the scale and low (rows, cols / 32) float32, such that
    w = scale * q + low is the weight `gguf.dequantize` gives (the scales and lows exactly: fp16
    values, or for Q4_K an fp16 times a 6-bit integer). `data` is the tensor's bytes, (rows, bytes
    per row)."""
    q, *parts = decode_compact(kind, data, rows, cols)
    if kind != "Q4_K":
        return q, parts[0].astype(np.float32), parts[1].astype(np.float32)
    sc, m, d, dmin = parts
    d, dmin = np.repeat(d, q4.SUPER, axis=1), np.repeat(dmin, q4.SUPER, axis=1)
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)  # exact: fp16 times an integer < 64


def decode_compact(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """A GGUF tensor's blocks in the precision the file holds them, for q4.layout / q4.layout_k:
    Q4_0 and Q4_1: (q, scale, low), the scale and low (rows, cols / 32) fp16 (fp32 where Q4_0's -8 d
    leaves fp16's range); Q4_K: (q, sc, m, d, dmin), sc and m (rows, cols / 32) uint8, d and dmin
    (rows, cols / 256) fp32; q as decode()'s."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K

    if kind not in KINDS:
        raise Int4Error(f"{kind} has no exact int4 form (only {', '.join(KINDS)})")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if cols % block or data.shape != (rows, cols // block * size):
        raise Int4Error(f"{kind} blocks of {data.shape[-1]} bytes a row do not make {rows}x{cols} weights")
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // block, size)
    if kind == "Q4_0":
        d = _f16(blocks, 0).reshape(rows, cols // GROUP)
        low = -8 * d
        dtype = np.float16 if (np.abs(low) <= np.finfo(np.float16).max).all() else np.float32  # else past fp16's range
        return _nibbles(blocks[..., 2:]).reshape(rows, cols), d.astype(dtype), low.astype(dtype)
    if kind == "Q4_1":
        return _nibbles(blocks[..., 4:]).reshape(rows, cols), *(_f16(blocks, at).reshape(rows, cols // GROUP)
                                                                 .astype(np.float16) for at in (0, 2))
    n = rows * (cols // block)
    d, dmin = _f16(blocks, 0).reshape(rows, -1), _f16(blocks, 2).reshape(rows, -1)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(n, 12))
    # 4 chunks of 32 bytes: the low nibbles are sub-block 2j, the high ones 2j + 1
    qs = blocks[..., 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, cols)
    return (q, sc.reshape(rows, -1).astype(np.uint8), m.reshape(rows, -1).astype(np.uint8),
            d.astype(np.float32), dmin.astype(np.float32))


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

class Int4Linear(torch.nn.Module):
    """y = x W^T + b with W as 4-bit codes and a bf16 scale and zero per 32 weights (w = (q - 8) *
    scale + zero), multiplied by
    torch's int4 CPU kernel with bf16 activations (the result is cast back to x's dtype). Inference
    only, fixed to the CPU: `.weight` (and a state dict) give W dense in fp32, computed from the
    codes at each read; moving or casting the model is refused (load with --weights dense to do that)."""

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
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

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
        """The same blocks from ladechat's kernel's buffers (q4.layout's or q4.layout_k's)."""
        codes = torch.from_numpy(pack_codes(q4.codes_of(tiles).numpy()))
        return cls.from_codes(codes, *map(q4.per_row, q4.expand(scales, lows)), bias, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, GROUP, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        # The kernel's scalar fp32 path over an identity matrix: each output is one code times its
        # scale plus its zero, so this is W exactly as the kernel sees it (a dense copy per read).
        eye = torch.eye(self.in_features, dtype=torch.float32)
        with torch.no_grad():
            dense = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed_weight, GROUP,
                                                               self.scales_and_zeros.float())
        return dense.t().contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn, recurse=True):
        raise TypeError("int4 weights stay on the CPU; load with --weights dense to move or cast the model")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind} blocks as int4, groups of {GROUP}")


# -- reading a GGUF file once ------------------------------------------------------------------

def cache_path(folder: Path) -> Path:
    """The file of a GGUF's 4-bit weights in q4.py's layout (in its cache folder), named for the code that
    reads and lays them out (a change to either is read afresh)."""
    from ladechat.engine.model.gguf import source_digest

    return Path(folder) / f"{CACHE_PREFIX}{source_digest(__file__, q4.__file__, q6.__file__, q8.__file__)}.safetensors"


def read_gguf(gguf_path: Path, model) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """The kernels' form of every Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 tensor of `gguf_path` that is a plain
    Linear weight of `model` (built from the file's config, its weights empty or not), a Q8_0 output
    layer aside: ({module.buffer: q4.layout's tiles/scales/lows, q6.layout's tiles/d or
    q8.kernel_layout's tiles/scales/sums}, notices, {module: block type}). A tensor
    that cannot run so keeps its dense weight, with a notice when that is a surprise (a corrupt
    block, rows transformed on loading), none for the types that have no kernel."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from ladechat.engine.model import gguf as gguf_files

    reader = gguf_files.read(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    arrays: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    notices: list[str] = []
    head = model.get_output_embeddings()
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    if "output.weight" not in by_name and "token_embd.weight" in by_name \
            and getattr(model.config, "tie_word_embeddings", False) and type(head) is torch.nn.Linear:
        # the output layer is the input embedding's blocks, whichever kernel's they are (q8.py takes a Q8_0 one)
        names = {**names, "output.weight": next(key for key, module in model.named_modules() if module is head)
                 + ".weight"}
        by_name["output.weight"] = by_name["token_embd.weight"]
    for name, tensor in by_name.items():
        kind = tensor.tensor_type.name
        target = names.get(name, "")
        if kind not in BLOCK_KINDS or not target.endswith(".weight"):
            continue
        module_name = target.removesuffix(".weight")
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            continue
        if type(linear) is not torch.nn.Linear or (kind == "Q8_0" and linear is head):  # q8.apply takes that
            continue
        rows, cols = linear.out_features, linear.in_features
        try:
            buffers = _kernel_form(kind, np.asarray(tensor.data), rows, cols,
                                   lambda: gguf_files.row_order(processor, tensor.name, rows))  # noqa: B023 (called at once)
        except (Int4Error, q6.Q6Error, q8.Q8Error) as exc:
            notices.append(f"{name} ({kind}) runs dense: {exc}")
            continue
        arrays.update({f"{module_name}.{buffer}": value for buffer, value in buffers.items()})
        kinds[module_name] = kind
        _release(reader, tensor)
    return arrays, notices, kinds


def _release(reader, tensor) -> None:
    """Drop the file's pages of a tensor that has been read from this process's memory (the file
    stays mapped and in the page cache; a 7B file would otherwise be resident whole, on top of its
    kernel layout)."""
    import mmap

    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)
    except (OSError, ValueError):  # a mapping that does not take the advice: its pages stay
        pass


def _kernel_form(kind: str, data: np.ndarray, rows: int, cols: int, order_of) -> dict[str, torch.Tensor]:
    """A tensor's blocks in its kernel's layout, its rows in the model's order (order_of(): the GGUF
    row of each, or None when loading does more than reorder them)."""
    if kind == "Q6_K":
        q6.check_shape(rows, cols)
        parts = q6.decode(data, rows, cols)
        finite = np.isfinite(parts[2]).all()
    elif kind == "Q8_0":
        q8.check_shape(rows, cols)
        parts = q8.decode(data, rows, cols)
        finite = np.isfinite(parts[1]).all()
    else:
        check_shape(rows, cols)
        parts = decode_compact(kind, data, rows, cols)
        finite = all(np.isfinite(part).all() for part in parts[1:] if part.dtype.kind == "f")
    if not finite:
        raise Int4Error("some of its scales are not finite numbers (a corrupt block)")
    order = order_of()
    if order is None:
        raise Int4Error("its rows are transformed on loading, not only reordered")
    if not np.array_equal(order, np.arange(rows)):  # llama.cpp's q and k; the rest as they are, no copy
        parts = [part[order] for part in parts]
    parts = [torch.from_numpy(np.ascontiguousarray(part)) for part in parts]
    if kind == "Q6_K":
        return dict(zip(q6.BUFFERS, q6.layout(*parts), strict=True))
    if kind == "Q8_0":
        return dict(zip(q8.BUFFERS, q8.kernel_layout(*parts), strict=True))
    return dict(zip(q4.BUFFERS, (q4.layout_k if kind == "Q4_K" else q4.layout)(*parts), strict=True))


@dataclass(frozen=True)
class Applied:
    replaced: int  # Linear modules now on a kernel of their blocks
    kinds: tuple[str, ...]  # their GGUF block types
    notices: tuple[str, ...]


def apply(model, gguf_path: Path, folder: Path, kernels: Path | None,
          progress: Callable[[str], AbstractContextManager] | None = None, compiler: str = native.COMPILER) -> Applied:
    """Replace every plain Linear of `model` (built from `gguf_path`'s config; `folder`: its cache
    folder) whose GGUF weight is Q4_0, Q4_1 or Q4_K by a module of the same blocks: a
    q4.Q4Linear, its kernel compiled into `kernels` if not yet, or an Int4Linear (torch's kernel)
    where it cannot be built (a one-line notice) or `kernels` is None; and those of Q6_K and Q8_0
    blocks by a q6.Q6Linear or q8.Q8Linear where ladechat's kernel runs (else they stay dense). The first time reads the
    GGUF (seconds) and keeps the 4-bit form in `folder`. A file that cannot be read leaves the
    model as it is, with a one-line notice."""
    from ladechat.engine.model import kept
    from ladechat.engine.model.gguf import keep_beside

    kernel_notices, path_here = _kernel(gguf_path, kernels, progress, compiler)
    path = cache_path(folder)
    if not (path.is_file() and kept.whole(path)):  # a file cut short (a full disk, a crash): read afresh
        status = progress(f"Reading the quantized blocks of {Path(gguf_path).name} (one time)") if progress \
            else nullcontext()
        with status:
            try:
                arrays, notices, kinds = read_gguf(Path(gguf_path), model)
                arrays = q4.join_in_place(arrays)  # q/k/v and gate/up kept together: one product each in a step
            except (ValueError, KeyError, IndexError, OSError, EOFError) as exc:
                detail = " ".join(str(exc).split()) or type(exc).__name__
                notice = f"cannot read the 4-bit blocks of {Path(gguf_path).name} ({detail}); running its dense weights"
                return Applied(0, (), (notice,))
            meta = {"notices": json.dumps(notices), "kinds": json.dumps(kinds)}
            keep_beside(path, arrays, meta, f"{CACHE_PREFIX}*.safetensors")  # a read-only cache: read again next time
            # what was kept, from memory (read back, it would be in memory twice for a while)
            return _replace(model, q4.KeptReader(arrays.__getitem__, arrays, model), kinds, notices, path_here,
                            kernel_notices)
    meta, keys, get = kept.read(path)
    kinds, notices = json.loads(meta.get("kinds", "{}")), json.loads(meta.get("notices", "[]"))
    return _replace(model, q4.KeptReader(get, keys, model), kinds, notices, path_here, kernel_notices)


def _kernel(gguf_path: Path, kernels: Path | None, progress, compiler: str) -> tuple[list[str], int | None]:
    """(notices, the path of ladechat's kernel that runs here, or None for torch's kernel)."""
    if kernels is None:
        return [], None
    unbuilt = q4.load(kernels, progress, compiler)
    if unbuilt:
        return [f"the 4-bit weights of {Path(gguf_path).name} run on torch's int4 kernel: {unbuilt}"], None
    if q4.best_path() < 1:  # an x86-64 CPU without AVX2: the kernel's portable loops are slower than torch's
        return [], None
    return [], q4.best_path()


def _replace(model, read: q4.KeptReader, kinds: dict[str, str], notices: list[str],
             path: int | None, kernel_notices: list[str]) -> Applied:
    """Put in the kept blocks (read(module, buffer)): Q4Linear on ladechat's kernel's `path`, or
    (None) Int4Linear (then `kernel_notices` say why, where any module was replaced)."""
    count = 0
    with torch.no_grad():
        for name, kind in kinds.items():
            linear = model.get_submodule(name)
            if type(linear) is not torch.nn.Linear:
                continue
            if kind in ("Q6_K", "Q8_0"):
                if path is None:  # torch has no kernel for these blocks: the tensor is read dense
                    continue
                module = (q6.Q6Linear(*(read(name, b) for b in q6.BUFFERS), linear.bias, path) if kind == "Q6_K"
                          else q8.Q8Linear(*(read(name, b) for b in q8.BUFFERS), path, linear.bias))
                if (module.out_features, module.in_features) == (linear.out_features, linear.in_features):
                    model.set_submodule(name, module)
                    count += 1
                continue
            tiles, scales, lows = (read(name, buffer) for buffer in q4.BUFFERS)
            if path is not None:
                module = q4.Q4Linear(tiles, scales, lows, linear.bias, kind, path)
            else:
                module = Int4Linear.from_kernel_layout(tiles, scales, lows, linear.bias, kind)
            if (module.out_features, module.in_features) != (linear.out_features, linear.in_features):
                continue
            model.set_submodule(name, module)
            count += 1
    return Applied(count, tuple(sorted({kind for name, kind in kinds.items()
                                        if type(model.get_submodule(name)) is not torch.nn.Linear})),
                   tuple(notices + (kernel_notices if count else [])))


# -- what runs -----------------------------------------------------------------------------------

def weight_layout(model) -> str:
    """Which kernels the model's Linear weights (and norms) run on, e.g. 'q4:210,q8_0:1,norm:61'
    (q4: ladechat's 4-bit kernel, int4: torch's; a key of the step-cost cache: each layout has its
    own cost curve)."""
    from ladechat.engine.model.norms import NativeRMSNorm
    from ladechat.engine.model.packing import PackedLinear
    from ladechat.engine.model.q8 import Q8Linear

    counts = {"q4": 0, "q6_k": 0, "int4": 0, "q8_0": 0, "packed": 0, "dense": 0, "norm": 0}
    for module in model.modules():
        if type(module) is NativeRMSNorm:
            counts["norm"] += 1
        elif type(module) is q4.Q4Linear:
            counts["q4"] += 1
        elif type(module) is q6.Q6Linear:
            counts["q6_k"] += 1
        elif type(module) is Int4Linear:
            counts["int4"] += 1
        elif type(module) is Q8Linear:
            counts["q8_0"] += 1
        elif type(module) is PackedLinear:
            counts["packed"] += 1
        elif isinstance(module, torch.nn.Linear):
            counts["dense"] += 1
    return ",".join(f"{k}:{v}" for k, v in counts.items() if v) or "none"


def describe(model) -> str:
    """The Linear weights and their kernels in words (for the banner, /show and --debug); empty for
    a model whose Linear modules are all as transformers loads them."""
    from ladechat.engine.model.norms import NativeRMSNorm
    from ladechat.engine.model.packing import PackedLinear
    from ladechat.engine.model.q8 import Q8Linear

    ours = [m for m in model.modules() if type(m) is q4.Q4Linear]
    six = [m for m in model.modules() if type(m) is q6.Q6Linear]
    int4 = [m for m in model.modules() if type(m) is Int4Linear]
    q8_0 = [m for m in model.modules() if type(m) is Q8Linear]
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    dense = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    parts = []
    if ours:
        kinds = "/".join(sorted({m.kind for m in ours}))
        paths = "/".join(sorted({q4.PATHS[m.path] for m in ours}))
        parts.append(f"{len(ours)} Linear from {kinds} blocks (ladechat's {paths} kernel, int8 activations)")
    if six:
        paths = "/".join(sorted({q4.PATHS[m.path] for m in six}))
        parts.append(f"{len(six)} Linear from Q6_K blocks (ladechat's {paths} kernel, int8 activations)")
    if int4:
        kinds = "/".join(sorted({m.kind for m in int4}))
        parts.append(f"{len(int4)} Linear int4 from {kinds} blocks (torch {KERNEL}, bf16 activations)")
    head = model.get_output_embeddings()
    if any(m is not head for m in q8_0):
        paths = "/".join(sorted({q4.PATHS[m.path] for m in q8_0 if m is not head}))
        count = sum(m is not head for m in q8_0)
        parts.append(f"{count} Linear from Q8_0 blocks (ladechat's {paths} kernel, int8 activations)")
    if head in q8_0:
        parts.append(f"the output layer from Q8_0 blocks (ladechat's {q4.PATHS[head.path]} kernel)")
    if packed:
        dtype = str(packed[0].packed_weight.dtype).removeprefix("torch.")
        parts.append(f"{len(packed)} packed {dtype} (oneDNN)")
    if parts and dense:
        parts.append(f"{dense} dense")
    norms = sum(type(m) is NativeRMSNorm for m in model.modules())
    if norms:
        parts.append(f"{norms} RMSNorm by ladechat's kernel")
    if getattr(model.config, "_attn_implementation", None) == attention.ROWWISE:
        parts.append("attention row by row (ladechat's kernel)")
    return ", ".join(parts)
