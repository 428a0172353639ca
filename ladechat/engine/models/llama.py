"""The Llama family (Llama, Mistral without a sliding window, Qwen2) as ladechat runs it: the
layers under the checkpoint's own names, and the prefill and the step written out over them.

    tokens (S) --embed--> x (S, hidden)
    per layer:  h = input_layernorm(x)
                q, k, v = q_proj(h), k_proj(h), v_proj(h)  siblings of one block kernel in one call
                                                           (JOINED, linear.joint_product)
                q, k = rope(q, k) at the rows' positions   cos/sin from the model's inv_freq (table())
                K, V = cache.layers[i].write(k, v)         a kv.RowsCache (new_cache); with q/k/v in one
                                                           product, rotated into it in one call (rope_kv)
                x = x + o_proj(attend(q stacked per kv head, K, V, mask tiled per group))
                h = post_attention_layernorm(x)
                x = x + down_proj(silu(gate_proj(h)) * up_proj(h))   gate/up: as q/k/v
    logits = lm_head(norm(x))                              every row's in a step (lookahead reads
                                                           them all); a prefill's last `keep` rows

Each residual add and the norm after it are one call (norms.add_norm; one operator where the
norm is ladechat's kernel). A step's mask is the tree mask of layout.step_inputs, tiled for the
query heads of a group once a step, not once a layer; a one-row step has none (it sees every key).

The Linear, norm and embedding modules are whatever the loader put under these names: torch's,
oneDNN's packed ones or ladechat's block kernels (engine/kernels/). The ops and their order are
those of transformers' forward for the family, with its attention function of the same name, so
the logits are bitwise those of transformers' forward over the same modules (tests/test_llama.py
builds that forward with `transformers_twin` and compares), and only the framework's work goes
(measured: BENCHMARKS.md).

Prefill: where every row is computed alone (ladechat's block products and row-wise attention) a
prompt runs in parts of PREFILL_CHUNK rows, causal without a mask, and gives the bits of one pass;
elsewhere (oneDNN's or torch's products, SDPA, whose results follow the row count) in one pass
under a causal mask, as transformers' forward does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ladechat.engine import kv
from ladechat.engine.kernels import attention, linear, norms, step_ops
from ladechat.engine.kernels.linear import BlockLinear, FixedLinear
from ladechat.engine.layout import StepLayout, step_inputs

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
TABLE_MIN = 1024  # positions of the first cos/sin table; it grows by half when a step passes it
PREFILL_CHUNK = 512  # prompt rows a part, where rows are computed alone
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Siblings that take the same input, multiplied in one call where their kernel allows (each run of
# them on one block kernel: linear.joint_product); kept layouts store them together (load/joined.py).
JOINED = (ATTENTION[:3], MLP[:2])


def accepts(model, gpu: bool = False) -> str | None:
    """None when this file computes what transformers' forward of `model` (as loaded) does, else
    why not (one line). gpu: also on a CUDA device, where it is measured (`ladechat bench
    step-cost`) but nobody's default."""
    if isinstance(model, Llama):
        return None
    if not isinstance(model, torch.nn.Module):  # a wrapper (the fault-injection tests'): its own forward
        return "not a torch module"
    config = model.config
    why = _config_refusal(config)
    if why:
        return why
    # On a GPU eager steps are host-bound, costing the same whatever their rows, which is what
    # fewer ops address; not a default until measured there.
    if model.device.type != "cpu" and not (gpu and model.device.type == "cuda"):
        return "ladechat's Llama forward runs on the CPU (on a GPU only where `ladechat bench step-cost` measures it)"
    if model.device.type != "cpu" and config._attn_implementation == attention.ROWWISE:
        return "ladechat's row-wise attention runs on the CPU"
    # accelerate's hooks (a device map, disk offload) bring a layer's weights in when the layer's
    # forward runs, which this forward never calls
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1 \
            or any(hasattr(module, "_hf_hook") for module in model.modules()):
        return "its layers are placed by a device map (accelerate's hooks move their weights)"
    grouped = config.num_key_value_heads != config.num_attention_heads
    # with key/value groups, ladechat's grouped attention (kernels/attention.py) is what it computes;
    # its row-wise attention with or without groups
    if config._attn_implementation not in (attention.ROWWISE, attention.NAME if grouped else "sdpa"):
        return f"attention {config._attn_implementation!r}, not {'grouped ' if grouped else ''}SDPA"
    layer = model.model.layers[0]
    if not all(hasattr(layer.self_attn, name) for name in ATTENTION) or not all(hasattr(layer.mlp, n) for n in MLP):
        return "its layers are not made of q/k/v/o projections and a gated MLP"
    if getattr(getattr(model.model, "rotary_emb", None), "inv_freq", None) is None:
        return "it has no rotary table (inv_freq)"
    return None


