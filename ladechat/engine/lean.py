"""A Llama-family decoding step and prefill on the CPU, written out over the model's own modules.

transformers' forward is built for every model and every use: per layer it passes kwargs through
decorators and wrappers, asks the attention interface for its function, and per step it builds a
causal mask, position embeddings and an output object. On a CPU with a small model that costs as
much as the weights' products (the embedded model at 4 bits: ~7,000 small ops a step; this step:
~1,800; measured: BENCHMARKS.md). A step of the same family needs only:

    tokens (S) --embed--> x (S, hidden)
    per layer:  h = input_norm(x)                         the layer's own RMSNorm module
                q, k, v = q_proj(h), k_proj(h), v_proj(h)  its own Linear modules (int4, packed, dense);
                                                           4-bit ones side by side: one call (q4.joint_product)
                q, k = rope(q, k) at the rows' positions   a cos/sin table the model's rotary module made
                K, V = cache.update(k, v)                  the runner's GrowingCache (kv.py); with q/k/v in
                                                           one product, rotated into it in one call (rope_kv)
                x = x + o_proj(attend(q stacked per kv head, K, V, mask tiled per group))
                h = post_norm(x)                           the layer's own RMSNorm module
                x = x + down(silu(gate(h)) * up(h))        its MLP's Linear modules (gate, up: as q, k, v)
    logits = lm_head(norm(x))                              every row's (lookahead reads them all); a
                                                           prefill's last rows only (those it ranks)

Each residual add and the norm after it are one call (norms.add_norm): where the norms are
ladechat's kernel (engine/kernels/norms.py, on 4-bit weights) that is one operator instead of ~9.

The mask is the step's tree mask of layout.step_inputs (1, 1, S, past + S), tiled for the grouped
query heads once a step (engine/kernels/attention.py draws that layout), not once a layer; a one-row
step has none (it sees every key), nor has a prompt's prefill, which runs here where every row
is computed alone (ladechat's block products and row-wise attention, causal without a mask: a long
prompt needs no mask of its size; elsewhere the model's forward prefills, runner.py). The same ops run in the same order as the model's own forward
with ladechat's grouped attention, so the logits are bitwise the same (tests/test_lean.py, for each
family it accepts) and only the framework's work around them goes. The model is not changed here: its
modules are called, none replaced; a model it does not accept runs its own forward (runner.py).
"""

from __future__ import annotations

import torch

from ladechat.engine import kv
from ladechat.engine.kernels import attention, int4, norms, q4, step_ops
from ladechat.engine.kernels.linear import BlockLinear
from ladechat.engine.layout import StepLayout, step_inputs

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
TABLE_MIN = 1024  # positions of the first cos/sin table; it grows by half when a step passes it


def supported(model, gpu: bool = False) -> str | None:
    """None when the lean step computes what this model's forward does, else why not (one line).
    gpu: also on a CUDA device, where it is measured (`ladechat bench step-cost`) but not yet
    anyone's default (runner.default_runner asks without it)."""
    if not isinstance(model, torch.nn.Module):  # a wrapper (the fault-injection tests'): its own forward
        return "not a torch module"
    config = model.config
    if config.model_type not in FAMILIES:
        return f"{config.model_type} is not a Llama-family model ({', '.join(sorted(FAMILIES))})"
    # On a GPU the step is not a default until measured there: eager steps there are host-bound,
    # costing the same whatever their rows, which is what the lean step's fewer ops address.
    if model.device.type != "cpu" and not (gpu and model.device.type == "cuda"):
        return "the lean step runs on the CPU (on a GPU only where `ladechat bench step-cost` measures it)"
    if model.device.type != "cpu" and config._attn_implementation == attention.ROWWISE:
        return "ladechat's row-wise attention runs on the CPU"
    # accelerate's hooks (a device map, disk offload) bring a layer's weights in when the layer's
    # forward runs, which the lean step never calls
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1 \
            or any(hasattr(module, "_hf_hook") for module in model.modules()):
        return "its layers are placed by a device map (accelerate's hooks move their weights)"
    grouped = config.num_key_value_heads != config.num_attention_heads
    # with key/value groups, ladechat's grouped attention (kernels/attention.py) is what it computes;
    # its row-wise attention with or without groups
    if config._attn_implementation not in (attention.ROWWISE, attention.NAME if grouped else "sdpa"):
        return f"attention {config._attn_implementation!r}, not {'grouped ' if grouped else ''}SDPA"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", "default")
    if "dynamic" in kind or kind == "longrope":  # transformers' own test for a dynamic update
        return f"{kind} RoPE changes with the sequence length"
    if getattr(config, "hidden_act", None) != "silu":
        return "its MLP is not SiLU-gated"
    attn = model.model.layers[0].self_attn
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
        return "its attention is not made of q/k/v/o projections"
    return None


