"""A Hugging Face checkpoint's safetensors files read by name into a model ladechat built empty
(engine/models/), without transformers' from_pretrained: the names in the files are the model's own.

safetensors' safe_open reads them: it checks each file's header and byte ranges, and its tensors
are the file mapped copy-on-write, as from_pretrained maps it (no copy is made, a page is read
when the weights are first used, packing them for oneDNN or the first step, and the page cache
holds it once; a write stays in the process). A weight cast to another dtype is a tensor of its
own, made one at a time. A checkpoint this reader cannot take whole (.bin files, names or shapes
that are not the model's, a missing shard, a file safetensors refuses) is left to from_pretrained,
which reads it or says in one line what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# what a checkpoint may hold that the model computes instead: older Llama checkpoints keep every
# layer's rotary frequencies, which transformers ignores on load too
COMPUTED = (".rotary_emb.inv_freq",)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass(frozen=True)
class Tensor:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def files(folder: Path) -> list[Path] | None:
    """The checkpoint's safetensors files, as from_pretrained looks for them: model.safetensors,
    else the shards model.safetensors.index.json names; None where there are neither or a shard is
    missing."""
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if not (folder / INDEX).is_file():
        return None
    try:
        shards = sorted({folder / name for name in json.loads((folder / INDEX).read_text())["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return shards if shards and all(shard.is_file() for shard in shards) else None


def tensors(folder: Path) -> dict[str, Tensor] | None:
    """{name: its file, dtype and shape} of every tensor of the checkpoint in `folder` (files());
    None where it has none or safetensors refuses a file (a Git LFS pointer, a file cut short)."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, Tensor] = {}
    try:
        for file in files(folder) or ():
            with safe_open(file, "pt", backend=_backend(file)) as fh:
                for name in fh.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    part = fh.get_slice(name)
                    found[name] = Tensor(file, DTYPES[part.get_dtype()], tuple(part.get_shape()))
    except (OSError, SafetensorError, KeyError):  # KeyError: a dtype ladechat does not read
        return None
    return found or None


def checkpoint_dtype(found: dict[str, Tensor], config) -> torch.dtype:
    """The dtype from_pretrained's dtype="auto" reads a checkpoint in: its config's, else its first
    floating-point tensor's, else float32."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    if isinstance(named, torch.dtype):
        return named
    return next((t.dtype for t in found.values() if t.dtype.is_floating_point), torch.float32)


def misfit(model, found: dict[str, Tensor]) -> str | None:
    """None where `found` holds every parameter of `model` (built empty) under its name, with its
    shape, in a floating-point dtype, and nothing but COMPUTED besides (an output layer tied to the
    embedding has no tensor of its own); else the first thing that does not fit (one line)."""
    wanted = dict(model.named_parameters())  # a tied output layer's weight is the embedding's
    for name, param in wanted.items():
        if name not in found:
            return f"it has no tensor {name}"
        if found[name].shape != tuple(param.shape):
            return f"its {name} is {list(found[name].shape)}, not {list(param.shape)}"
        if not found[name].dtype.is_floating_point:
            return f"its {name} is {str(found[name].dtype).removeprefix('torch.')}"
    extra = [name for name in found if name not in wanted and not name.endswith(COMPUTED)]
    if "lm_head.weight" in extra:
        # transformers keeps a file's own output layer where it differs from the embedding
        return "it has an output layer of its own, though its config ties it to the embedding"
    return f"it has tensors the model has not ({extra[0]})" if extra else None


def copied_bytes(model, found: dict[str, Tensor], dtype: torch.dtype) -> int:
    """The memory read_into takes beyond the mapped files: the weights of `model` (built empty;
    misfit() None) that it casts to `dtype`, in `dtype`."""
    return sum(param.numel() * dtype.itemsize for key, param in model.named_parameters()
               if found[key].dtype != dtype)


def read_into(model, found: dict[str, Tensor], dtype: torch.dtype,
              progress: Callable[[str], AbstractContextManager] | None = None, name: str = "the model") -> None:
    """Every parameter of `model` (built empty; misfit() None) from `found`: the file's own tensor
    in its dtype, else cast to `dtype`, one at a time. SafetensorError or OSError for a file that
    changed since tensors() read it."""
    from safetensors import safe_open

    aliases: dict[int, list[str]] = {}  # a parameter's names: a tied output layer's weight is the embedding's
    for key, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(key)
    by_file: dict[Path, list[tuple[str, torch.nn.Parameter]]] = {}
    for key, param in model.named_parameters():
        by_file.setdefault(found[key].file, []).append((key, param))
    status = progress(f"Reading the weights of {name}") if progress else nullcontext()
    with status, torch.no_grad():
        for file, params in by_file.items():
            with safe_open(file, "pt", backend=_backend(file)) as fh:
                for key, empty in params:
                    tensor = fh.get_tensor(key)
                    param = torch.nn.Parameter(tensor if tensor.dtype == dtype else tensor.to(dtype),
                                               requires_grad=False)
                    for alias in aliases[id(empty)]:
                        parent, _, leaf = alias.rpartition(".")
                        model.get_submodule(parent)._parameters[leaf] = param


def _backend(file: Path) -> str:
    """safe_open's way to read `file`: mapped, or read into memory where transformers reads it so
    (hf-mount's FUSE filesystem, whose mapping deadlocks under parallel page faults)."""
    from transformers import modeling_utils

    on_hf_mount = getattr(modeling_utils, "_is_on_hf_mount", None)
    return "pread" if on_hf_mount is not None and on_hf_mount(file) else "mmap"
