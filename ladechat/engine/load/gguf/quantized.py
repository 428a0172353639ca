"""A GGUF file's quantized Linear weights read once into ladechat's kernels' layout and kept:
Q4_0, Q4_1 and Q4_K (q4.py, or torch's int4 kernel where no compiler builds ladechat's: int4.py),
Q5_0, Q5_1 and Q5_K (q4.py's 5-bit tiles), Q6_K (q6.py), Q8_0 (q8.py; a Q8_0 output layer is
head.py's), and F16 and BF16 weights as they are (half.py).

Each tensor is read from the file as it is (a memory map of its bytes, header.py, unmapped once
read; no dequantized copy) in the precision the file holds it, its rows in the model's own order
(llama.cpp permutes the rows of q and k, and transformers' GGUF tensor processor says how). Everything else (norms, attention, the residual stream) stays in the
model's dtype, and tensors of other types (Q2_K, Q3_K, IQ4_XS, ...) keep the path they had:
dense, packed for oneDNN where that applies.

The kernels compute each row on its own, in the same order whatever the step's size; SDPA's rows
depend in fp32's last bits on how many rows and masked keys a step has, so where ladechat's kernels
load, model loading also switches attention to its row-wise kernel (attention.py): a lookahead
answer on these weights is then plain decoding's, token for token, where every Linear is such
blocks (tests/test_int4.py, tests/kernels/test_q6.py).

Reading a GGUF's metadata takes seconds on a small CPU, so the first load writes the blocks in the
kernels' layout into one file in the GGUF's cache folder (kept.py), named for the code that reads
and lays them out; later loads only read it. The model's code is untouched: Linear modules are
replaced, as transformers' quantizers do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ladechat.engine.kernels import attention, half, int4, native, q4, q6, q8
from ladechat.engine.kernels.int4 import Int4Error, Int4Linear, check_shape
from ladechat.engine.load.progress import Report, sized
from ladechat.engine.load import joined
from ladechat.engine.models.llama import JOINED

# the GGUF block types ladechat's kernels run at their own bits
BLOCK_KINDS = (*q4.KINDS, *q4.FIVE_BIT_KINDS, "Q6_K", "Q8_0", *half.KINDS)
LIBRARY_ONLY = (*q4.FIVE_BIT_KINDS, *half.KINDS)  # no torch kernel takes these: dense without ladechat's
CACHE_PREFIX = "int4-"


# -- reading a GGUF file once ------------------------------------------------------------------

def cache_path(folder: Path) -> Path:
    """The file of a GGUF's 4-bit weights in q4.py's layout (in its cache folder), named for the code that
    reads and lays them out (a change to either is read afresh)."""
    from ladechat.paths import source_digest

    readers = (__file__, joined.__file__, q4.__file__, q6.__file__, q8.__file__, half.__file__, q4.SOURCE)  # SOURCE: gguf_tiles
    return Path(folder) / f"{CACHE_PREFIX}{source_digest(*readers)}.safetensors"


def read_gguf(gguf_path: Path, model, folder: Path, report: Report | None = None
              ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """The kernels' form of every BLOCK_KINDS tensor of `gguf_path` that is a plain Linear weight of
    `model` (built from the file's config, its weights empty or not), a Q8_0 output layer aside:
    ({module.buffer: q4.layout's tiles/scales/lows, q6.layout's tiles/d, q8.kernel_layout's
    tiles/scales or half.py's halves}, notices, {module: block type}). A tensor
    that cannot run so keeps its dense weight, with a notice when that is a surprise (a corrupt
    block, rows transformed on loading), none for the types that have no kernel. report(done,
    total): the blocks' bytes laid out so far."""
    from ladechat.engine.load.gguf import files as gguf_files

    index = gguf_files.tensor_index(model, gguf_path, folder)  # its names: transformers' map takes seconds
    reader = gguf_files.read(gguf_path)
    processor = gguf_files.tensor_processor(index["arch"], model.config.to_dict())
    names = {where["name"]: name for name, where in index["tensors"].items()}
    arrays: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    notices: list[str] = []
    head = model.get_output_embeddings()
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    tied = gguf_files.output_tensor(reader, model.config) if "output.weight" not in by_name else None
    if tied is not None and type(head) is torch.nn.Linear:
        # the output layer is the input embedding's blocks, whichever kernel's they are (q8.py takes a Q8_0 one)
        names = {**names, "output.weight": next(key for key, module in model.named_modules() if module is head)
                 + ".weight"}
        by_name["output.weight"] = tied
    jobs = []  # (name, tensor, kind, module, rows, cols) in the file's order
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
        if type(linear) is not torch.nn.Linear or (kind == "Q8_0" and linear is head):  # head.apply takes that
            continue
        jobs.append((name, tensor, kind, module_name, linear.out_features, linear.in_features))
    places = tiles_in_one_allocation(jobs)
    total, done = sum(int(job[1].n_bytes) for job in jobs), 0
    for name, tensor, kind, module_name, rows, cols in jobs:
        if report is not None:
            report(done, total)
        done += int(tensor.n_bytes)
        try:
            buffers = kernel_form(kind, np.asarray(tensor.data), rows, cols,
                                  lambda: gguf_files.row_order(processor, tensor.name, rows),  # noqa: B023 (called at once)
                                  places.get(module_name))
        except (Int4Error, q4.Q4Error, q6.Q6Error, q8.Q8Error, half.HalfError) as exc:
            notices.append(f"{name} ({kind}) runs dense: {exc}")
            continue
        arrays.update({f"{module_name}.{buffer}": value for buffer, value in buffers.items()})
        kinds[module_name] = kind
    return arrays, notices, kinds


def tiles_in_one_allocation(jobs) -> dict[str, torch.Tensor]:
    """{module: where its tiles go}, for the tensors gguf_tiles lays out: parts of one allocation
    (kept.weights_memory, as a later load reads them into), each sibling group's
    (llama.JOINED) one after another, so joining them is a view rather than a copy of gigabytes."""
    tiled = [(module, kind, rows, cols) for _, _, kind, module, rows, cols in jobs
             if kind in q4.TILED_KINDS and rows % q4.OUT == 0 and cols % q4.GROUP == 0]
    if not tiled or not q4.loaded():
        return {}

    def placed(job) -> tuple:
        parent, _, name = job[0].rpartition(".")
        group = next((i for i, names in enumerate(JOINED) if name in names), len(JOINED))
        return parent, group, JOINED[group].index(name) if group < len(JOINED) else 0, name

    tile_bytes = {"Q6_K": q6.TILE_BYTES, **dict.fromkeys(q4.FIVE_BIT_KINDS, q4.FIVE_BIT_TILE_BYTES)}
    sizes = {module: rows // q4.OUT * (cols // q4.GROUP) * tile_bytes.get(kind, q4.TILE_BYTES)
             for module, kind, rows, cols in tiled}
    from ladechat.engine.load.gguf.kept import weights_memory

    whole = weights_memory(sum(sizes.values()))
    places, start = {}, 0
    for module, *_ in sorted(tiled, key=placed):
        places[module] = whole[start : start + sizes[module]]
        start += sizes[module]
    return places


def kernel_form(kind: str, data: np.ndarray, rows: int, cols: int, order_of,
                into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A tensor's blocks in its kernel's layout, its rows in the model's order (order_of(): the GGUF
    row of each, or None when loading does more than reorder them); gguf_tiles' tiles written
    `into` where given."""
    if kind in q4.TILED_KINDS and q4.loaded():
        return _tiled_form(kind, data, rows, cols, order_of, into)
    if kind in half.KINDS:  # the weights as they are, in the model's row order
        half.check_shape(rows, cols)
        order = _model_order([], rows, order_of)
        halves = half.decode(kind, data, rows, cols, order)
        return dict(zip(half.BUFFERS, (halves,), strict=True))
    if kind == "Q6_K":
        q6.check_shape(rows, cols)
        parts = q6.decode(data, rows, cols)
    elif kind == "Q8_0":
        q8.check_shape(rows, cols)
        parts = q8.decode(data, rows, cols)
    else:
        (q4.check_shape if kind in q4.FIVE_BIT_KINDS else check_shape)(rows, cols)
        parts = q4.decode_compact(kind, data, rows, cols)
    order = _model_order(parts, rows, order_of)
    if order is not None:  # the rest as they are, no copy
        parts = [part[order] for part in parts]
    parts = [torch.from_numpy(np.ascontiguousarray(part)) for part in parts]
    if kind == "Q6_K":
        return dict(zip(q6.BUFFERS, q6.layout(*parts), strict=True))
    if kind == "Q8_0":
        return dict(zip(q8.BUFFERS, q8.kernel_layout(*parts), strict=True))
    if kind in q4.D_FACTORS:
        return dict(zip(q4.BUFFERS, q4.layout_d(parts[0], parts[1], kind), strict=True))
    lay = q4.layout_k if kind in q4.K_FORMS else q4.layout
    return dict(zip(q4.BUFFERS, lay(*parts, five_bit=kind in q4.FIVE_BIT_KINDS), strict=True))


def _model_order(parts, rows: int, order_of) -> np.ndarray | None:
    """The GGUF row of each of the model's rows where loading reorders them (llama.cpp's q and k),
    None where it keeps them. Int4Error for a tensor that cannot run on its kernel: scales (the
    float parts) that are not finite, rows transformed on loading beyond reordering."""
    if not all(np.isfinite(part).all() for part in parts if part.dtype.kind == "f"):
        raise Int4Error("some of its scales are not finite numbers (a corrupt block)")
    order = order_of()
    if order is None:
        raise Int4Error("its rows are transformed on loading, not only reordered")
    return None if np.array_equal(order, np.arange(rows)) else order


def _tiled_form(kind: str, data: np.ndarray, rows: int, cols: int, order_of,
                into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """kernel_form's result, the tiles made by the library (q4.gguf_tiles) from the blocks, in
    the model's row order."""
    if kind == "Q6_K":
        q6.check_shape(rows, cols)
        parts = [q6.d_of(data, rows, cols)]
    else:
        (q4.check_shape if kind in q4.FIVE_BIT_KINDS else check_shape)(rows, cols)
        parts = list(q4.compact_scales(kind, data, rows, cols))
    order = _model_order(parts, rows, order_of)
    if order is not None:
        parts = [part[order] for part in parts]
    tiles = q4.gguf_tiles(kind, data, rows, cols, order, into)
    # the per-tile forms of q4.per_tile in numpy: torch's copies wait at a barrier per small tensor
    # on a busy machine, and these are ~200 tensors of a few MB
    tiled = [_per_tile(part) for part in parts]
    if kind == "Q6_K":
        scales = (q6.fp16_d(tiled[0]),)  # the file's fp16 d
    elif kind in q4.K_FORMS:
        scales = q4.pack_k(*tiled)
    elif kind in q4.D_FACTORS:  # the low is d times -8 or -16: the kernel makes it, exactly
        scales = q4.d_form(tiled[0], kind)
    else:
        fp16 = all(part.dtype == np.float16 for part in tiled)
        scales = tuple(part.astype(np.float16 if fp16 else np.float32) for part in tiled)
    buffers = q6.BUFFERS if kind == "Q6_K" else q4.BUFFERS
    return dict(zip(buffers, (tiles, *(torch.from_numpy(np.ascontiguousarray(part)) for part in scales)), strict=True))


def _per_tile(values: np.ndarray) -> np.ndarray:
    """q4.per_tile: per-row values (N, G) -> (N / 16, G, 16)."""
    rows, groups = values.shape
    return np.ascontiguousarray(values.reshape(rows // q4.OUT, q4.OUT, groups).transpose(0, 2, 1))


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
    where it cannot be built (a one-line notice) or `kernels` is None; and those of Q5_0/Q5_1/Q5_K,
    Q6_K, Q8_0, F16 and BF16 weights by a Q4Linear (5-bit tiles), q6.Q6Linear, q8.Q8Linear or
    half.HalfLinear where ladechat's kernels run (else they stay dense). The first time reads the
    GGUF (seconds) and keeps the kernels' form in `folder`. A file that cannot be read leaves the
    model as it is, with a one-line notice."""
    from ladechat.engine.load.gguf import files as gguf_files
    from ladechat.engine.load.gguf import kept

    kernel_notices, path_here = kernel_path(gguf_path, kernels, progress, compiler)
    path = cache_path(folder)
    if not (path.is_file() and kept.whole(path)):  # a file cut short (a full disk, a crash): read afresh
        title = f"Laying out the quantized blocks of {Path(gguf_path).name} (one time)"
        status = progress(title) if progress else nullcontext()
        with status as update:
            try:
                # a corrupt block's NaN or inf scales are found and refused one by one (a notice
                # each), not numpy's warnings on the way
                with np.errstate(all="ignore"):
                    arrays, notices, kinds = read_gguf(Path(gguf_path), model, Path(folder), sized(update, title))
                arrays = joined.join_in_place(arrays)  # q/k/v and gate/up kept together: one product each in a step
            except (ValueError, KeyError, IndexError, OSError, EOFError, gguf_files.BadGGUF) as exc:
                detail = " ".join(str(exc).split()) or type(exc).__name__
                notice = f"cannot read the 4-bit blocks of {Path(gguf_path).name} ({detail}); running its dense weights"
                return Applied(0, (), (notice,))
            meta = {"notices": json.dumps(notices), "kinds": json.dumps(kinds)}
            # a read-only cache: read again next time
            kept.keep_beside_meanwhile(path, arrays, meta, f"{CACHE_PREFIX}*.safetensors")
            # what was kept, from memory (read back, it would be in memory twice for a while)
            return replace_linears(model, joined.KeptReader(arrays.__getitem__, arrays, model), kinds, notices,
                                   path_here, kernel_notices)
    meta, keys, get = kept.read(path)
    kinds, notices = json.loads(meta.get("kinds", "{}")), json.loads(meta.get("notices", "[]"))
    return replace_linears(model, joined.KeptReader(get, keys, model), kinds, notices, path_here, kernel_notices)


def kernel_path(gguf_path: Path, kernels: Path | None, progress, compiler: str) -> tuple[list[str], int | None]:
    """(notices, the path of ladechat's kernel that runs here, or None for torch's kernel)."""
    if kernels is None:
        return [], None
    unbuilt = q4.load(kernels, progress, compiler)
    if unbuilt:
        return [f"the 4-bit weights of {Path(gguf_path).name} run on torch's int4 kernel: {unbuilt}"], None
    if q4.best_path() < 1:  # an x86-64 CPU without AVX2, FMA and F16C: the portable loops are slower than torch's
        return [], None
    return [], q4.best_path()


def replace_linears(model, read: joined.KeptReader, kinds: dict[str, str], notices: list[str],
             path: int | None, kernel_notices: list[str]) -> Applied:
    """Put in the kept blocks (read(module, buffer)): Q4Linear on ladechat's kernel's `path`, or
    (None) Int4Linear (then `kernel_notices` say why, where any module was replaced)."""
    count = 0
    with torch.no_grad():
        for name, kind in kinds.items():
            linear = model.get_submodule(name)
            if type(linear) is not torch.nn.Linear:
                continue
            if kind in ("Q6_K", "Q8_0", *LIBRARY_ONLY) and path is None:
                continue  # torch has no kernel for these blocks: the tensor is read dense
            if kind in half.KINDS:
                module = half.HalfLinear(read(name, half.BUFFERS[0]), linear.bias, path)
                if module.out_features == linear.out_features and module.in_features == linear.in_features:
                    model.set_submodule(name, module)
                    count += 1
                continue
            if kind in ("Q6_K", "Q8_0"):
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
    from ladechat.engine.kernels.norms import NativeRMSNorm
    from ladechat.engine.kernels.q8 import Q8Linear
    from ladechat.engine.load.packing import PackedLinear

    counts = {"q4": 0, "q6_k": 0, "int4": 0, "q8_0": 0, "half": 0, "packed": 0, "dense": 0, "norm": 0}
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
        elif type(module) is half.HalfLinear:
            counts["half"] += 1
        elif type(module) is PackedLinear:
            counts["packed"] += 1
        elif isinstance(module, torch.nn.Linear):
            counts["dense"] += 1
    return ",".join(f"{k}:{v}" for k, v in counts.items() if v) or "none"


def describe(model) -> str:
    """The Linear weights and their kernels in words (for the banner, /show and --debug); empty for
    a model whose Linear modules are all as transformers loads them."""
    from ladechat.engine.kernels.embedding import BlockEmbedding
    from ladechat.engine.kernels.norms import NativeRMSNorm
    from ladechat.engine.kernels.q8 import Q8Linear
    from ladechat.engine.load.packing import PackedLinear

    ours = [m for m in model.modules() if type(m) is q4.Q4Linear]
    six = [m for m in model.modules() if type(m) is q6.Q6Linear]
    on_torch = [m for m in model.modules() if type(m) is Int4Linear]
    q8_0 = [m for m in model.modules() if type(m) is Q8Linear]
    sixteen = [m for m in model.modules() if type(m) is half.HalfLinear]
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
    if on_torch:
        kinds = "/".join(sorted({m.kind for m in on_torch}))
        parts.append(f"{len(on_torch)} Linear int4 from {kinds} blocks (torch {int4.KERNEL}, bf16 activations)")
    head = model.get_output_embeddings()
    if any(m is not head for m in q8_0):
        paths = "/".join(sorted({q4.PATHS[m.path] for m in q8_0 if m is not head}))
        count = sum(m is not head for m in q8_0)
        parts.append(f"{count} Linear from Q8_0 blocks (ladechat's {paths} kernel, int8 activations)")
    if sixteen:
        kinds = "/".join(sorted({m.kind for m in sixteen}))
        paths = "/".join(sorted({q4.PATHS[m.path] for m in sixteen}))
        parts.append(f"{len(sixteen)} Linear from {kinds} weights as they are (ladechat's {paths} kernel, fp32 activations)")
    if head in q8_0:
        parts.append(f"the output layer from Q8_0 blocks (ladechat's {q4.PATHS[head.path]} kernel)")
    if packed:
        dtype = str(packed[0].packed_weight.dtype).removeprefix("torch.")
        parts.append(f"{len(packed)} packed {dtype} (oneDNN)")
    embedding = model.get_input_embeddings()
    if type(embedding) is BlockEmbedding:
        parts.append(f"the token embedding as {embedding.kind.name} blocks (rows dequantized when looked up)")
    if parts and dense:
        parts.append(f"{dense} dense")
    norms = sum(type(m) is NativeRMSNorm for m in model.modules())
    if norms:
        parts.append(f"{norms} RMSNorm by ladechat's kernel")
    if getattr(model.config, "_attn_implementation", None) == attention.ROWWISE:
        parts.append("attention row by row (ladechat's kernel)")
    return ", ".join(parts)
