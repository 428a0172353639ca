"""ladechat's Llama (engine/models/llama.py) computes what transformers' forward over the same
modules does, bit for bit: the same logits for prefills and steps of any size and shape, so the
same tokens, plain and with lookahead, over several turns, for every family it accepts; families
it does not accept run transformers' forward."""

import copy
import random
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny_models import tiny_loaded, tiny_model

from ladechat import templates
from ladechat.engine import kv
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.kernels import attention, int4, linear, native, q4, step_ops
from ladechat.engine.kernels.attention import use_grouped_sdpa
from ladechat.engine.layout import build_layout
from ladechat.engine.load import joined, packing
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.models import llama, transformers_model
from ladechat.engine.runner import DynamicRunner, ModelRunner, default_runner
from ladechat.engine.step_cost import CostModel
from ladechat.paths import cache_root

CONFIGS = [(1, 2, 0), (3, 3, 3), (5, 4, 5)]
# A fixed, nearly flat cost curve: lookahead plans steps of several rows, the same ones every run.
FLAT = CostModel({192: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.2}})
STEPS = [([[5]], []), ([[5, 6, 7], [8, 9, 10]], [((11, 12), "pool"), ((11, 13), "pool")]),
         ([[7, 7, 7, 7]], [((1, 2, 3), "pool")])]


def grouped(family: str):
    model = tiny_model(family)
    assert use_grouped_sdpa(model)  # as loading does
    return model


def ungrouped(family: str):
    """A model without key/value groups (plain SDPA, as loading leaves it)."""
    model = tiny_model(family)
    model.config.num_key_value_heads = model.config.num_attention_heads
    rebuilt = type(model)(model.config).eval()
    rebuilt.config._attn_implementation = "sdpa"
    return rebuilt


def tokens(session, prompt, max_new, eos=frozenset()):
    return list(list(generate(session, prompt, SamplingConfig(max_new_tokens=max_new), eos))[-1].text_tokens)


def assert_caches_equal(ours, ref) -> None:
    for a, b in zip(ours.cache.layers, ref.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def runners(model, rope_kernel: bool | None = None) -> tuple[ModelRunner, DynamicRunner]:
    """(ladechat's Llama steps, transformers' forward) over the same modules: `model` transformers'
    (adopted, as loading does) or a Llama (its twin)."""
    if isinstance(model, llama.Llama):
        return ModelRunner(model, rope_kernel), DynamicRunner(model.transformers_twin())
    return ModelRunner(llama.Llama.adopt(model), rope_kernel), DynamicRunner(model)


def assert_steps_match(model, prompt: list[int], rope_kernel: bool | None = None) -> None:
    """The Llama's prefill of `prompt` ranks the next tokens of its rows as transformers' forward
    does and fills the cache with the same keys and values; after it every row's logits of one-row,
    window and tree steps equal the forward's exactly, and so does the cache."""
    ours, ref = runners(model, rope_kernel)
    assert np.array_equal(ours.prefill(prompt, 0), ref.prefill(prompt, 0))
    assert_caches_equal(ours, ref)
    for window, candidates in STEPS:
        layout = build_layout(window, candidates)
        got, want = ours.step(layout, len(prompt)), ref.step(layout, len(prompt))
        assert got.shape == want.shape == (layout.size, model.config.vocab_size)
        assert torch.equal(got, want), layout.size
        assert_caches_equal(ours, ref)
        ours.truncate(len(prompt))
        ref.truncate(len(prompt))


@pytest.fixture(scope="module")
def rope_kernel():
    if step_ops.load(cache_root() / "kernels"):
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build ladechat's step kernels here")
    return True


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("attention", ["grouped", "ungrouped"])
@pytest.mark.parametrize("rotation", ["kernel", "torch"])
def test_step_logits_are_the_forward_pass_logits(family, attention, rotation, request):
    """Every row's logits of one-row, window and tree steps, after a prompt, equal the model's
    forward's exactly (fp32), and the cache holds the same keys and values: with q and k rotated
    by ladechat's kernel, and by torch's ops."""
    use_kernel = rotation == "kernel" and request.getfixturevalue("rope_kernel")
    assert_steps_match(grouped(family) if attention == "grouped" else ungrouped(family), list(range(3, 40)),
                       rope_kernel=use_kernel)


def variant(**changes):
    """A tiny grouped-attention Llama with config changes, its weights random as tiny_model's."""
    from tiny_models import COMMON
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, **changes}, attn_implementation="sdpa")).eval()
    assert use_grouped_sdpa(model)
    return model


