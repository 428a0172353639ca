"""Sibling Linear modules' blocks kept as one tensor per buffer, so a model file's joint products
(llama.JOINED, linear.joint_product) are views of what was read, never copies of gigabytes.

A kept layout (a GGUF's or a quantized checkpoint's) holds each run of siblings of one form under
one key, `parent.q_proj+k_proj+v_proj.tiles`, their rows in order; KeptReader gives each module
its rows of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ladechat.engine.kernels.linear import side_by_side
from ladechat.engine.models.llama import JOINED


def run_key(parent: str, run: tuple[str, ...], buffer: str) -> str:
    return f"{parent}.{'+'.join(run)}.{buffer}"


def _form(buffers: dict[str, torch.Tensor]) -> tuple:
    """What siblings share to be kept as one: the same buffers, each of one dtype and shape but its rows."""
    return tuple(sorted((name, value.dtype, tuple(value.shape[1:])) for name, value in buffers.items()))


def runs(names: tuple[str, ...], form_of: Callable[[str], tuple | None]) -> list[tuple[str, ...]]:
    """The runs of two or more consecutive `names` of one form (form_of: None where a name is
    absent), left to right."""
    found, run = [], []
    for name in (*names, None):
        form = None if name is None else form_of(name)
        if run and (form is None or form != form_of(run[0])):
            if len(run) > 1:
                found.append(tuple(run))
            run = []
        if form is not None:
            run.append(name)
    return found


def join_in_place(arrays: dict[str, torch.Tensor], groups: Iterable[tuple[str, ...]] = JOINED) -> dict[str, torch.Tensor]:
    """`arrays` ({module.buffer: tensor}) with each run of siblings (groups: names under one parent
    that take the same input, in order) of one form kept as one tensor per buffer (run_key), the
    parts taken out as each is joined: a caller that holds no other reference to them has one
    run's weights twice at most, not all."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        module, _, buffer = key.rpartition(".")
        modules.setdefault(module, {})[buffer] = value
    for parent in sorted({module.rpartition(".")[0] for module in modules}):
        for names in groups:
            def form_of(name: str, parent: str = parent) -> tuple | None:
                buffers = modules.get(f"{parent}.{name}")
                return None if buffers is None else _form(buffers)

            for run in runs(names, form_of):
                for buffer in sorted(modules[f"{parent}.{run[0]}"]):
                    parts = [arrays.pop(f"{parent}.{name}.{buffer}") for name in run]
                    whole = side_by_side(parts)
                    arrays[run_key(parent, run, buffer)] = torch.cat(parts) if whole is None else whole
    return arrays


class KeptReader:
    """Modules' buffers from a kept layout, get(key) reading its keys: a module's own tensor, or
    where join_in_place kept its run together, a view of its rows of the run's tensor, read once
    for the run. `model`: its Linear modules (of any kind) give each part's share of the rows."""

    def __init__(self, get: Callable[[str], torch.Tensor], keys, model: torch.nn.Module,
                 groups: Iterable[tuple[str, ...]] = JOINED) -> None:
        self._get, self._keys, self._model, self._groups = get, set(keys), model, tuple(groups)
        self._wholes: dict[str, torch.Tensor] = {}

    def __call__(self, module: str, buffer: str) -> torch.Tensor:
        key = f"{module}.{buffer}"
        if key in self._keys:
            return self._get(key)
        parent, name = module.rsplit(".", 1)
        for names in self._groups:
            if name not in names:
                continue
            for start in range(len(names)):
                for end in range(start + 2, len(names) + 1):
                    run = names[start:end]
                    if name in run and run_key(parent, run, buffer) in self._keys:
                        return self._part(parent, run, name, buffer)
        raise KeyError(key)

    def _part(self, parent: str, run: tuple[str, ...], name: str, buffer: str) -> torch.Tensor:
        key = run_key(parent, run, buffer)
        if key not in self._wholes:
            self._wholes[key] = self._get(key)
        whole = self._wholes[key]
        outputs = [self._model.get_submodule(f"{parent}.{each}").out_features for each in run]
        # each part's rows are its outputs times one factor (1, or 1/16 for tiles of 16 outputs)
        before, total = sum(outputs[: run.index(name)]), sum(outputs)
        rows = whole.shape[0]
        return whole[rows * before // total : rows * (before + outputs[run.index(name)]) // total]
