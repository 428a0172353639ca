"""How a step's rows reach the model and its KV cache: exact-size steps, or fixed-size ones.

DynamicRunner: the cache grows and shrinks and each step feeds exactly its rows. Right for a
CPU, where every extra row costs and the planner sizes steps to the token.
ModelRunner: DynamicRunner for a model that owns its prefill and steps (engine/models/llama.py:
the Llama family on a CPU), bitwise the logits of transformers' forward over the same modules
without its framework work. default_runner picks it for such a model, DynamicRunner elsewhere.
StaticRunner (--compile): a pre-allocated cache and steps padded to one fixed size, so a step has
the same shapes every time and torch.compile (CUDA graphs on a GPU) can capture it once. Plain
one-token decoding (lookahead off) gets the same treatment (its own one-row graph), so comparisons
of lookahead against plain decoding stay fair. Prefill runs eagerly (prompt lengths vary).
"""

from __future__ import annotations

import numpy as np
import torch

from ladechat.engine import kv
from ladechat.engine.config import ConfigError, LookaheadConfig
from ladechat.engine.draft.recycle import TOP_K
from ladechat.engine.kernels import step_ops
from ladechat.engine.layout import StepLayout, build_layout, fixed_step_inputs, rows_device, step_inputs
from ladechat.engine.load import packing

MAX_FIXED_STEP = 512  # rows; the static cache keeps this much room past the context
PREFILL_CHUNK = 512  # prompt tokens a part: an eager forward into a static cache (bounds the mask)
PREFILL_TOP_K = 512  # prompt tokens (the latest) whose top-k next tokens a prefill keeps
FIRST_LENGTH = 2048  # a static cache starts this long and doubles when a conversation outgrows it


def max_step_size(la: LookaheadConfig) -> int:
    """The most rows a full lookahead step can have: the window, pool n-grams, the likeliest
    textual nodes (a context candidate's worth per candidate, one more for the store) and the
    recycled nodes."""
    textual = la.context_candidates + (1 if la.store else 0)
    return la.window * (la.ngram - 1) + la.candidates * (la.ngram - 1) + textual * la.context_len + la.recycle


def top_k(logits: torch.Tensor) -> np.ndarray:
    """Each row's TOP_K likeliest next tokens, best first, on the host (one transfer): what a step
    keeps of its rows besides verification (the window's new guesses, the successor table). On
    the CPU by ladechat's kernel where it is loaded (step_ops.py; one pass a row, cheaper than
    torch.topk), which puts equal logits in index order, as argmax does; torch.topk
    orders them as it happens to (so at an exact tie of bf16 logits, greedy's pick can depend on
    whether the kernel could be built; plain and lookahead decoding always rank alike)."""
    k = min(TOP_K, logits.shape[-1])
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16) \
            and step_ops.loaded():
        return torch.ops.ladechat_step.top_k(logits.contiguous(), k).numpy()
    return logits.topk(k, dim=-1).indices.cpu().numpy()


def prefill_top_k(model, count: int, **inputs) -> np.ndarray:
    """A forward pass over prompt tokens that returns the top-k next tokens of its last `count`
    rows (for the successor table). Bounded so that a long prompt's logits never fill memory:
    the latest tokens, the current question, are the ones an answer most likely continues from."""
    with torch.inference_mode():
        return top_k(model(**inputs, use_cache=True, logits_to_keep=count).logits[0])