VARIANTS = {
    "head_dim": {"head_dim": 32},  # wider heads than hidden / heads
    "attention_bias": {"attention_bias": True},
    "mlp_bias": {"mlp_bias": True},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                 "rope_theta": 10000.0}},  # attention_scaling != 1
    "llama3": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                   "rope_theta": 500000.0}},
}


def test_a_dtype_the_rope_kernel_does_not_take_rotates_with_torch(rope_kernel):
    """fp16 on the CPU: with the kernels loaded, the default Llama steps rotate with torch's ops (the
    kernel takes fp32 and bf16) and still compute the forward's logits; asking for the kernel is
    an error that says why."""
    model = grouped("llama").to(torch.float16)
    assert runners(model)[0].forward.rope is llama._torch_rope
    assert_steps_match(model, list(range(3, 40)))
    with pytest.raises(ValueError, match=r"cannot rotate this model's steps \(torch.float16 on cpu, loaded\)"):
        runners(model, rope_kernel=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_kernel_takes_rows_apart(rope_kernel, dtype):
    """q and k as column slices of one product with v (their rows apart in memory): the same
    rotation, bit for bit, as of contiguous copies."""
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 3, 1, 8
    for rows in (1, 5):
        joint = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
        q, k, _ = joint.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        cos, sin = torch.randn(rows, dim, generator=generator).to(dtype), torch.randn(rows, dim, generator=generator).to(dtype)
        got = torch.ops.ladechat_step.rope(q, k, heads, kv_heads, cos, sin)
        want = torch.ops.ladechat_step.rope(q.contiguous(), k.contiguous(), heads, kv_heads, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(RuntimeError, match="each row contiguous"):
        torch.ops.ladechat_step.rope(joint.t().contiguous().t()[:, : heads * dim], k, heads, kv_heads, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_rotates_into_the_cache_what_rope_and_an_update_put_there(rope_kernel, dtype):
    """One joint q/k/v product's rows: q as rope rotates it; k rotated and v written into a cache
    layer's buffers after what it holds, as the layer's own write puts them there, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = 6, 2, 64

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    ours, theirs = kv.RowsCache(2, kv_heads, dim, dtype, torch.device("cpu")).layers
    for layer in (ours, theirs):  # a prompt of 5 already held
        layer.write(*(torch.ones(1, kv_heads, 5, dim, dtype=dtype) * sign for sign in (1, -1)))
    for rows in (1, 4, 300):  # the last grows the buffers
        joint, cos, sin = randn(rows, (heads + 2 * kv_heads) * dim), randn(rows, dim), randn(rows, dim)
        q, k, v = joint.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        want_q, want_k = torch.ops.ladechat_step.rope(q, k, heads, kv_heads, cos, sin)
        want = theirs.write(want_k[None], v.reshape(rows, kv_heads, dim).transpose(0, 1)[None])
        held, key_buffer, value_buffer = ours.room(rows)
        got_q = torch.ops.ladechat_step.rope_kv(joint, heads, kv_heads, cos, sin, key_buffer, value_buffer, held)
        got = ours.filled(held + rows)
        assert torch.equal(got_q, want_q) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    held, key_buffer, value_buffer = ours.room(1)
    with pytest.raises(RuntimeError, match="with room for the rows after `held`"):
        torch.ops.ladechat_step.rope_kv(randn(2, (heads + 2 * kv_heads) * dim), heads, kv_heads, randn(2, dim),
                                        randn(2, dim), key_buffer, value_buffer, key_buffer.shape[2] - 1)


def four_bit(model, lm_head: bool = False):
    """`model` with its layers' Linear weights (and lm_head's where asked) as random 4-bit codes,
    q/k/v and gate/up kept together as the 4-bit file keeps them (load/joined.py)."""
    generator = torch.Generator().manual_seed(9)
    names = [name for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and (".layers." in name or lm_head and name == "lm_head")]
    arrays = {}
    for name in names:
        rows, cols = model.get_submodule(name).weight.shape
        codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=generator)
        scales, lows = torch.rand(rows, cols // 32, generator=generator) * 0.02, -torch.rand(rows, cols // 32, generator=generator) * 0.1
        arrays.update(zip((f"{name}.{b}" for b in q4.BUFFERS), q4.layout(codes, scales, lows), strict=True))
    kept = joined.join_in_place(arrays)
    read = joined.KeptReader(kept.__getitem__, kept, model)
    for name in names:
        model.set_submodule(name, q4.Q4Linear(*(read(name, buffer) for buffer in q4.BUFFERS)))
    return model


@pytest.mark.parametrize("rotation", ["kernel", "torch"])
def test_on_4bit_weights_kept_together_the_steps_are_the_forward(rotation, request):
    """A tiny Llama whose Linear weights are 4-bit, q/k/v and gate/up kept together as the 4-bit
    file keeps them (load/joined.py): the Llama multiplies each group in one call and, with the
    rope kernel, rotates into the cache in one (rope_kv), or rotates column slices with torch's
    ops; either way every row's logits and the cache are the forward's, bit for bit."""
    if shutil.which(native.COMPILER) is None or q4.load(cache_root() / "kernels"):
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build the 4-bit kernel here")
    use_kernel = rotation == "kernel" and request.getfixturevalue("rope_kernel")
    model = four_bit(grouped("llama"))
    step = runners(model, use_kernel)[0].forward
    assert all(qkv is not None for _, qkv, *_ in step.layers)  # q/k/v in one call
    assert (step.rope_kv is not None) == use_kernel
    assert_steps_match(model, list(range(3, 40)), rope_kernel=use_kernel)


def test_a_prompt_in_parts_is_one_pass_where_each_row_is_computed_alone(rope_kernel, monkeypatch):
    """With 4-bit weights (the output layer's too) and the row-wise attention, whose rows' bits do
    not depend on the rows beside them, the Llama's prefill feeds a prompt in parts of PREFILL_CHUNK
    tokens and ranks the rows of two of them, and its ranks and cache are the model's forward's in
    one pass, on a first turn and on one that follows it."""
    from tiny_models import COMMON
    from transformers import LlamaConfig, LlamaForCausalLM

    from ladechat.engine import runner

    if shutil.which(native.COMPILER) is None or q4.load(cache_root() / "kernels"):
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build the 4-bit kernel here")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "head_dim": 64}, attn_implementation="sdpa")).eval()
    assert use_grouped_sdpa(model, rowwise=True) and model.config._attn_implementation == attention.ROWWISE
    four_bit(model, lm_head=True)
    ours, ref = runners(model)
    assert ours.forward.rows_alone
    monkeypatch.setattr(llama, "PREFILL_CHUNK", 5)
    monkeypatch.setattr(runner, "PREFILL_TOP_K", 7)
    first, second = list(range(3, 40)), [5, 9, 2, 7, 7, 1, 30, 31, 12, 60, 61, 62]
    for prompt, past in ((first, 0), (second, len(first))):
        ranked = ours.prefill(prompt, past)
        assert ranked.shape[0] == 7 and np.array_equal(ranked, ref.prefill(prompt, past))
        assert_caches_equal(ours, ref)
    assert np.array_equal(ours.prefill([4, 4, 4, 4, 4, 4], 49, ranked=False), ref.prefill([4, 4, 4, 4, 4, 4], 49, ranked=False))


def test_where_a_rows_bits_follow_the_row_count_a_prompt_is_one_pass(monkeypatch):
    """SDPA, dense products: a row's last bits may follow how many rows the call has, so a prompt
    in parts could differ from one pass; the Llama prefills in one, under a causal mask after a
    first turn, and ranks and caches what transformers' forward does, on every turn."""
    from ladechat.engine import runner

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 5)  # were it fed in parts, they would show
    monkeypatch.setattr(runner, "PREFILL_TOP_K", 7)
    for model in (grouped("llama"), ungrouped("llama")):
        ours, ref = runners(model)
        assert not ours.forward.rows_alone
        first, second = list(range(3, 40)), [5, 9, 2, 7, 7, 1, 30, 31, 12, 60, 61, 62]
        for prompt, past in ((first, 0), (second, len(first)), ([77], len(first) + len(second))):  # one row: no mask
            assert np.array_equal(ours.prefill(prompt, past), ref.prefill(prompt, past))
            assert_caches_equal(ours, ref)


def test_the_embedded_models_prefill_is_the_forwards_in_parts():
    """The embedded model as the chat loads it (its GGUF's blocks on ladechat's kernels, row-wise
    attention): its Llama prefills a prompt of 1,100 tokens in three parts, the ranked rows
    across two of them, and ranks and caches what the model's forward does in one pass."""
    lm = load(LoadSpec(dtype="float32", device="cpu"))
    ours, ref = runners(lm.model)
    if not ours.forward.rows_alone:
        pytest.skip(f"ladechat's kernels are not built here: {lm.weights}")
    prompt = [random.Random(5).randrange(lm.model.config.vocab_size) for _ in range(1100)]
    assert np.array_equal(ours.prefill(prompt, 0), ref.prefill(prompt, 0))
    assert_caches_equal(ours, ref)


@pytest.mark.parametrize("name", sorted(VARIANTS) + ["bf16"])
@pytest.mark.parametrize("rotation", ["kernel", "torch"])
def test_the_steps_follow_the_configs_variants(name, rotation, request):
    model = variant(**VARIANTS[name]) if name in VARIANTS else grouped("llama").to(torch.bfloat16)
    assert llama.accepts(model) is None
    if name == "yarn":
        assert model.model.rotary_emb.attention_scaling != 1.0
    use_kernel = rotation == "kernel" and request.getfixturevalue("rope_kernel")
    assert_steps_match(model, list(range(3, 40)), rope_kernel=use_kernel)


def test_a_one_token_prompt_steps_into_an_empty_cache():
    """Nothing to prefill: the first step makes the cache's layers itself."""
    own, theirs = runners(grouped("llama"))
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    ours = Session(own.model, la, step_cost=FLAT, runner=own)
    ref = Session(theirs.model, la, step_cost=FLAT, runner=theirs)
    assert tokens(ours, [7], 30) == tokens(ref, [7], 30)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_llama_answers_like_transformers_forward(family):
    """Greedy answers, plain and with lookahead at several W/N/G, over two turns (the second
    prefilled on top of the first's cache, past the rotary table's first length): token for token."""
    model = grouped(family)
    own = llama.Llama.adopt(model)
    rng = random.Random(f"lean-{family}")
    for w, n, g in CONFIGS:
        la = LookaheadConfig(window=w, ngram=n, candidates=g)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(25)] * 2
        ours = Session(own, la, step_cost=FLAT, runner=ModelRunner(own))
        ref = Session(model, la, step_cost=FLAT, runner=DynamicRunner(model))
        first = tokens(ours, prompt, 40)
        assert first == tokens(ref, prompt, 40), (family, w, n, g)
        second = prompt + first + [3, 1, 4] + [rng.randrange(96) for _ in range(llama.TABLE_MIN)]
        assert tokens(ours, second, 30) == tokens(ref, second, 30), (family, w, n, g)
        assert kv.cache_length(ours.runner.cache) == len(ours.cached) == len(ref.cached)


def test_a_llama_runs_its_own_steps_and_other_models_transformers_forward():
    assert type(default_runner(llama.Llama.adopt(grouped("llama")))) is ModelRunner
    assert type(Session(llama.Llama.adopt(grouped("qwen2")), LookaheadConfig()).runner) is ModelRunner
    assert type(default_runner(grouped("llama"))) is DynamicRunner  # transformers' model: its forward
    for family in ("gemma", "qwen3"):  # other layers (norms on q/k, scaled embeddings): their own forward
        assert family in llama.accepts(grouped(family))
    with pytest.raises(ValueError, match="cannot run this model: gemma"):
        llama.Llama.adopt(tiny_model("gemma"))
    sliding = grouped("mistral")
    sliding.config.sliding_window = 16
    assert llama.accepts(sliding) == "sliding-window attention"
    hooked = grouped("llama")  # as accelerate leaves a model placed by a device map
    hooked.model.layers[1]._hf_hook = object()
    assert "device map" in llama.accepts(hooked)
    eager = ungrouped("llama")
    eager.config._attn_implementation = "eager"
    assert "not SDPA" in llama.accepts(eager)
    # with groups, transformers' own SDPA repeats keys (or asks SDPA to): other sums in the last bits
    assert "not grouped SDPA" in llama.accepts(tiny_model("llama"))


def test_a_llama_scores_a_sequence_as_transformers_forward_does():
    """Called on one sequence it gives every position's logits, transformers' forward's bits."""
    model = grouped("llama")
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        assert torch.equal(llama.Llama.adopt(model)(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match=r"one sequence \(1, S\) at a time, not \(2, 3\)"):
        llama.Llama.adopt(model)(torch.ones(2, 3, dtype=torch.long))


def test_on_a_gpu_the_llama_steps_are_measured_but_no_default(monkeypatch):
    """The first GPU run found eager steps host-bound, so `ladechat bench step-cost` measures the
    Llama steps on CUDA too; loading there keeps transformers' forward until they are measured.
    Elsewhere (here: meta) they are refused either way."""
    model = grouped("llama")
    assert llama.accepts(model, gpu=True) is None  # a CPU: as without the flag
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    assert llama.accepts(model, gpu=True) is None
    assert "runs on the CPU" in llama.accepts(model)
    monkeypatch.setattr(model.config, "_attn_implementation", attention.ROWWISE)  # its kernel is the CPU's
    assert "row-wise attention runs on the CPU" in llama.accepts(model, gpu=True)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("meta")))
    assert "runs on the CPU" in llama.accepts(model, gpu=True)