def takes(config, attn: str) -> str | None:
    """None when a model of `config` built empty by Llama.empty, with attention `attn` (the
    loader's choice), is one accepts() takes once loaded, else why not (one line)."""
    return _config_refusal(config) or (None if attn == "sdpa" else f"attention {attn!r}, not SDPA")


def _config_refusal(config) -> str | None:
    """Why this file cannot compute a model of `config` whatever its placement (one line), or None."""
    if config.model_type not in FAMILIES:
        return f"{config.model_type} is not a Llama-family model ({', '.join(sorted(FAMILIES))})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    kind = _rope(config).get("rope_type", "default")
    if "dynamic" in kind or kind == "longrope":  # transformers' own test for a dynamic update
        return f"{kind} RoPE changes with the sequence length"
    if getattr(config, "hidden_act", None) != "silu":
        return "its MLP is not SiLU-gated"
    return None


def _rope(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _biases(config) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases of the family: Llama's config says; Qwen2 has q/k/v biases only."""
    if config.model_type == "llama":
        return bool(config.attention_bias), bool(config.attention_bias), bool(getattr(config, "mlp_bias", False))
    return config.model_type == "qwen2", False, False


def rotary_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inv_freq, the scale of cos and sin) of the config's RoPE, as transformers' rotary module
    computes them (its own function for the scaled kinds)."""
    rope = _rope(config)
    kind = rope.get("rope_type", "default")
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config)
        return inv_freq, float(scale)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class Layer(torch.nn.Module):
    """A decoder layer's modules under the checkpoint's names (input_layernorm, self_attn.q_proj, ...)."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.input_layernorm = modules["input_layernorm"]
        self.post_attention_layernorm = modules["post_attention_layernorm"]
        self.self_attn = torch.nn.Module()
        self.mlp = torch.nn.Module()
        for name in ATTENTION:
            self.self_attn.add_module(name, modules[f"self_attn.{name}"])
        for name in MLP:
            self.mlp.add_module(name, modules[f"mlp.{name}"])