class DynamicRunner:
    fixed = False
    steps = ""  # what computes a step, when not the model's own forward (the chat's /show says)

    def __init__(self, model) -> None:
        self.model = model
        self.rows_device = rows_device(model)  # where a step's row indices go (fixed once loaded)
        self.cache_arg = kv.cache_argument(model)  # the forward's name for the KV cache
        self.cache = self.new_cache()
        self.appended = 0  # rows the last step wrote into the cache

    def new_cache(self):
        return kv.new_cache()

    def reset(self) -> None:
        self.cache = self.new_cache()

    def configure(self, lookahead: LookaheadConfig) -> None:
        pass

    def prefill(self, tokens: list[int], past: int, ranked: bool = True) -> np.ndarray:
        """Feed the prompt tokens; returns the top-k next tokens of the last
        min(len(tokens), PREFILL_TOP_K) of them (for the successor table), or of the last token
        only when not `ranked` (plain decoding has no use for them and should not pay for them)."""
        device = self.model.device
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(past, past + len(tokens), device=device).unsqueeze(0)
        count = min(len(tokens), PREFILL_TOP_K) if ranked else 1
        return prefill_top_k(self.model, count, input_ids=ids, position_ids=positions,
                             **{self.cache_arg: self.cache})

    def step(self, layout: StepLayout, past: int) -> torch.Tensor:
        """Logits (layout.size, vocab) of every row after feeding the step's tokens: verification
        reads the root's and the draft rows', and every row's top-k feeds the successor table."""
        device = self.model.device
        self.appended = layout.size
        with torch.inference_mode():
            if layout.size == 1:  # no mask needed: the one row sees everything committed
                out = self.model(input_ids=torch.tensor([layout.tokens], device=device),
                                 position_ids=torch.tensor([[past]], device=device),
                                 **{self.cache_arg: self.cache}, use_cache=True, logits_to_keep=1)
            else:
                ids, positions, mask = step_inputs(layout, past, self.model.dtype, device)
                out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                 **{self.cache_arg: self.cache}, use_cache=True,
                                 logits_to_keep=torch.arange(layout.size, device=self.rows_device))
        return out.logits[0]

    def commit(self, past: int, keep_rows: list[int]) -> None:
        kv.commit_kv(self.cache, past, keep_rows, self.appended)

    def grows_for(self, tokens: int) -> int | None:
        """The cache length a turn ending at `tokens` tokens makes reserve() grow to, or None when
        it needs no growing (a dynamic cache grows with every step, at no extra cost)."""
        return None

    def reserve(self, tokens: int, committed: int) -> None:
        """Make room for a turn ending at `tokens` tokens before it starts (see StaticRunner)."""

    def truncate(self, length: int) -> None:
        kv.truncate(self.cache, length)


class ModelRunner(DynamicRunner):
    """DynamicRunner for a model that runs its own prefill and steps (engine/models/: a Llama on
    the CPU) into its own cache (kv.RowsCache); commits and truncation are DynamicRunner's. It
    binds the model's modules as they are when it is made: make it after any change of them
    (packing.unpack, another attention), as Sessions do."""

    def __init__(self, model, rope_kernel: bool | None = None, gpu: bool = False) -> None:
        self.forward = model.bind(rope_kernel, gpu)
        super().__init__(model)
        self.steps = f"engine/models/{type(model).__name__.lower()}.py"

    def new_cache(self):
        return self.forward.new_cache()

    def prefill(self, tokens: list[int], past: int, ranked: bool = True) -> np.ndarray:
        count = min(len(tokens), PREFILL_TOP_K) if ranked else 1
        return np.concatenate([top_k(logits) for logits in self.forward.prefill(tokens, past, self.cache, count)])

    def step(self, layout: StepLayout, past: int) -> torch.Tensor:
        self.appended = layout.size
        return self.forward.step(layout, past, self.cache)

    def reserve(self, tokens: int, committed: int) -> None:
        # its cos/sin table grows before the turn, not inside a timed step (within the model's
        # context: a step past it still grows the table itself)
        self.forward.table(min(tokens, getattr(self.model.config, "max_position_embeddings", None) or tokens))


def default_runner(model) -> DynamicRunner:
    """The runner for exact-size steps: the model's own steps where it has them (a model of
    engine/models/, whose bind() gives them), else transformers' forward."""
    return ModelRunner(model) if callable(getattr(model, "bind", None)) else DynamicRunner(model)


COMPILED_GRAPHS = 64  # step graphs one model may compile: cache lengths x W/N/G settings (or lookahead off)