def test_the_step_cost_bench_times_the_llama_steps_and_stops_at_their_failure_on_a_cpu(monkeypatch):
    """On a CPU a failing Llama step is a failure of the bench (a bug to see), not a note; a
    loaded Llama is timed through its twin's forward too."""
    from ladechat.bench import steps

    model = grouped("llama")
    result = steps.run(model, "tiny", sizes=(1, 4), context=8, reps=1)
    assert set(result["curves"]) == {"dynamic", "llama", "static"} and "llama_error" not in result
    packed = grouped("llama")
    packing.pack(packed)
    own = llama.Llama.adopt(packed)
    del packed
    result = steps.run(own, "tiny", sizes=(1, 4), context=8, reps=1)
    assert set(result["curves"]) == {"dynamic", "llama", "static"} and result["packed_weights"]
    assert not packing.is_packed(own)  # HF's generate ran on its modules unpacked in place, not on a second copy

    def broken(self, layout, past):
        raise RuntimeError("broken Llama step")

    monkeypatch.setattr(ModelRunner, "step", broken)
    with pytest.raises(RuntimeError, match="broken Llama step"):
        steps.run(model, "tiny", sizes=(1, 4), context=8, reps=1)


@pytest.fixture(scope="module")
def embedded_int4():
    if not int4.supported(torch.device("cpu")):
        pytest.skip("torch's int4 CPU kernel is measured and used on x86-64 only")
    return load(LoadSpec(dtype="float32", device="cpu", weights="int4"))