class Llama(torch.nn.Module):
    """A Llama-family causal LM: model.embed_tokens, model.layers[i], model.norm, lm_head, as the
    checkpoint names them; inv_freq, the rotary frequencies its config gives. Built `empty` from
    a config for a loader to fill by name (a GGUF), or by `adopt` over the modules of the
    transformers model a loader read (a checkpoint: taken, not copied)."""

    def __init__(self, config, embed_tokens, layers: list[Layer], norm, lm_head, inv_freq: torch.Tensor,
                 rope_scale: float, generation_config=None) -> None:
        super().__init__()
        self.config = config  # transformers' config object: the checkpoint's config.json, read
        self.generation_config = generation_config
        self.model = torch.nn.Module()
        self.model.embed_tokens = embed_tokens
        self.model.layers = torch.nn.ModuleList(layers)
        self.model.norm = norm
        self.lm_head = lm_head
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale  # the rope type's scale of cos and sin (1 for most)

    @classmethod
    def adopt(cls, built, gpu: bool = False) -> Llama:
        """The Llama over the modules of `built` (transformers' model of an accepted family, as a
        loader built and filled it; accepts() says which): its Linear, embedding and norm modules
        by name, its rotary frequencies. `built` keeps working; drop it to free its wrapper. gpu:
        see accepts()."""
        if isinstance(built, Llama):
            return built
        why = accepts(built, gpu)
        if why:
            raise ValueError(f"ladechat's Llama forward cannot run this model: {why}")

        def norm(module):
            # transformers' norm module becomes ours (the same computation); ladechat's kernel's stays
            if type(module) in (norms.NativeRMSNorm, norms.TorchRMSNorm):
                return module
            return norms.TorchRMSNorm(module.weight, float(module.variance_epsilon))

        layers = []
        for layer in built.model.layers:
            modules = {f"self_attn.{n}": getattr(layer.self_attn, n) for n in ATTENTION}
            modules.update({f"mlp.{n}": getattr(layer.mlp, n) for n in MLP})
            modules.update(input_layernorm=norm(layer.input_layernorm),
                           post_attention_layernorm=norm(layer.post_attention_layernorm))
            layers.append(Layer(modules))
        rotary = built.model.rotary_emb
        return cls(built.config, built.model.embed_tokens, layers, norm(built.model.norm), built.lm_head,
                   rotary.inv_freq, float(rotary.attention_scaling), getattr(built, "generation_config", None)).eval()

    @classmethod
    def empty(cls, config, dtype: torch.dtype, attn: str = "sdpa") -> Llama:
        """The Llama of `config` in `dtype`, its weights on the meta device for a loader to fill by
        name (takes() says which configs); the rotary frequencies computed, on the CPU."""
        from transformers import GenerationConfig

        why = takes(config, attn)
        if why:
            raise ValueError(f"ladechat's Llama forward cannot run this model: {why}")
        config._attn_implementation = attn
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or hidden // heads
        qkv_bias, o_bias, mlp_bias = _biases(config)
        inv_freq, scale = rotary_frequencies(config)
        with torch.device("meta"):
            def linear(cols: int, rows: int, bias: bool) -> torch.nn.Linear:
                return torch.nn.Linear(cols, rows, bias=bias, dtype=dtype)

            def norm() -> norms.TorchRMSNorm:
                return norms.TorchRMSNorm(torch.nn.Parameter(torch.empty(hidden, dtype=dtype)), config.rms_norm_eps)

            layers = [Layer({"self_attn.q_proj": linear(hidden, heads * dim, qkv_bias),
                             "self_attn.k_proj": linear(hidden, kv_heads * dim, qkv_bias),
                             "self_attn.v_proj": linear(hidden, kv_heads * dim, qkv_bias),
                             "self_attn.o_proj": linear(heads * dim, hidden, o_bias),
                             "mlp.gate_proj": linear(hidden, config.intermediate_size, mlp_bias),
                             "mlp.up_proj": linear(hidden, config.intermediate_size, mlp_bias),
                             "mlp.down_proj": linear(config.intermediate_size, hidden, mlp_bias),
                             "input_layernorm": norm(), "post_attention_layernorm": norm()})
                      for _ in range(config.num_hidden_layers)]
            embed = torch.nn.Embedding(config.vocab_size, hidden, dtype=dtype)
            head, final = linear(hidden, config.vocab_size, False), norm()
            if getattr(config, "tie_word_embeddings", False):  # as transformers ties them when it builds
                head.weight = embed.weight
        return cls(config, embed, layers, final, head, inv_freq, scale, GenerationConfig.from_model_config(config)).eval()

    def set_input_embeddings(self, module: torch.nn.Module) -> None:
        self.model.embed_tokens = module

    def set_attn_implementation(self, name: str) -> None:
        """The attention its steps run (kernels/attention.py's names, registered with transformers)."""
        self.config._attn_implementation = name

    def tie_weights(self, missing_keys: set[str]) -> None:
        """The output layer's weight as the embedding's where the file has none of its own and the
        config ties them."""
        if "lm_head.weight" in missing_keys and getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        """.logits (1, S, vocab): every position's of one sequence `input_ids` (1, S) after an empty
        cache, by this file's prefill (scoring a text; a chat's turns run through bind())."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"a Llama scores one sequence (1, S) at a time, not {tuple(input_ids.shape)}")
        tokens = input_ids[0].tolist()
        steps = self.bind()
        return SimpleNamespace(logits=torch.cat(list(steps.prefill(tokens, 0, steps.new_cache(), len(tokens))))[None])

    def bind(self, rope_kernel: bool | None = None, gpu: bool = False) -> Steps:
        """Its prefill and steps over its modules as they are now: bind again after changing them
        (packing.unpack, another attention), as runners are made per Session."""
        return Steps(self, rope_kernel, gpu)

    def transformers_twin(self):
        """transformers' model of this config over these very modules (no copy): its forward and
        generate() are the reference this file's steps must equal (tests, `ladechat bench`'s HF
        column)."""
        import copy

        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):  # a config of its own: building it writes there
            twin = AutoModelForCausalLM.from_config(copy.deepcopy(self.config), dtype=self.dtype,
                                                    attn_implementation=self.config._attn_implementation)
        for name, module in self.named_modules():
            if name and not any(True for _ in module.children()):  # a leaf: Linear, norm, embedding
                twin.set_submodule(name, module)
        twin.model.rotary_emb.to(self.device)
        if self.generation_config is not None:
            twin.generation_config = self.generation_config
        return twin.eval()


def _product(module: torch.nn.Module, dtype: torch.dtype):
    """x (rows, in) -> x W^T (+ b) of one Linear module in a model of `dtype`: a kernel module's own
    product (FixedLinear.product), any other module's forward."""
    return module.product(dtype) if isinstance(module, FixedLinear) else module.forward


