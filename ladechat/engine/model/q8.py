"""A GGUF file's Q8_0 output layer kept at 8 bits, multiplied by ladechat's own kernel (q8_0.cpp).

The output layer is the largest product of a small model's step: the embedded model's is
49152 x 576, 28 M weights, read whole on every step for every row's logits (lookahead reads them
all). The GGUF stores it (tied to the input embedding) as Q8_0 blocks, w = d * q with an int8
code q per weight and an fp16 scale d per 32 weights, and the converted model holds it dense: 57
MB a step in bf16, 113 MB in fp32 (the dtype of CPUs without native bf16, ~9 ms a step at their
~12.6 GB/s), plus a packed copy of the tied embedding. At 8 bits it is 30 MB, read once a step
whatever its rows. torch has no kernel for blocks of 32 with their own scales (its int8 weight
kernel takes one scale per output), so ladechat compiles one (engine/model/native.py).

The kernel computes w x as d * (q x) in fp32 from the exact codes and scales (the dense bf16 layer
it replaces rounded d * q to 8 bits of mantissa), each output by one thread in one order: the same
bits for a row alone or among a step's rows, on one thread or two. The codes and scales, in the
kernel's layout, are kept next to the converted model after the first read (the GGUF's metadata
takes seconds to read); the model's code is untouched, its output module is replaced. Anything
it cannot take (no Q8_0 output tensor, a shape the kernel does not fit, no compiler) leaves the
layer as it was, with a one-line notice where that is a surprise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.model import native

SOURCE = Path(__file__).with_name("q8_0.cpp")
GROUP = 32  # weights per scale
OUT = 16  # outputs per block of the kernel's layout
BLOCK_BYTES = 2 + GROUP  # fp16 scale, 32 int8 codes
CACHE_PREFIX = "q8-"


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
    """codes (N, K) int8 and scales (N, K / 32) -> the kernel's (N / 16, K, 16) and (N / 16, K / 32, 16)."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    blocks = rows // OUT
    return (codes.reshape(blocks, OUT, cols).transpose(1, 2).contiguous(),
            scales.float().reshape(blocks, OUT, cols // GROUP).transpose(1, 2).contiguous())


def check_shape(rows: int, cols: int) -> None:
    if rows % OUT or cols % GROUP:
        raise Q8Error(f"a {rows}x{cols} weight does not fit the Q8_0 kernel (outputs a multiple of {OUT}, "
                      f"inputs of {GROUP})")


class Q8Linear(torch.nn.Module):
    """y = x W^T with W as Q8_0 blocks, by ladechat's kernel (its library must be loaded:
    native.load(SOURCE, ...)); the result in x's dtype. Inference only, fixed to the CPU; the
    state dict gives W dense in fp32. wide: the kernel's AVX-512 path, else its AVX2 one (the same
    results)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, wide: bool):
        """codes, scales: the kernel's layout, as kernel_layout makes it."""
        super().__init__()
        blocks, self.in_features, _ = codes.shape
        self.out_features = blocks * OUT
        if codes.dtype != torch.int8 or codes.shape[2] != OUT or scales.dtype != torch.float32 \
                or scales.shape != (blocks, self.in_features // GROUP, OUT):
            raise Q8Error(f"Q8_0 buffers {codes.dtype} {tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)} "
                          "do not make one weight")
        self.wide = wide
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if rows.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads these two (fp16: exact in fp32)
            rows = rows.float()
        y = torch.ops.ladechat_q8_0.mm(rows, self.codes, self.scales, self.wide)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """W (out, in) in fp32, exactly scale * code: a dense copy per read (as Int4Linear's)."""
        return self.dense_weight()

    def dense_weight(self) -> torch.Tensor:
        """W (out, in) in fp32, exactly scale * code."""
        w = self.codes.float() * self.scales.repeat_interleave(GROUP, dim=1)  # (blocks, in, 16)
        return w.transpose(1, 2).reshape(self.out_features, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dense_weight()

    def _apply(self, fn, recurse=True):
        raise TypeError("Q8_0 weights stay on the CPU; load with --weights dense to move or cast the model")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 blocks, "
                f"{'AVX-512' if self.wide else 'AVX2'} kernel")


def wide_kernel() -> bool:
    """Whether this CPU takes the kernel's AVX-512 path (its library loaded)."""
    return bool(torch.ops.ladechat_q8_0.has_avx512())


def usable() -> bool:
    """Whether the kernel's library, once loaded, runs here (a CPU with AVX2 and FMA at least)."""
    return bool(torch.ops.ladechat_q8_0.has_avx2())


# -- the output layer of a GGUF file -------------------------------------------------------------

def output_tensor(reader, config):
    """The GGUF tensor of the model's output layer: its own, or the input embedding it is tied to."""
    by_name = {t.name: t for t in reader.tensors}
    if "output.weight" in by_name:
        return by_name["output.weight"]
    if getattr(config, "tie_word_embeddings", False):
        return by_name.get("token_embd.weight")
    return None


def read_gguf(gguf_path: Path, model) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's codes and scales of the output layer of `gguf_path` (a model loaded from its
    converted copy), None when it is not Q8_0 blocks. Q8Error when they cannot run."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    tensor = output_tensor(reader, model.config)
    if tensor is None or tensor.tensor_type.name != "Q8_0":
        return None
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise Q8Error("the output layer is not a plain Linear module")
    rows, cols = head.out_features, head.in_features
    check_shape(rows, cols)
    blocks = np.asarray(tensor.data).reshape(rows, -1)  # a row's blocks (gguf reads them so already)
    codes, scales = decode(blocks, rows, cols)
    if not np.isfinite(scales).all():
        raise Q8Error("some of its scales are not finite numbers (a corrupt block)")
    dense = head.weight.detach()
    for row in sorted({0, rows // 2, rows - 1}):  # the converted weights must be these blocks
        expected = torch.from_numpy(dequantize(blocks[row][None], tensor.tensor_type))
        if not torch.equal(dense[row].float(), expected[0].to(dense.dtype).float()):
            raise Q8Error(f"its blocks do not match the converted weights (row {row})")
    return kernel_layout(torch.from_numpy(codes), torch.from_numpy(scales))


def cache_path(folder: Path) -> Path:
    """The file of a converted GGUF's Q8_0 output layer in the kernel's layout, named for this
    module's code (a change to how blocks are read is read afresh)."""
    from ladechat.engine.model.gguf import source_digest

    return Path(folder) / f"{CACHE_PREFIX}{source_digest(__file__)}.safetensors"


@dataclass(frozen=True)
class Applied:
    replaced: bool
    notices: tuple[str, ...]


def apply(model, gguf_path: Path, folder: Path, kernels: Path,
          progress: Callable[[str], AbstractContextManager] | None = None, compiler: str = native.COMPILER) -> Applied:
    """Replace the output layer of `model` (loaded from `folder`, the converted copy of
    `gguf_path`) by a Q8Linear of its Q8_0 blocks, the kernel compiled into `kernels` if not yet.
    The first time reads the GGUF and keeps the blocks in `folder`."""
    from safetensors import safe_open

    from ladechat.engine.model.gguf import keep_beside

    name = Path(gguf_path).name
    path = cache_path(folder)
    if path.is_file():
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            found = (fh.get_tensor("codes"), fh.get_tensor("scales")) if meta.get("q8_0") == "yes" else None
            notices = json.loads(meta.get("notices", "[]"))
    else:
        status = progress(f"Reading the output layer of {name} (one time)") if progress else nullcontext()
        notices = []
        with status:
            try:
                found = read_gguf(Path(gguf_path), model)
            except Q8Error as exc:
                found, notices = None, [f"the output layer of {name} runs dense: {exc}"]
            except (ValueError, KeyError, IndexError, OSError, EOFError) as exc:
                detail = " ".join(str(exc).split()) or type(exc).__name__
                return Applied(False, (f"cannot read the output layer of {name} ({detail}); running it dense",))
        arrays = {"codes": found[0], "scales": found[1]} if found else {"none": torch.zeros(1)}
        keep_beside(path, arrays, {"q8_0": "yes" if found else "no", "notices": json.dumps(notices)},
                    f"{CACHE_PREFIX}*.safetensors")  # a read-only cache: read again next time
    if found is None:
        return Applied(False, tuple(notices))
    try:
        native.load(SOURCE, kernels, compiler, progress)
    except native.BuildError as exc:
        return Applied(False, (*notices, f"the output layer of {name} runs dense: {exc}"))
    head = model.get_output_embeddings()
    codes = found[0]
    if not usable() or type(head) is not torch.nn.Linear \
            or (head.out_features, head.in_features) != (codes.shape[0] * OUT, codes.shape[1]):
        return Applied(False, tuple(notices))
    module_name = next(key for key, module in model.named_modules() if module is head)
    model.set_submodule(module_name, Q8Linear(*found, wide=wide_kernel()))
    return Applied(True, tuple(notices))