PROMPTS = ["Write a haiku about autumn leaves.", "How do I reverse a list in Python?"]


def test_embedded_int4_answers_are_the_models_forwards(embedded_int4):
    """The embedded model on int4 weights: its Llama's logits equal transformers' forward's, and
    greedy answers, plain and with lookahead, are token for token the same."""
    lm = embedded_int4
    assert type(default_runner(lm.model)) is ModelRunner
    twin = lm.model.transformers_twin()
    for layer in lm.model.model.layers:  # q/k/v and gate/up multiplied in one call each (llama.JOINED)
        attn, mlp = layer.self_attn, layer.mlp
        assert linear.joint_product([attn.q_proj, attn.k_proj, attn.v_proj], lm.model.dtype) is not None
        assert linear.joint_product([mlp.gate_proj, mlp.up_proj], lm.model.dtype) is not None
    for la in (LookaheadConfig(enabled=False, store=False),
               LookaheadConfig(window=3, ngram=3, candidates=3, store=False)):
        for text in PROMPTS:
            ids = templates.encode(lm.tokenizer, [{"role": "user", "content": text}])
            ours = tokens(Session(lm.model, la, step_cost=FLAT), ids, 40, lm.eos_ids)
            ref = tokens(Session(twin, la, step_cost=FLAT, runner=DynamicRunner(twin)), ids, 40, lm.eos_ids)
            assert len(ours) >= 20 and ours == ref


