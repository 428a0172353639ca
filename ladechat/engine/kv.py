"""The KV cache across steps: keep what was accepted, drop the rest, never recompute.

Three kinds of cache hold the same committed sequence:
- RowsCache (a model's own steps, engine/models/) and GrowingCache (transformers' forward, a
  DynamicCache of the same layers): each layer's Rows grow with every step, into buffers with
  room to spare rather than by concatenation (cheaper steps, measured: BENCHMARKS.md); dropping
  rows means slicing the tensors shorter.
- StaticCache: pre-allocated to a fixed length (for compiled / CUDA-graph steps); its tensors
  never move, so dropping rows only moves the write position back, and kept rows are gathered
  in place. Slots past the write position hold junk that the step's mask never shows.
  Once its layers exist, an eager runner's are packed (pack_static): every layer's keys and
  values become views of one tensor and every layer's length a view of one vector, so a commit is
  one gather, one copy and one fill for the whole model instead of five kernels per layer (on a
  GPU, ~160 launches a step for a 32-layer model, each costing more than the work it does). A
  compiled runner's are not: views of one tensor that a graph writes are aliased graph inputs,
  for which torch gives up CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicLayer


def cache_argument(model) -> str:
    """The keyword under which the model's forward takes the KV cache: `cache` since transformers
    5.24, which deprecates `past_key_values` (removed in 5.40) with a warning a user would see on
    every answer; `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Rows:
    """A layer's keys and values as views of buffers with room to spare: a step writes its rows
    after the committed ones instead of concatenating (transformers' DynamicLayer copies the whole
    layer's cache every step: 60 copies a step for a 30-layer model, growing with the
    conversation). Full buffers grow by half (room for half as much again: amortized copies
    without doubling a long prompt's cache). `keys` and `values` (batch, heads, positions, dim)
    are the filled part: cutting them shorter (truncate, commit_kv) is all dropping rows takes,
    and the next step writes after what they hold."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.keys, self.values = keys, values
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values with these rows appended."""
        held, keys, values = self.room(key_states.shape[-2], key_states, value_states)
        end = held + key_states.shape[-2]
        keys[..., held:end, :] = key_states
        values[..., held:end, :] = value_states
        return self.filled(end)

    def room(self, rows: int, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None
             ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(positions held, the key buffer, the value buffer), the buffers with room for `rows`
        more positions after the held ones: for a step's keys and values written in place (the
        Llama step's rope_kv kernel), then filled(). New buffers are shaped like key_states and
        value_states (default: the layer's own keys and values, 4-D, empty or not)."""
        held = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
        end = held + rows
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            like = (self.keys, self.values) if key_states is None else (key_states, value_states)
            self._buffers = tuple(self._room_for(end, new, old) for new, old in zip(like, (self.keys, self.values)))
        return held, *self._buffers

    def filled(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values: its buffers' first `end` positions."""
        keys, values = self._buffers
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    @staticmethod
    def _room_for(length: int, new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        batch, heads, _, dim = new.shape
        buffer = new.new_empty((batch, heads, max(length + length // 2, GROWING_MIN), dim))
        if old is not None and old.dim() == 4:
            buffer[..., : old.shape[-2], :] = old
        return buffer


class RowsCache:
    """The KV cache of a model that runs its own steps (engine/models/): one Rows per layer, made
    empty up front for the model's key/value heads, so a step writes every layer in place, by
    whatever call computes its keys, with no first-write set-up. kv's other functions (commit_kv,
    truncate, cache_length, repeat_to) take it as they take transformers' caches."""

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        empty = {"size": (1, heads, 0, dim), "dtype": dtype, "device": device}
        self.layers = [Rows(torch.empty(**empty), torch.empty(**empty)) for _ in range(layers)]


class GrowingLayer(Rows, DynamicLayer):
    """Rows as a transformers cache layer (made lazily as transformers' forward reaches it): the
    cache of transformers' forward on exact-size steps (DynamicRunner)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.write(key_states, value_states)

    def reset(self) -> None:
        self._buffers = None
        super().reset()


GROWING_MIN = 256  # positions a layer's first buffers hold


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers (lazily, one per layer as the forward pass reaches it)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def repeat_to(cache, length: int) -> bool:
    """Lengthen every layer of a RowsCache or GrowingCache to `length` positions by repeating the positions it
    holds: a long context to time steps after, without the prefill that would compute one (a
    step's cost follows how many positions it attends over, not what they hold). False, and the
    cache as it was, for any other cache or an empty one."""
    layers = getattr(cache, "layers", None) or []
    if not layers or not all(isinstance(layer, Rows) and layer.keys is not None and layer.keys.numel()
                             for layer in layers):
        return False
    with torch.inference_mode():
        for layer in layers:
            held = layer.keys.shape[-2]
            if held >= length:
                continue
            _, keys, values = layer.room(length - held)
            for start in range(held, length, held):
                count = min(held, length - start)
                keys[..., start : start + count, :] = keys[..., :count, :]
                values[..., start : start + count, :] = values[..., :count, :]
            layer.filled(length)
    return True


def new_cache() -> DynamicCache:
    # Plain full-attention layers: lookahead passes its own 4D mask, so every layer sees the
    # same explicit mask and the cache must keep every position the mask can point at.
    return GrowingCache()


def new_static_cache(config, length: int) -> StaticCache:
    return StaticCache(config=config, max_cache_len=length)


def grow_static(cache: StaticCache, config, length: int, committed: int) -> StaticCache:
    """A longer static cache holding the same first `committed` positions (the old one is dropped)."""
    bigger = new_static_cache(config, length)
    with torch.inference_mode():
        for old, new in zip(cache.layers, bigger.layers, strict=True):
            if getattr(old, "keys", None) is None or not old.keys.numel():
                continue
            new.lazy_initialization(old.keys[..., :1, :], old.values[..., :1, :])
            new.keys[..., :committed, :] = old.keys[..., :committed, :]
            new.values[..., :committed, :] = old.values[..., :committed, :]
            new.cumulative_length.fill_(committed)
    return bigger


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: lookahead needs per-layer keys/values")
    return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def _is_static(layer) -> bool:
    return hasattr(layer, "cumulative_length") and hasattr(layer, "max_cache_len")


def cache_length(cache) -> int:
    layers = _layers(cache)
    if not layers:
        return 0
    if _is_static(layers[0]):
        return int(layers[0].cumulative_length)
    return layers[0].keys.shape[-2]


def truncate(cache, length: int, packed: PackedStatic | None = None) -> None:
    """Keep the first `length` positions of every layer (layers a broken step left longer, too).
    `packed`: the cache's layers packed (pack_static), whose lengths are reset in one go."""
    with torch.inference_mode():  # a static cache's tensors were made in inference mode
        if packed is not None:
            packed.lengths.fill_(length)
            return
        for layer in _layers(cache):
            if _is_static(layer):
                layer.cumulative_length.fill_(length)
            elif layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def commit_kv(cache, past: int, keep_rows: list[int], appended: int | None = None,
              packed: PackedStatic | None = None) -> None:
    """After a step that appended `appended` rows at `past`, keep only `keep_rows` (strictly
    ascending, row 0 first: the kernel that moves them on the CPU refuses any other order).
    `packed`: the cache's layers packed (pack_static), gathered in one go.

    Accepted rows are gathered down to past, past+1, ... so the cache again holds exactly the
    committed sequence. When the kept rows are already a prefix, this is a plain crop, and when they
    are every row appended (a plain step) nothing at all: on a GPU, resetting a static cache's
    length costs a kernel launch per layer, every step.
    """
    kept = len(keep_rows)
    if appended is not None and kept == appended:
        return
    if keep_rows != list(range(kept)):
        with torch.inference_mode():  # the forward pass made these inference tensors
            if packed is not None:  # every layer's keys and values in one tensor: one gather
                index = torch.tensor([past + row for row in keep_rows], device=packed.states.device)
                packed.states[..., past : past + kept, :] = packed.states.index_select(-2, index)
            elif _moves_rows_on_host(layers := _layers(cache)):  # one call for every layer
                torch.ops.ladechat_step.keep_rows([s for layer in layers for s in (layer.keys, layer.values)],
                                                  past, keep_rows)
            else:
                indices: dict[torch.device, torch.Tensor] = {}  # one copy per device (layers may be spread)
                for layer in layers:
                    device = layer.keys.device
                    if device not in indices:
                        indices[device] = torch.tensor([past + row for row in keep_rows], device=device)
                    index = indices[device]
                    for states in (layer.keys, layer.values):
                        states[..., past : past + kept, :] = states.index_select(-2, index)
    truncate(cache, past + kept, packed)


def _moves_rows_on_host(layers) -> bool:
    """Whether ladechat's keep_rows kernel (step_ops.cpp, loaded with a model on the CPU) can move
    these layers' rows: every layer on the CPU."""
    from ladechat.engine.kernels import step_ops

    return step_ops.loaded() and all(layer.keys.device.type == "cpu" for layer in layers)


@dataclass(frozen=True)
class PackedStatic:
    """A static cache's layers in two tensors: states (layers, 2, batch, heads, length, dim), with
    states[i, 0] and states[i, 1] layer i's keys and values, and lengths (layers,), whose element i
    is layer i's write position (transformers advances each layer's own, in place)."""

    states: torch.Tensor
    lengths: torch.Tensor


def pack_static(cache) -> PackedStatic | None:
    """Move every layer of an initialised static cache into one PackedStatic (the layers keep
    working as before, on views of it). None when that cannot be done: layers not all initialised
    or not all alike (then commit and truncate work layer by layer). While it runs, the packed
    copy and the layers' own tensors both exist: the first cache a runner fills is its smallest."""
    layers = _layers(cache)
    if not layers or len(layers) != len(cache.layers) or not all(_is_static(layer) for layer in layers):
        return None
    first = layers[0]
    if any(layer.keys.shape != first.keys.shape or layer.values.shape != first.keys.shape
           or layer.keys.dtype != first.keys.dtype or layer.keys.device != first.keys.device for layer in layers):
        return None
    with torch.inference_mode():  # the forward pass made the layers' tensors in inference mode
        packed = _allocate(len(layers), first.keys, first.keys.shape[-2])
        for i, layer in enumerate(layers):
            packed.states[i, 0].copy_(layer.keys)
            packed.states[i, 1].copy_(layer.values)
            packed.lengths[i] = layer.cumulative_length
            _attach(layer, packed, i)
    return packed


def grow_packed(packed: PackedStatic, config, length: int, committed: int) -> tuple[StaticCache, PackedStatic]:
    """grow_static for a packed cache: the longer cache is packed from the start, so growing holds
    the old cache and the new one, nothing more."""
    bigger = new_static_cache(config, length)
    with torch.inference_mode():
        new = _allocate(len(bigger.layers), packed.states[0, 0], length)
        for i, layer in enumerate(bigger.layers):
            # transformers' own initialisation (dtype, device, shapes), with the layer's own zeros
            # dropped at once for views of the packed tensor
            layer.lazy_initialization(new.states[i, 0, ..., :1, :], new.states[i, 1, ..., :1, :])
            _attach(layer, new, i)
        new.states[..., :committed, :] = packed.states[..., :committed, :]
        new.lengths.fill_(committed)
    return bigger, new


def _allocate(layers: int, like: torch.Tensor, length: int) -> PackedStatic:
    batch, heads, _, dim = like.shape
    states = torch.zeros((layers, 2, batch, heads, length, dim), dtype=like.dtype, device=like.device)
    return PackedStatic(states, torch.zeros(layers, dtype=torch.long, device=like.device))


def _attach(layer, packed: PackedStatic, i: int) -> None:
    layer.keys, layer.values, layer.cumulative_length = packed.states[i, 0], packed.states[i, 1], packed.lengths[i]
    # as transformers does for its own tensors: fixed addresses, so CUDA graphs may keep them
    for tensor in (layer.keys, layer.values, layer.cumulative_length):
        torch._dynamo.mark_static_address(tensor)
