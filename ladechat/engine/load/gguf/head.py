"""A GGUF file's Q8_0 output layer on ladechat's Q8_0 kernel (kernels/q8.py): read once into the
kernel's layout and kept in the GGUF's cache folder (the GGUF's metadata takes seconds to read).
Anything it cannot take (no Q8_0 output tensor, a shape the kernel does not fit, no compiler, a CPU
without AVX2) leaves the layer as it was, with a one-line notice where that is a surprise."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.kernels import native, q8
from ladechat.engine.kernels.q8 import (
    BUFFERS,
    GROUP,
    OUT,
    SOURCE,
    Q8Error,
    Q8Linear,
    check_shape,
    decode,
    kernel_layout,
    usable,
)

CACHE_PREFIX = "q8-"


def read_gguf(gguf_path: Path, model) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's codes and scales of the output layer of `gguf_path` (`model`: built from the
    file's config), None when it is not Q8_0 blocks. Q8Error when they cannot run."""
    from ladechat.engine.load.gguf import files as gguf_files

    reader = gguf_files.read(gguf_path)
    tensor = gguf_files.output_tensor(reader, model.config)
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
    return kernel_layout(torch.from_numpy(codes), torch.from_numpy(scales))


def cache_path(folder: Path) -> Path:
    """The file of a GGUF's Q8_0 output layer in the kernel's layout (in its cache folder), named for this
    module's code (a change to how blocks are read is read afresh)."""
    from ladechat.paths import source_digest

    return Path(folder) / f"{CACHE_PREFIX}{source_digest(__file__, q8.__file__)}.safetensors"


@dataclass(frozen=True)
class Applied:
    replaced: bool
    notices: tuple[str, ...]


def apply(model, gguf_path: Path, folder: Path, kernels: Path,
          progress: Callable[[str], AbstractContextManager] | None = None, compiler: str = native.COMPILER) -> Applied:
    """Replace the output layer of `model` (built from `gguf_path`'s config; `folder`: its cache
    folder) by a Q8Linear of its Q8_0 blocks, the kernel compiled into `kernels` if not yet.
    The first time reads the GGUF and keeps the blocks in `folder`."""
    from ladechat.engine.load.gguf import kept

    name = Path(gguf_path).name
    path = cache_path(folder)
    if path.is_file() and kept.whole(path):
        meta, _, get = kept.read(path)
        found = tuple(get(k) for k in BUFFERS) if meta.get("q8_0") == "yes" else None
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
        arrays = dict(zip(BUFFERS, found, strict=True)) if found else {"none": torch.zeros(1)}
        kept.keep_beside(path, arrays, {"q8_0": "yes" if found else "no", "notices": json.dumps(notices)},
                         f"{CACHE_PREFIX}*.safetensors")  # a read-only cache: read again next time
    if found is None:
        return Applied(False, tuple(notices))
    unbuilt = native.why_not_loaded(SOURCE, kernels, compiler, progress)
    if unbuilt:
        return Applied(False, (*notices, f"the output layer of {name} runs dense: {unbuilt}"))
    head = model.get_output_embeddings()
    tiles = found[0]
    if not usable() or type(head) is not torch.nn.Linear \
            or (head.out_features, head.in_features) != (tiles.shape[0] * OUT, tiles.shape[1] * GROUP):
        return Applied(False, tuple(notices))
    module_name = next(key for key, module in model.named_modules() if module is head)
    model.set_submodule(module_name, Q8Linear(*found))
    return Applied(True, tuple(notices))