def _siblings(modules: list, dtype: torch.dtype) -> tuple[Callable, Callable | None]:
    """(h -> each module's product of h, h -> all of them as one tensor or None): each run of
    modules that one call of their kernel can multiply (linear.joint_product, longest first) in
    that call, the rest each its own."""
    products, start = [], 0
    while start < len(modules):
        end = len(modules)
        while end - start > 1 and (joint := linear.joint_product(modules[start:end], dtype)) is None:
            end -= 1
        if end - start > 1:
            products.append((joint, [module.out_features for module in modules[start:end]]))
        else:
            products.append((_product(modules[start], dtype), None))
        start = end
    if len(products) == 1 and products[0][1] is not None:
        whole, sizes = products[0]
        return (lambda h: whole(h).split(sizes, dim=1)), whole
    return (lambda h: [out for product, sizes in products
                       for out in (product(h).split(sizes, dim=1) if sizes else (product(h),))]), None


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


def _one_pass_attention(name: str, groups: int):
    """transformers' attention function `name` (as its forward calls it) for a prefill's rows in
    one pass: (q (1, heads, S, dim), K, V, causal mask or None, scale) -> (1, S, heads, dim)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS[name]
    layer = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    return lambda q, keys, values, mask, scale: function(layer, q, keys, values, mask, dropout=0.0, scaling=scale)[0]


class LayerOps(NamedTuple):
    """One decoder layer's work in a step, in the order it runs, each bound once to its modules."""

    q_k_v: Callable  # h -> [q, k, v]
    qkv: Callable | None  # h -> q, k and v as one tensor, where they are one product (rotated and cached in one call)
    o_proj: Callable
    add_norm2: Callable  # (x, attention out) -> the residual and the post-attention norm of it
    gate_up: Callable  # h -> [gate, up]
    down: Callable
    add_next_norm: Callable  # (x, MLP out) -> the residual and the next layer's input norm (the final norm) of it