def _product(module: torch.nn.Module, dtype: torch.dtype):
    """x (rows, in) -> x W^T (+ b) of one Linear module in a model of `dtype`: a 4-bit module's
    kernel called directly (its forward's reshapes, and in a bf16 model its casts, do nothing to a
    step's rows, each contiguous), any other module's own forward."""
    if isinstance(module, BlockLinear) and dtype in (torch.float32, torch.bfloat16):
        return module.product()
    if type(module) is not int4.Int4Linear:
        return module.forward
    packed, scales, bias = module.packed_weight, module.scales_and_zeros, module.bias
    mm = getattr(torch.ops.aten, int4.KERNEL)
    if dtype == torch.bfloat16 and bias is None:  # ~400 calls a step fewer
        return lambda x: mm(x, packed, int4.GROUP, scales)

    def int4_product(x: torch.Tensor) -> torch.Tensor:
        y = mm(x.to(torch.bfloat16), packed, int4.GROUP, scales).to(x.dtype)
        return y if bias is None else y + bias

    return int4_product


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin with rotate_half(x) =
    cat(-x2, x1), as x * cos + cat(x2, x1) * cat(-sin1, sin2): (-a) * b and a * (-b) are the same
    float, so the result is bitwise the same, in 4 ops instead of 7."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed_sin)


