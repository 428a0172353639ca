"""A Hugging Face checkpoint's weights quantized as it loads (--quantize q4|q8) into the GGUF blocks
ladechat's CPU kernels run, so a checkpoint runs at a GGUF's speed without a conversion step.

Each Linear weight becomes Q4_0 or Q8_0 blocks by llama.cpp's reference rounding (gguf-py's
quants.quantize: the blocks `llama-quantize` writes without an importance matrix), the output
layer and the token embedding Q8_0 in both (llama-quantize keeps the output layer above 4 bits
too: it costs the most quality for its bytes; the embedding's rows are looked up, never streamed,
so its bits cost memory only). From the blocks on, the path is a GGUF's: the same kernels' layout
(quantized.kernel_form), the same modules, q/k/v and gate/up side by side. The layout is kept in
the cache, keyed by the checkpoint's files and this code, so only a first load quantizes.

The model is the quantized one: greedy answers are plain greedy decoding's on these weights, token
for token (every product and attention row computed alone, as for a GGUF), not the checkpoint's
float answers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.kernels import q4, q8
from ladechat.engine.kernels.linear import BlockLinear
from ladechat.engine.load import joined
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.spec import QUANTIZE
from ladechat.errors import UserError
from ladechat.paths import cache_root

KINDS = QUANTIZE  # --quantize's values and the block types they make
OUTER = "Q8_0"  # the output layer's and the embedding's blocks
ROWS_AT_ONCE = 4096  # rows per quantizing call: gguf-py makes several float copies of what it is given
PREFIX = "quantized-"


class QuantizeError(UserError):
    """The weights cannot be quantized here (one line)."""


def blocks_of(weight: torch.Tensor, kind: str) -> np.ndarray:
    """weight (rows, cols) -> its `kind` blocks (rows, bytes a row) as gguf-py's quantizer makes them,
    a slice of rows at a time (a float32 copy of the slice only, whatever the weight's dtype)."""
    from gguf import GGMLQuantizationType, quants

    rows = weight.shape[0]
    out = None
    for start in range(0, rows, ROWS_AT_ONCE):
        part = weight[start : start + ROWS_AT_ONCE].detach().to(torch.float32).numpy()
        blocks = quants.quantize(part, GGMLQuantizationType[kind])
        if out is None:
            out = np.empty((rows, blocks.shape[1]), dtype=np.uint8)
        out[start : start + len(blocks)] = blocks
    return out


def cache_file(checkpoint: tuple[str, str], kind: str) -> Path:
    """Where the kernels' layout of a checkpoint (its folder, and its files as text) at `kind` is
    kept: a folder per checkpoint folder, a file named for its files, this code and the libraries
    that read and quantize it (a change to any is quantized afresh, replacing the file before)."""
    from importlib.metadata import version

    from ladechat.paths import source_digest

    folder, files = checkpoint
    where = hashlib.sha256(folder.encode()).hexdigest()[:12]
    code = source_digest(__file__, quantized.__file__, joined.__file__, q4.__file__, q8.__file__, q4.SOURCE)
    what = hashlib.sha256(f"{files}|{code}|{version('transformers')}|{version('gguf')}".encode()).hexdigest()[:16]
    return cache_root() / "quantized" / f"{Path(folder).name}-{where}" / f"{PREFIX}{kind}-{what}.safetensors"


def _fits(linear: torch.nn.Module) -> bool:
    return linear.out_features % q4.OUT == 0 and linear.in_features % q4.GROUP == 0


def quantize(model, kind: str, progress: Callable[[str], AbstractContextManager] | None = None,
             name: str = "the model") -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """(the kernels' buffers {module.buffer: tensor}, {module: block type}, notices) of every plain
    Linear of `model` (its output layer: OUTER blocks) and, as `{embedding}.blocks`, its plain
    token embedding's OUTER blocks. Each dense weight is dropped as soon as its blocks are made,
    so the model is in memory about once, not twice; a weight whose blocks cannot run (a shape the
    kernels do not take, scales that are not finite) stays dense, with a notice."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    names = {module: key for key, module in model.named_modules()}
    jobs = [(None, None, OUTER if module is head else kind, key, module.out_features, module.in_features)
            for key, module in model.named_modules() if type(module) is torch.nn.Linear and _fits(module)]
    notices = [f"{key} ({module.out_features}x{module.in_features}) stays dense: the kernels take outputs in "
               f"multiples of {q4.OUT} and inputs of {q4.GROUP}"
               for key, module in model.named_modules() if type(module) is torch.nn.Linear and not _fits(module)]
    arrays: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    places = quantized.tiles_in_one_allocation(jobs)
    table = None  # the embedding's blocks, also a tied output layer's
    if type(embedding) is torch.nn.Embedding and embedding.embedding_dim % q4.GROUP == 0:
        table = blocks_of(embedding.weight, OUTER)
        arrays[f"{names[embedding]}.blocks"] = torch.from_numpy(table)
    status = progress(f"Quantizing the weights of {name} to {kind} (one time)") if progress else nullcontext()
    with status, torch.no_grad():
        for _, _, each, key, rows, cols in jobs:
            linear = model.get_submodule(key)
            tied = table is not None and linear is head and linear.weight is embedding.weight
            data = table if tied else blocks_of(linear.weight, each)
            try:
                buffers = quantized.kernel_form(each, data, rows, cols, lambda rows=rows: np.arange(rows),
                                                places.get(key))
            except ValueError as exc:  # Q4Error, Q8Error, Int4Error (scales that are not finite)
                notices.append(f"{key} stays dense: {' '.join(str(exc).split())}")
                continue
            arrays.update({f"{key}.{buffer}": value for buffer, value in buffers.items()})
            kinds[key] = each
            if not tied:  # the dense weight goes now (a tied one is the embedding's, which goes below)
                linear.weight = torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    return joined.join_in_place(arrays), kinds, notices


def apply(model, kind: str, checkpoint: tuple[str, str] | None, kernels: Path, dtype: torch.dtype,
          progress: Callable[[str], AbstractContextManager] | None = None, name: str = "the model") -> quantized.Applied:
    """Put `model`'s (read in the checkpoint's dtype, on the CPU) Linear weights and token embedding
    on ladechat's kernels as `kind` blocks (KINDS' values), the rest in `dtype`. `checkpoint`: its
    folder and its files as text, which key the kept layout (None: not kept, quantized at each
    load). QuantizeError where ladechat's kernels do not run here."""
    from gguf import GGMLQuantizationType

    from ladechat.engine.kernels.embedding import BlockEmbedding
    from ladechat.engine.load.gguf import kept

    unbuilt = q4.load(kernels, progress)
    if unbuilt or q4.best_path() < 1:
        why = unbuilt or "this CPU has no AVX2 (the kernels' portable loops are slower than dense weights)"
        raise QuantizeError(f"--quantize runs on ladechat's CPU kernels, which cannot run here: {why}")
    path = cache_file(checkpoint, kind) if checkpoint is not None else None
    if path is not None and path.is_file() and kept.whole(path):
        meta, keys, get = kept.read(path)
        kinds, notices = json.loads(meta["kinds"]), json.loads(meta["notices"])
    else:
        arrays, kinds, notices = quantize(model, kind, progress, name)
        keys, get = set(arrays), arrays.__getitem__
        why = "no local folder names its files" if path is None else _keep(path, arrays, kinds, notices, kind)
        if why:
            notices.append(f"the quantized weights of {name} are not kept ({why}): each load quantizes them again")
    embedding = model.get_input_embeddings()
    table = next((key for key in keys if key.endswith(".blocks")), None)
    applied = quantized.replace_linears(model, joined.KeptReader(get, keys, model), kinds, list(notices), q4.best_path(), [])
    if applied.replaced < len(kinds):  # a kept file that does not fit the model (it stays whole and correct)
        applied = replace(applied, notices=(*applied.notices, f"{len(kinds) - applied.replaced} Linear weights of "
                                            f"{name} run dense: the layout kept in {path} does not fit them"))
    if table is not None and tuple(get(table).shape) == (embedding.num_embeddings,
                                                         embedding.embedding_dim // q4.GROUP * q8.BLOCK_BYTES):
        model.set_input_embeddings(BlockEmbedding(get(table).numpy(), GGMLQuantizationType.Q8_0,
                                                  embedding.embedding_dim, dtype))
    _cast_rest(model, dtype)
    return applied


def _keep(path: Path, arrays: dict, kinds: dict, notices: list[str], kind: str) -> str | None:
    """Keep the layout at `path` (written meanwhile, kept.keep_beside_meanwhile); why not, where the
    cache folder cannot be made."""
    from ladechat.engine.load.gguf import kept

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    kept.keep_beside_meanwhile(path, arrays, {"kinds": json.dumps(kinds), "notices": json.dumps(notices)},
                               f"{PREFIX}{kind}-*.safetensors")
    return None


def _cast_rest(model, dtype: torch.dtype) -> None:
    """The parameters the kernels do not hold (norms, biases, a dense embedding) in `dtype`, one by
    one (the kernels' modules refuse a cast of the whole model), and the float buffers (RoPE's
    frequencies, Gemma's embedding scale) as a model built in `dtype` makes them: read in the
    checkpoint's bf16 they were computed in bf16 (Gemma's sqrt(hidden) 12.625 for 12.649)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype and not param.is_meta:
                module._parameters[key] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
    model.config.dtype = dtype
    if not any(buffer.is_floating_point() and buffer.dtype != dtype for module in model.modules()
               if not isinstance(module, BlockLinear) for buffer in module.buffers(recurse=False)):
        return  # none was made in another dtype (a Llama's RoPE frequencies are fp32 already)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers made
        fresh = dict(AutoModelForCausalLM.from_config(model.config, dtype=dtype).named_buffers())
    for key, buffer in list(model.named_buffers()):
        made = fresh.get(key)
        if made is not None and buffer.is_floating_point() and made.shape == buffer.shape:
            parent, _, leaf = key.rpartition(".")
            model.get_submodule(parent)._buffers[leaf] = made