class Steps:
    """A Llama's prefill and steps into its kv.RowsCache (new_cache), its modules' products bound once."""

    def __init__(self, model: Llama, rope_kernel: bool | None = None, gpu: bool = False) -> None:
        """rope_kernel: rotate with ladechat's kernel (its library loaded, fp32 or bf16, on the CPU)
        or torch's ops, the same bits; None: the kernel where loading loaded it and it takes the
        dtype. gpu: see accepts()."""
        self.model = model
        config = model.config
        if model.device.type != "cpu" and not (gpu and model.device.type == "cuda"):
            raise ValueError("ladechat's Llama forward runs on the CPU (on a GPU only for `ladechat bench step-cost`)")
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.scale = self.dim**-0.5
        dtype = model.dtype

        def ops(layer, next_norm) -> LayerOps:
            attn, mlp = layer.self_attn, layer.mlp
            q_k_v, qkv = _siblings([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
            return LayerOps(q_k_v=q_k_v, qkv=qkv, o_proj=_product(attn.o_proj, dtype),
                            add_norm2=norms.add_norm(layer.post_attention_layernorm),
                            gate_up=_siblings([mlp.gate_proj, mlp.up_proj], dtype)[0],
                            down=_product(mlp.down_proj, dtype), add_next_norm=norms.add_norm(next_norm))

        # Each residual add is fused with the norm after it: a layer ends with the next layer's
        # input norm, the last with the final norm, so only the first layer's input norm is alone.
        layers = model.model.layers
        after = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
        self.first_norm = layers[0].input_layernorm.forward
        self.layers = [ops(layer, next_norm) for layer, next_norm in zip(layers, after, strict=True)]
        self.embed, self.head = model.model.embed_tokens, model.lm_head
        self.cos = self.signed_sin = torch.empty(0)
        takes = dtype in (torch.float32, torch.bfloat16) and model.device.type == "cpu"
        if rope_kernel is None:
            rope_kernel = takes and step_ops.loaded()
        elif rope_kernel and not (takes and step_ops.loaded()):
            raise ValueError(f"ladechat's rope kernel cannot rotate this model's steps ({dtype} on "
                             f"{model.device}, {'loaded' if step_ops.loaded() else 'not loaded'})")
        self.rope = torch.ops.ladechat_step.rope.default if rope_kernel else _torch_rope
        # with the kernel and q/k/v in one product: rotated and put in the cache in one call
        self.rope_kv = torch.ops.ladechat_step.rope_kv.default if rope_kernel else None
        # the attention transformers' forward runs for the config's implementation (attention.py)
        name = config._attn_implementation
        self.attend = attention.attend_stacked if name == attention.ROWWISE else attention.sdpa_stacked
        self.one_pass = _one_pass_attention(name, self.groups)
        # Whether a row's bits are the same among any rows: ladechat's block products and row-wise
        # attention (not SDPA, oneDNN's or torch's dense and int4 products, whose blocking follows
        # the row count). Only then may a prompt be fed in parts.
        products = [module for layer in layers for module in (*layer.self_attn.children(), *layer.mlp.children())]
        self.rows_alone = self.attend is attention.attend_stacked and all(
            isinstance(module, BlockLinear) for module in (*products, model.lm_head))

    def new_cache(self) -> kv.RowsCache:
        """An empty cache for these steps: a layer's keys and values per layer, in the model's dtype
        and on its device."""
        model = self.model
        return kv.RowsCache(len(self.layers), self.kv_heads, self.dim, model.dtype, model.device)

    def table(self, end: int) -> None:
        """cos/sin for positions 0..end-1 at least: each angle one product of a position and a
        frequency, as transformers' rotary module computes it, the same whatever else is computed."""
        if end <= self.cos.shape[0]:
            return
        length = max(end + end // 2, TABLE_MIN)
        model = self.model
        with torch.inference_mode():
            positions = torch.arange(length, device=model.device).float()
            freqs = positions[:, None] * model.inv_freq
            angles = torch.cat((freqs, freqs), dim=-1)
            cos = (angles.cos() * model.rope_scale).to(model.dtype)
            sin = (angles.sin() * model.rope_scale).to(model.dtype)
            half = sin.shape[-1] // 2
        self.cos, self.signed_sin = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def step(self, layout: StepLayout, past: int, cache) -> torch.Tensor:
        """Logits (S, vocab) of every row of the step, its keys and values appended to `cache`."""
        with torch.inference_mode():
            if layout.size == 1:
                ids, positions = (torch.tensor(v, device=self.model.device) for v in (layout.tokens, [past]))
                return self._run(ids, positions, None, past, cache)
            ids, positions, mask = step_inputs(layout, past, self.model.dtype, self.model.device)
            if self.groups > 1:  # one copy per query head of a group, stacked as rows
                mask = mask.repeat(1, 1, self.groups, 1)
            return self._run(ids[0], positions[0], mask, past, cache)

    def prefill(self, tokens: list[int], past: int, cache, keep: int) -> Iterator[torch.Tensor]:
        """The logits of the last `keep` (>= 1) of prompt tokens that follow `past` cached ones, in
        order, a part's rows at a time (so a caller that ranks them holds one part's), their keys
        and values appended to `cache` (see the module's docstring). Read it to the end."""
        device = self.model.device
        if not self.rows_alone:
            ids, positions = torch.tensor(tokens, device=device), torch.arange(past, past + len(tokens), device=device)
            with torch.inference_mode():
                logits = self._run(ids, positions, _causal(past, len(tokens), device), past, cache, keep, one_pass=True)
            yield logits
            return
        for start in range(0, len(tokens), PREFILL_CHUNK):
            part = tokens[start:start + PREFILL_CHUNK]
            after = len(tokens) - start - len(part)  # prompt tokens after this part
            ids = torch.tensor(part, device=device)
            positions = torch.arange(past + start, past + start + len(part), device=device)
            with torch.inference_mode():
                logits = self._run(ids, positions, None, past + start, cache, max(0, min(len(part), keep - after)))
            if logits is not None:
                yield logits

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, past: int, cache,
             keep: int | None = None, one_pass: bool = False) -> torch.Tensor | None:
        """The layers over rows `ids` at `positions` (below past + rows), seeing the cache and each
        other as `mask` says (None: a one-row step sees every key; the row-wise attention is causal
        without one); the logits of every row, or of the last `keep` (0: none, None). one_pass: a
        prefill's rows under a causal mask (None: of an empty cache) by transformers' attention
        function, as its forward prefills."""
        size = ids.shape[0]
        heads, kv_heads, dim, groups = self.heads, self.kv_heads, self.dim, self.groups
        self.table(past + size)  # a row's position is past + its depth, below size: no read of the device
        cos, signed_sin = self.cos[positions], self.signed_sin[positions]  # (S, dim), broadcast over heads
        x = self.embed(ids)  # (S, hidden)
        silu, attend, rope, rope_kv = torch.nn.functional.silu, self.attend, self.rope, self.rope_kv
        h = self.first_norm(x)
        for layer, ops in zip(cache.layers, self.layers, strict=True):
            q_k_v, qkv, o_proj, add_norm2, gate_up, down, add_next_norm = ops  # a LayerOps: one unpacking, no attribute reads
            if rope_kv is not None and qkv is not None:
                held, key_buffer, value_buffer = layer.room(size)
                q = rope_kv(qkv(h), heads, kv_heads, cos, signed_sin, key_buffer, value_buffer, held)
                keys, values = layer.filled(held + size)
            else:
                q, k, v = q_k_v(h)
                q, k = rope(q, k, heads, kv_heads, cos, signed_sin)
                keys, values = layer.write(k[None], v.view(size, kv_heads, dim).transpose(0, 1)[None])
            if one_pass:
                out = self.one_pass(q.reshape(1, heads, size, dim), keys, values, mask, self.scale)
                out = out.reshape(size, heads * dim)
            else:
                out = attend(q.reshape(1, kv_heads, groups * size, dim), keys, values, mask, self.scale, size)
                out = out.reshape(heads, size, dim).transpose(0, 1).reshape(size, heads * dim)
            x, h = add_norm2(x, o_proj(out))
            gate, up = gate_up(h)
            x, h = add_next_norm(x, down(silu(gate) * up))
        if keep == 0:  # a prompt's part before the rows it ranks
            return None
        return self.head(h if keep is None else h[size - keep:])


def _causal(past: int, rows: int, device) -> torch.Tensor | None:
    """A prefill's mask (1, 1, rows, past + rows), True where a row sees a key, as transformers'
    SDPA mask; None where transformers passes none: over an empty cache (SDPA's own causal flag
    does it) and for one row (it sees every key)."""
    if past == 0 or rows == 1:
        return None
    keys = torch.arange(past + rows, device=device)
    return (keys[None, :] <= torch.arange(past, past + rows, device=device)[:, None])[None, None]