def _torch_rope(q: torch.Tensor, k: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (S, heads * dim), k (S, kv_heads * dim) -> both rotated, heads first: (heads, S, dim) and
    (kv_heads, S, dim). ladechat's kernel (kernels/step_ops.cpp) computes the same bits in one call."""
    size, dim = cos.shape
    return (_rotate(q.view(size, heads, dim).transpose(0, 1), cos, signed_sin),
            _rotate(k.view(size, kv_heads, dim).transpose(0, 1), cos, signed_sin))


class LeanStep:
    """The model's decoding steps, and its prompts' prefill where each row is computed alone (see
    the module's docstring), into a kv.GrowingCache."""

    def __init__(self, model, rope_kernel: bool | None = None, gpu: bool = False) -> None:
        """rope_kernel: rotate with ladechat's kernel (its library loaded, fp32 or bf16, on the CPU)
        or torch's ops, the same bits; None: the kernel where model loading loaded it and it takes
        the dtype. gpu: see supported()."""
        why = supported(model, gpu)
        if why:
            raise ValueError(f"the lean step cannot run this model: {why}")
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = model.model.layers[0].self_attn.head_dim  # what the attention modules use
        self.groups = self.heads // self.kv_heads
        # bound forward methods: a module's __call__ (its hook lists, tracing checks) costs more than
        # some of their work; supported() refused models whose hooks do anything
        dtype = model.dtype

        def joint(*modules):
            """The modules' products in one call where their 4-bit buffers are side by side
            (q4.KeptReader), else None."""
            return q4.joint_product(list(modules)) if dtype in (torch.float32, torch.bfloat16) else None

        def together(product, *modules):
            """h -> each module's product of h: the one call `product`, each output a column slice
            of it, or each module's own."""
            if product is None:
                apart = [_product(module, dtype) for module in modules]
                return lambda h: [each(h) for each in apart]
            sizes = [module.out_features for module in modules]
            return lambda h: product(h).split(sizes, dim=1)

        def ops(layer, next_norm) -> tuple:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = joint(attn.q_proj, attn.k_proj, attn.v_proj)
            return (together(qkv, attn.q_proj, attn.k_proj, attn.v_proj), qkv, _product(attn.o_proj, dtype),
                    attn.scaling, norms.add_norm(layer.post_attention_layernorm),
                    together(joint(mlp.gate_proj, mlp.up_proj), mlp.gate_proj, mlp.up_proj),
                    _product(mlp.down_proj, dtype), norms.add_norm(next_norm))

        # Each residual add is fused with the norm after it (norms.add_norm: one call for
        # ladechat's norm kernel): a layer ends with the next layer's input norm, the last with the
        # model's final norm, so the first layer's input norm is the one called alone.
        layers = model.model.layers
        after = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
        self.first_norm = layers[0].input_layernorm.forward
        self.layers = [ops(layer, next_norm) for layer, next_norm in zip(layers, after, strict=True)]
        self.cos = self.signed_sin = torch.empty(0)
        # the kernel's dtypes (fp16: torch's ops), on the CPU (its library has no CUDA code)
        takes = model.dtype in (torch.float32, torch.bfloat16) and model.device.type == "cpu"
        if rope_kernel is None:
            rope_kernel = takes and step_ops.loaded()
        elif rope_kernel and not (takes and step_ops.loaded()):
            raise ValueError(f"ladechat's rope kernel cannot rotate this model's steps ({model.dtype} on "
                             f"{model.device}, {'loaded' if step_ops.loaded() else 'not loaded'})")
        self.rope = torch.ops.ladechat_step.rope.default if rope_kernel else _torch_rope
        # with the kernel and q/k/v in one product: rotated and put in the cache in one call
        self.rope_kv = torch.ops.ladechat_step.rope_kv.default if rope_kernel else None
        # the attention the model's forward runs (attention.py), of the stacked rows
        self.attend = attention.attend_stacked if config._attn_implementation == attention.ROWWISE \
            else attention.sdpa_stacked
        # Whether a row's bits are the same among any rows: ladechat's block products and row-wise
        # attention (not SDPA, oneDNN's or torch's dense and int4 products, whose blocking follows
        # the row count). Only then may a prompt be fed in parts (prefill).
        products = [module for layer in layers for module in (*layer.self_attn.children(), *layer.mlp.children())
                    if isinstance(module, torch.nn.Module) and hasattr(module, "in_features")]
        self.rows_alone = self.attend is attention.attend_stacked and all(
            isinstance(module, BlockLinear) for module in (*products, model.lm_head))

    def table(self, end: int) -> None:
        """cos/sin for positions 0..end-1 at least, from the model's own rotary module: each
        position's angles are one product, the same whatever else is computed with them."""
        if end <= self.cos.shape[0]:
            return
        length = max(end + end // 2, TABLE_MIN)
        with torch.inference_mode():
            device = self.model.device
            probe = torch.zeros(1, dtype=self.model.dtype, device=device)
            cos, sin = self.model.model.rotary_emb(probe, position_ids=torch.arange(length, device=device).unsqueeze(0))
            half = sin.shape[-1] // 2
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def forward(self, layout: StepLayout, past: int, cache) -> torch.Tensor:
        """Logits (S, vocab) of every row of the step, its keys and values appended to `cache`."""
        with torch.inference_mode():
            if layout.size == 1:
                ids, positions = (torch.tensor(v, device=self.model.device) for v in (layout.tokens, [past]))
                return self._run(ids, positions, None, past, cache)
            return self._run(*self._tree_inputs(layout, past), past, cache)

    def prefill(self, tokens: list[int], past: int, cache, keep: int) -> torch.Tensor | None:
        """Logits (keep, vocab) of the last `keep` (0: None) of prompt tokens that follow `past` cached ones,
        their keys and values appended to `cache`; where rows_alone (the row-wise attention takes
        no mask for them: it is causal without one, so a long prompt costs no mask of its size)."""
        if not self.rows_alone:
            raise ValueError("the lean prefill runs where each row is computed alone (ladechat's kernels)")
        with torch.inference_mode():
            device = self.model.device
            ids, positions = torch.tensor(tokens, device=device), torch.arange(past, past + len(tokens), device=device)
            return self._run(ids, positions, None, past, cache, keep)

    def _tree_inputs(self, layout: StepLayout, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's token ids, positions and mask (tiled for the query heads of a group)."""
        ids, positions, mask = step_inputs(layout, past, self.model.dtype, self.model.device)
        if self.groups > 1:  # one copy per query head of a group, stacked as rows
            mask = mask.repeat(1, 1, self.groups, 1)
        return ids[0], positions[0], mask

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, past: int, cache,
             keep: int | None = None) -> torch.Tensor | None:
        """The layers over rows `ids` at `positions` (below past + rows), seeing the cache and each
        other as `mask` says (None: a one-row step sees every key; the row-wise attention is causal
        without one); the logits of every row, or of the last `keep` (0: none, None)."""
        model, size = self.model, ids.shape[0]
        heads, kv_heads, dim, groups = self.heads, self.kv_heads, self.dim, self.groups
        self.table(past + size)  # a row's position is past + its depth, below size: no read of the device
        cos, signed_sin = self.cos[positions], self.signed_sin[positions]  # (S, dim), broadcast over heads
        x = model.model.embed_tokens(ids)  # (S, hidden)
        silu, attend, rope, rope_kv = torch.nn.functional.silu, self.attend, self.rope, self.rope_kv
        layers = cache.layers
        h = self.first_norm(x)
        for i, (q_k_v, qkv, o_proj, scaling, add_norm2, gate_up, down, add_next_norm) in enumerate(self.layers):
            layer = layers[i] if i < len(layers) else None
            if rope_kv is not None and qkv is not None and isinstance(layer, kv.GrowingLayer) \
                    and layer.keys is not None and layer.keys.dim() == 4:  # a reset layer: update() sets it up
                held, key_buffer, value_buffer = layer.room(size)
                q = rope_kv(qkv(h), heads, kv_heads, cos, signed_sin, key_buffer, value_buffer, held)
                keys, values = layer.filled(held + size)
            else:
                q, k, v = q_k_v(h)
                q, k = rope(q, k, heads, kv_heads, cos, signed_sin)
                v = v.view(size, kv_heads, dim).transpose(0, 1)
                if layer is not None:
                    keys, values = layer.update(k[None], v[None])
                else:  # an empty cache (a prompt's first part): the cache makes the layer
                    keys, values = cache.update(k[None], v[None], i)
            out = attend(q.reshape(1, kv_heads, groups * size, dim), keys, values, mask, scaling, size)
            x, h = add_norm2(x, o_proj(out.reshape(heads, size, dim).transpose(0, 1).reshape(size, heads * dim)))
            gate, up = gate_up(h)
            x, h = add_next_norm(x, down(silu(gate) * up))
        if keep == 0:  # a prompt's chunk before the rows it ranks
            return None
        return model.lm_head(h if keep is None else h[size - keep:])