def test_embedded_int4_bf16_step_logits_are_the_forwards():
    """In a bf16 model the 4-bit kernel is called without casts: still the forward's logits, bit
    for bit, for a one-row step and a tree step."""
    if not int4.supported(torch.device("cpu")):
        pytest.skip("torch's int4 CPU kernel is measured and used on x86-64 only")
    assert_steps_match(load(LoadSpec(dtype="bfloat16", device="cpu", weights="int4")).model, list(range(100, 160)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_torchs_int4_kernel_the_step_logits_are_the_forwards(dtype):
    """Where no compiler builds ladechat's 4-bit kernel the same blocks run on torch's int4 kernel
    (int4.Int4Linear), which the Llama calls directly too: the forward's logits, bit for bit."""
    if not int4.supported(torch.device("cpu")):
        pytest.skip("torch's int4 CPU kernel is measured and used on x86-64 only")
    model = load(LoadSpec(dtype=dtype, device="cpu", weights="int4")).model
    for name, module in list(model.named_modules()):
        if type(module) is q4.Q4Linear:  # the same blocks on torch's kernel
            model.set_submodule(name, int4.Int4Linear.from_kernel_layout(module.tiles, module.scales, module.lows,
                                                                         module.bias, module.kind))
    assert quantized.weight_layout(model).startswith("int4:210,")
    assert_steps_match(model, list(range(100, 160)))


def test_the_chat_says_what_computes_its_steps(embedded_int4):
    """/show, --debug and the server's model card name the model file that runs the steps."""
    from ladechat.backends.local import Bot
    from ladechat.settings import Settings

    bot = Bot(embedded_int4, Settings(), step_cost=FLAT)
    assert bot.describe().startswith("SmolLM2-135M-Instruct (embedded, Q4_1) on cpu (float32; 210 Linear ")
    assert "from Q4_1 blocks" in bot.describe()
    assert bot.describe().endswith("; steps by engine/models/llama.py)")
    gemma = tiny_loaded()  # a model run by transformers' forward: nothing said
    gemma = replace(gemma, model=grouped("gemma"))
    assert Bot(gemma, Settings(), step_cost=FLAT).describe() == "tiny on cpu (float32)"


def test_loading_runs_the_llama_family_by_its_own_file_and_compile_by_transformers(tmp_path):
    """load() hands a Llama-family model to engine/models/llama.py, its modules taken by name (no
    copy); with own_forward off (--compile) the model stays transformers'; both answer alike."""
    from test_cli import tiny_model_folder
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "tiny", tiny_tokenizer())
    own = load(LoadSpec(model=str(folder), dtype="float32", device="cpu"))
    theirs = load(LoadSpec(model=str(folder), dtype="float32", device="cpu", pack_weights=False, own_forward=False))
    assert isinstance(own.model, llama.Llama) and type(default_runner(own.model)) is ModelRunner
    assert type(theirs.model).__name__ == "LlamaForCausalLM" and type(default_runner(theirs.model)) is DynamicRunner
    assert own.model.generation_config is not None and own.context_length == theirs.context_length
    def leaves(model) -> set[str]:
        return {name for name, module in model.named_modules() if name and not any(True for _ in module.children())}

    # the checkpoint's own names: every module that holds weights, under the same name
    assert leaves(own.model) == {n for n in leaves(theirs.model) if n != "model.rotary_emb" and not n.endswith(".act_fn")}
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    prompt = [5, 9, 2, 7, 7, 1, 30, 31, 12, 60, 61, 62]
    twin = transformers_model(own.model)  # the same (packed) modules under transformers' forward
    assert tokens(Session(own.model, la, step_cost=FLAT), prompt, 30) == \
        tokens(Session(twin, la, step_cost=FLAT, runner=DynamicRunner(twin)), prompt, 30)


def test_a_gguf_of_the_family_is_built_as_a_llama_without_transformers_model(monkeypatch):
    """The embedded GGUF on ladechat's kernels: the Llama is built empty from the config and
    filled by name from the file; no transformers model is made (its class is never asked), and
    its answers are transformers' generate() over the same modules."""
    from transformers import AutoModelForCausalLM

    from ladechat.engine.load.mask_probe import mask_probe

    if not int4.supported(torch.device("cpu")) or shutil.which(native.COMPILER) is None \
            or q4.load(cache_root() / "kernels"):
        pytest.skip("ladechat's block kernels do not run here (x86-64 and a C++ compiler): transformers' model is built")

    def no_transformers_model(*args, **kwargs):
        raise AssertionError("a transformers model was built")

    with monkeypatch.context() as patched:
        patched.setattr(AutoModelForCausalLM, "from_config", no_transformers_model)
        patched.setattr(AutoModelForCausalLM, "from_pretrained", no_transformers_model)
        lm = load(LoadSpec(dtype="float32", device="cpu"))
    assert isinstance(lm.model, llama.Llama) and "from Q4_1 blocks" in lm.weights
    assert lm.model.config.tie_word_embeddings and type(lm.model.lm_head).__name__ == "Q8Linear"
    assert_steps_match(lm.model, list(range(100, 160)))
    assert mask_probe(lm.model)  # the load's probe: transformers' forward over the Llama's modules


def test_built_empty_the_llama_has_transformers_shapes_and_rotary_frequencies():
    """Llama.empty's modules have the shapes, biases and names of transformers' model of the same
    config, and its rotary frequencies are the same floats, for each family and RoPE variant."""
    from tiny_models import COMMON
    from transformers import AutoConfig, AutoModelForCausalLM

    configs = [AutoConfig.for_model(family, **COMMON, **extra) for family, extra in
               (("llama", {}), ("mistral", {"sliding_window": None}), ("qwen2", {"use_sliding_window": False}),
                ("qwen2", {"use_sliding_window": False, "tie_word_embeddings": True, "head_dim": 32}))]
    configs += [AutoConfig.for_model("llama", **{**COMMON, **VARIANTS[name]}) for name in sorted(VARIANTS)]
    for config in configs:
        own = llama.Llama.empty(copy.deepcopy(config), torch.float32)  # each from a config no build has touched
        built = AutoModelForCausalLM.from_config(config)
        theirs = {n: tuple(p.shape) for n, p in built.named_parameters()}
        assert {n: tuple(p.shape) for n, p in own.named_parameters()} == theirs, config.model_type
        assert torch.equal(own.inv_freq, built.model.rotary_emb.inv_freq)
        assert own.rope_scale == built.model.rotary_emb.attention_scaling
        assert (own.lm_head.weight is own.model.embed_tokens.weight) is bool(config.tie_word_embeddings)
        assert {m.variance_epsilon for m in own.modules() if hasattr(m, "variance_epsilon")} == {config.rms_norm_eps}
    sliding = AutoConfig.for_model("mistral", **{**COMMON, "sliding_window": 16})
    assert llama.takes(sliding, "sdpa") == "sliding-window attention"
    with pytest.raises(ValueError, match="cannot run this model: attention 'eager', not SDPA"):
        llama.Llama.empty(configs[0], torch.float32, "eager")