class CompiledForward:
    """The model's forward through torch.compile, one per model, shared by all its fixed-shape
    runners (the chat's, each bench method's): compiled graphs are cached per function, so
    separate torch.compile calls would compete for the same slots.

    dynamic=False: one graph per shape (the step at each cache length: the full one, or one row
    with lookahead off), no guards on sizes; on a GPU "reduce-overhead" also captures each as a
    CUDA graph. Past its limit torch would silently run new shapes eagerly (and a benchmark would
    call them compiled); here the limit is explicit, and reaching it is an error that says so.
    """

    def __init__(self, model, limit: int = COMPILED_GRAPHS) -> None:
        if packing.is_packed(model):  # load with LoadSpec(pack_weights=False), as --compile does
            raise ValueError("compiling needs the model's own Linear modules, not packed ones")
        self.gpu = model.device.type == "cuda"
        self.limit = limit
        self.fn = torch.compile(model.forward, dynamic=False, mode="reduce-overhead" if self.gpu else None)

    def __call__(self, **inputs):
        import torch._dynamo

        if self.gpu:
            own_cudagraph_state()
        try:
            with torch._dynamo.config.patch(recompile_limit=self.limit, fail_on_recompile_limit_hit=True):
                return self.fn(**inputs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise ConfigError(f"this model has compiled {self.limit} step shapes (cache lengths x W/N/G settings), "
                              "the most it may; restart ladechat to compile afresh") from None


COMPILED_SLOT = "_ladechat_compiled_forward"  # on the model: freed with it


def compiled_forward(model) -> CompiledForward:
    """The model's one CompiledForward, made on first use: every fixed-shape runner of this model
    shares its graphs."""
    found = model.__dict__.get(COMPILED_SLOT)
    if found is None:
        found = model.__dict__[COMPILED_SLOT] = CompiledForward(model)
    return found


def drop_compiled_forward(model) -> None:
    """Forget the model's CompiledForward (after a failed compile): the next one starts afresh."""
    model.__dict__.pop(COMPILED_SLOT, None)


def own_cudagraph_state() -> None:
    """Give the calling thread its own CUDA-graph bookkeeping if torch has not. torch before 2.13
    sets it up only in the thread that imported its CUDA-graph trees, and a compiled call from any
    other Python thread fails an assertion (pytorch#123177); 2.13 sets it up per thread on first
    use (pytorch#184357), as this does for the older ones. A server answers on its model thread."""
    import collections
    import threading

    from torch._inductor import cudagraph_trees

    state = cudagraph_trees.local  # a threading.local
    if hasattr(state, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    if hasattr(cudagraph_trees, "_initialize_tls"):  # torch's own set-up, where it has one
        cudagraph_trees._initialize_tls(state)
        return
    # what that set-up does: the thread's own containers, registered with torch's thread state
    state.tree_manager_containers = {}
    state.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", state.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", state.tree_manager_locks)


class StaticRunner(DynamicRunner):
    fixed = True

    def __init__(self, model, lookahead: LookaheadConfig, context_length: int,
                 compiled: CompiledForward | None = None, first_length: int = FIRST_LENGTH) -> None:
        """compiled: the model's CompiledForward (None: eager fixed-shape steps)."""
        super().__init__(model)
        # Every step attends over the whole static cache (masked slots included), so it starts
        # short and doubles as the conversation grows, up to the model's context (each new
        # length compiles new graphs once).
        self.context_length = context_length
        self.length = min(first_length, context_length) + MAX_FIXED_STEP
        self.cache = kv.new_static_cache(model.config, self.length)
        self.packed: kv.PackedStatic | None = None  # the cache's layers packed, once they exist
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise ConfigError("fixed-shape steps (--compile) do not support this model's sliding-window layers")
        self.compiled = compiled is not None
        self.steps = "torch.compile, one fixed shape" if self.compiled else "fixed-shape padding"
        self.warm = True  # the compiled graphs exist for the cache's current length (see reserve)
        self.forward = compiled or model.forward
        self.configure(lookahead)

    def warm_up(self, committed: int) -> None:
        """Run the step once at its shape, so compiling happens now, not mid-answer.

        Writes only past the `committed` positions, which are kept as they are."""
        self.prefill([0], committed)
        self.truncate(committed + 1)
        self.step(build_layout([[0] * self.shape], []), committed + 1)
        self.truncate(committed)
        self.warm = True

    def reset(self) -> None:
        self.truncate(0)  # same tensors: compiled graphs stay valid

    def configure(self, lookahead: LookaheadConfig) -> None:
        size = max_step_size(lookahead)
        if size > MAX_FIXED_STEP:
            raise ConfigError(f"a full step of W={lookahead.window} N={lookahead.ngram} G={lookahead.candidates} "
                              f"has {size} rows, more than the {MAX_FIXED_STEP} a fixed-shape step allows")
        self.step_size = size
        # Every step has one shape: the full step with lookahead on (a step of fewer rows is
        # padded to it), one row with it off. One graph to compile, not two: each shape is a long
        # compile, and on a GPU a full step costs about a one-row one (BENCHMARKS.md).
        shape = size if lookahead.enabled else 1
        if getattr(self, "shape", shape) != shape:
            self.warm = False  # a new shape: the next turn's reserve compiles it before it starts
        self.shape = shape

    def _length_for(self, end: int) -> int:
        """The cache length (doubling from the current one) whose slots reach `end`."""
        length = min(self.length - MAX_FIXED_STEP, self.context_length)
        while length + MAX_FIXED_STEP < end and length < self.context_length:
            length = min(2 * length, self.context_length)
        if length + MAX_FIXED_STEP < end:
            raise ValueError(f"position {end} is past the model's context of {self.context_length} tokens")
        return length + MAX_FIXED_STEP

    def _make_room(self, end: int, committed: int) -> bool:
        """Grow the cache (keeping its `committed` positions) so that slots up to `end` exist.
        Returns whether it grew."""
        if end <= self.length:
            return False
        length = self._length_for(end)
        if self.packed is None:
            cache, packed = kv.grow_static(self.cache, self.model.config, length, committed), None
        else:
            cache, packed = kv.grow_packed(self.packed, self.model.config, length, committed)
        # all three together, after the allocations: running out of memory above leaves the old
        # cache whole and in use
        self.cache, self.packed, self.length = cache, packed, length
        return True

    def _turn_end(self, tokens: int) -> int:
        # the last step of the turn starts at most at `tokens` and writes a full step's rows
        return min(tokens, self.context_length) + self.step_size

    def grows_for(self, tokens: int) -> int | None:
        end = self._turn_end(tokens)
        return self._length_for(end) if end > self.length else None

    def reserve(self, tokens: int, committed: int) -> None:
        """Grow the cache for a whole turn before it starts, and compile the steps for the new
        length there: growing mid-answer would stall the answer for a compile (and a CUDA-graph
        capture) with no sign of why."""
        grew = self._make_room(self._turn_end(tokens), committed)
        if self.compiled and (grew or not self.warm):
            self.warm = False  # until the warm-up ends: a Ctrl-C during it leaves it for the next turn
            self.warm_up(committed)
            self.warm = True

    def prefill(self, tokens: list[int], past: int, ranked: bool = True) -> np.ndarray:
        self._make_room(past + len(tokens), past)
        tops = []
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            ids, positions, mask = fixed_step_inputs(build_layout([chunk], []), past + start, len(chunk),
                                                     self.length, self.model.dtype, self.model.device)
            self.truncate(past + start)
            tops.append(prefill_top_k(self.model, len(chunk) if ranked else 1, input_ids=ids, position_ids=positions,
                                      attention_mask=mask, **{self.cache_arg: self.cache}))
            if self.packed is None and not self.compiled:  # the first forward pass made the layers: pack them now
                # (not for compiled steps: layers that are views of one tensor are aliased graph
                # inputs, which CUDA graphs skip; test_static.py checks what the graph receives)
                self.packed = kv.pack_static(self.cache)
        return np.concatenate(tops)[-PREFILL_TOP_K:]

    def commit(self, past: int, keep_rows: list[int]) -> None:
        kv.commit_kv(self.cache, past, keep_rows, self.appended, self.packed)

    def truncate(self, length: int) -> None:
        kv.truncate(self.cache, length, self.packed)

    def step(self, layout: StepLayout, past: int) -> torch.Tensor:
        size = self.shape
        self._make_room(past + size, past)
        if layout.size > size or past + size > self.length:
            raise ValueError(f"step of {layout.size} rows at {past} does not fit the fixed shape ({size} rows, "
                             f"cache of {self.length})")
        device = self.model.device
        self.appended = size  # the padding rows are written too
        ids, positions, mask = fixed_step_inputs(layout, past, size, self.length, self.model.dtype, device)
        padded_rows = torch.tensor(list(range(layout.size)) + [0] * (size - layout.size), device=self.rows_device)
        # The static cache writes at its own position counter, which is at `past` here: prefill
        # advances it, commit and truncate set it (resetting it every step would cost kernel
        # launches per layer on the hot path).
        with torch.inference_mode():
            out = self.forward(input_ids=ids, position_ids=positions, attention_mask=mask,
                               **{self.cache_arg: self.cache}, use_cache=True, logits_to_keep=padded_rows)
        # A CUDA-graph replay reuses its output buffer: copy the rows out before the next step.
        return out.logits[0, : layout.size].clone()
