"""A Hugging Face checkpoint's safetensors files read by name into a model ladechat built empty
(engine/models/), without transformers' from_pretrained: the names in the files are the model's own.

Each weight in the file's dtype is a view of the file, mapped copy-on-write, as from_pretrained
maps it: no copy is made, a page is read when the weights are first used (packing them for
oneDNN, or the first step), and the page cache holds it once. A weight cast to another dtype is
a tensor of its own, made one at a time, so a load holds the model once plus one tensor. A
checkpoint this reader cannot take whole (.bin files, names or shapes that are not the model's,
a missing shard) is left to from_pretrained.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ladechat.engine.load import kept

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# what a checkpoint may hold that the model computes instead: older Llama checkpoints keep every
# layer's rotary frequencies, which transformers ignores on load too
COMPUTED = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Tensor:
    file: Path
    start: int  # its first byte in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def tensors(folder: Path) -> dict[str, Tensor] | None:
    """{name: where it is} of every tensor of the checkpoint in `folder` (model.safetensors, or the
    shards model.safetensors.index.json names); None where it has neither, an index names a file
    that is not there, or a header does not parse (from_pretrained reads it, or says what is wrong)."""
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
    elif (folder / SINGLE).is_file():
        files = [folder / SINGLE]
    else:
        return None
    found: dict[str, Tensor] = {}
    for file in files:
        try:
            with open(file, "rb") as fh:
                data, _, entries = kept.header(fh)
            for name, entry in entries.items():
                found[name] = Tensor(file, data + int(entry["data_offsets"][0]), kept.DTYPES[entry["dtype"]],
                                     tuple(int(n) for n in entry["shape"]))
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None
    return found


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
    """None where `found` holds every parameter of `model` (built empty) under its name and with
    its shape, a tied output layer aside, and nothing but COMPUTED besides; else the first thing
    that does not fit (one line)."""
    wanted = _wanted(model)
    for name, param in wanted.items():
        if name not in found:
            return f"it has no tensor {name}"
        if found[name].shape != tuple(param.shape):
            return f"its {name} is {list(found[name].shape)}, not {list(param.shape)}"
    extra = [name for name in found if name not in wanted and not name.endswith(COMPUTED) and name != "lm_head.weight"]
    return f"it has tensors the model has not ({extra[0]})" if extra else None


def read_into(model, found: dict[str, Tensor], dtype: torch.dtype,
              progress: Callable[[str], AbstractContextManager] | None = None, name: str = "the model") -> None:
    """Every parameter of `model` (built empty; misfit() None) from `found`: a view of its file,
    mapped copy-on-write (read as the weights are first used, shared with the page cache, never
    written back), or where it must be cast to `dtype` (or is not aligned for a view) a tensor of
    its own, made one at a time. OSError for a file cut short."""
    wanted = _wanted(model)
    aliases: dict[int, list[str]] = {}  # a parameter's names: a tied output layer's weight is the embedding's
    for key, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(key)
    maps: dict[Path, mmap.mmap] = {}
    status = progress(f"Reading the weights of {name}") if progress else nullcontext()
    with status, torch.no_grad():
        for key, param in wanted.items():
            where = found[key]
            if where.file not in maps:
                maps[where.file] = _mapped(where.file)
            if where.start + where.size > len(maps[where.file]):
                raise OSError(f"{where.file.name} is cut short")
            tensor = torch.frombuffer(maps[where.file], dtype=torch.uint8, count=where.size, offset=where.start) \
                if where.size else torch.empty(0, dtype=torch.uint8)
            if where.start % where.dtype.itemsize:  # not aligned for a view
                tensor = tensor.clone()
            tensor = tensor.view(where.dtype).reshape(where.shape)
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            param = torch.nn.Parameter(tensor, requires_grad=False)
            for alias in aliases[id(wanted[key])]:
                parent, _, leaf = alias.rpartition(".")
                model.get_submodule(parent)._parameters[leaf] = param


def _mapped(file: Path) -> mmap.mmap:
    """The file mapped copy-on-write (the tensors viewing it keep it mapped)."""
    with open(file, "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


def _wanted(model) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by name, each once: an output layer tied to the embedding is the
    embedding's (as transformers ties it, whatever the file holds for it)."""
    return dict(model.named_parameters())
