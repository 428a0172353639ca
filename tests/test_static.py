"""The fixed-shape path (static KV cache, padded steps, optionally compiled) is exact too."""

import contextlib
import random

import pytest
import torch
from test_exactness import hf_greedy, model_for, repetitive_prompt
from tiny_models import FAMILIES

from ladechat.engine import kv
from ladechat.engine.config import ConfigError, LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.layout import build_layout, fixed_step_inputs, step_inputs
from ladechat.engine.runner import CompiledForward, StaticRunner, max_step_size

CONFIGS = [(1, 2, 0), (1, 2, 3), (3, 2, 2), (5, 4, 5), (2, 5, 7), (1, 4, 4)]


def static_run(model, prompt, la, max_new, runner=None, eos=frozenset()):
    session = Session(model, la, runner=runner or StaticRunner(model, la, context_length=256))
    events = list(generate(session, prompt, SamplingConfig(max_new_tokens=max_new), eos))
    return list(events[-1].text_tokens), events[:-1], session


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_greedy_identical_to_generate(family):
    model = model_for(family)
    rng = random.Random(f"static-{family}")
    for w, n, g in CONFIGS:
        prompt = repetitive_prompt(rng, model.config.vocab_size, rng.randint(5, 40))
        max_new = rng.randint(20, 50)
        la = LookaheadConfig(window=w, ngram=n, candidates=g)
        ours, steps, session = static_run(model, prompt, la, max_new)
        assert ours == hf_greedy(model, prompt, max_new), (family, w, n, g)
        assert kv.cache_length(session.runner.cache) == len(prompt) + max_new - 1 == len(session.cached)
        # every lookahead step fed its full tree (no cost-based trimming on a fixed shape)
        assert all(s.fed > 1 for s in steps) or w * (n - 1) == 1


def test_static_seeded_random_grid_and_session_reuse():
    rng = random.Random(4321)
    for _ in range(12):
        family = rng.choice(sorted(FAMILIES))
        model = model_for(family)
        la = LookaheadConfig(window=rng.randint(1, 6), ngram=rng.randint(2, 5), candidates=rng.randint(0, 6),
                             context_candidates=rng.randint(0, 3), context_len=rng.randint(1, 8))
        runner = StaticRunner(model, la, context_length=256)
        first = repetitive_prompt(rng, model.config.vocab_size, rng.randint(2, 40))
        answer, _, session = static_run(model, first, la, rng.randint(1, 40), runner=runner)
        assert answer == hf_greedy(model, first, len(answer))
        # the next turn extends the conversation: only new tokens are prefilled, W/N/G may change
        second = first + answer + [3, 1, 4]
        session.configure(LookaheadConfig(window=rng.randint(1, 6), ngram=rng.randint(2, 5), candidates=2))
        events = list(generate(session, second, SamplingConfig(max_new_tokens=30), frozenset()))
        assert events[-1].stats.prefill_tokens == 3
        assert list(events[-1].text_tokens) == hf_greedy(model, second, 30)


def test_static_eos_and_lookahead_off():
    model = model_for("mistral")
    prompt = repetitive_prompt(random.Random(12), model.config.vocab_size, 30)
    full = hf_greedy(model, prompt, 40)
    la = LookaheadConfig(window=4, ngram=4, candidates=4)
    eos = full[25]
    ours, _, _ = static_run(model, prompt, la, 40, eos=frozenset([eos]))
    assert ours == full[: full.index(eos) + 1]
    ours, steps, _ = static_run(model, prompt, LookaheadConfig(enabled=False), 40)
    assert ours == full and all(s.fed == 1 for s in steps)


def test_compiled_step_is_exact():
    """torch.compile of the fixed-shape step (one graph for lookahead, one more once it is off) on
    a tiny Llama with the grouped-query attention the chat runs, against HF greedy on the
    unchanged model."""
    import copy

    from ladechat.engine.kernels.attention import use_grouped_sdpa

    plain = model_for("llama")
    model = copy.deepcopy(plain)
    assert use_grouped_sdpa(model)
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    runner = StaticRunner(model, la, context_length=256, compiled=CompiledForward(model))
    compiled, shapes = runner.forward, []
    runner.forward = lambda **inputs: shapes.append(inputs["input_ids"].shape[1]) or compiled(**inputs)
    prompt = repetitive_prompt(random.Random(21), model.config.vocab_size, 30)
    ours, steps, session = static_run(model, prompt, la, 40, runner=runner)
    assert ours == hf_greedy(plain, prompt, 40)
    assert any(len(s.tokens) > 1 for s in steps)
    assert set(shapes) == {max_step_size(la)}  # one shape to compile: every step padded to the full one
    session.reset()
    session.configure(LookaheadConfig(window=3, ngram=3, candidates=3, enabled=False))
    shapes.clear()
    events = list(generate(session, prompt, SamplingConfig(max_new_tokens=20), frozenset()))
    assert list(events[-1].text_tokens) == hf_greedy(plain, prompt, 20)
    assert set(shapes) == {1}


def test_fixed_step_inputs_pad_rows_and_mask_the_free_slots():
    layout = build_layout([[10, 11, 12], [13, 14, 15]], [((20, 21), "pool"), ((20, 22), "pool")])
    past, size, cache_len = 7, 12, 24
    ids, positions, mask = fixed_step_inputs(layout, past, size, cache_len, torch.float32, torch.device("cpu"))
    _, exact_positions, exact_mask = step_inputs(layout, past, torch.float32, torch.device("cpu"))
    real = layout.size
    assert ids.shape == (1, size) and ids[0, real:].tolist() == [0] * (size - real)
    assert positions[0, :real].tolist() == exact_positions[0].tolist()
    assert positions[0, real:].tolist() == [past] * (size - real)
    assert mask.shape == (1, 1, size, cache_len)
    visible = mask[0, 0] == 0
    assert torch.equal(visible[:real, : past + real], exact_mask[0, 0] == 0)  # same tree as the exact step
    assert not visible[:real, past + real :].any()  # real rows never see padding or free slots
    for row in range(real, size):  # a pad row sees the committed prefix and itself only
        assert visible[row].nonzero().flatten().tolist() == list(range(past)) + [past + row]


def test_fixed_step_size_limit():
    la = LookaheadConfig(window=64, ngram=16, candidates=64)
    assert max_step_size(la) > 512
    with pytest.raises(ConfigError, match="more than the 512 a fixed-shape step allows"):
        StaticRunner(model_for("llama"), la, context_length=64)


def test_static_cache_grows_and_keeps_the_conversation():
    model = model_for("qwen3")
    la = LookaheadConfig(window=3, ngram=4, candidates=3)
    # 16 slots + MAX_FIXED_STEP (512) of room for a step: a 700+ token conversation needs several doublings
    runner = StaticRunner(model, la, context_length=1024, first_length=16)
    start = runner.length
    prompt = (repetitive_prompt(random.Random(8), model.config.vocab_size, 40) * 40)[:700]
    ours, _, session = static_run(model, prompt, la, 60, runner=runner)
    assert runner.length > start and ours == hf_greedy(model, prompt, 60)
    assert kv.cache_length(session.runner.cache) == len(prompt) + 59


def test_a_commit_moves_every_layer_in_one_gather():
    # GPU readiness: per-layer index_select/copy/fill would be ~160 kernel launches a step
    model = model_for("llama")
    la = LookaheadConfig(window=2, ngram=3, candidates=2)
    runner = StaticRunner(model, la, context_length=2048, first_length=16)
    assert runner.packed is None  # no layer exists before the first forward pass
    prompt = repetitive_prompt(random.Random(3), model.config.vocab_size, 30)
    ours, _, session = static_run(model, prompt, la, 40, runner=runner)
    assert ours == hf_greedy(model, prompt, 40)  # exact on the packed cache
    packed = runner.packed
    assert packed is not None and packed.states.shape[0] == model.config.num_hidden_layers
    base = packed.states.untyped_storage().data_ptr()
    assert all(layer.keys.untyped_storage().data_ptr() == layer.values.untyped_storage().data_ptr() == base
               for layer in runner.cache.layers)
    past = len(session.cached)
    runner.step(build_layout([[5, 6, 7, 8, 9]], []), past)
    expected = [layer.keys[..., [past, past + 2, past + 4], :].clone() for layer in runner.cache.layers]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.commit(past, [0, 2, 4])
    counts = {event.key: event.count for event in prof.key_averages()}
    assert counts.get("aten::index_select") == 1 and counts.get("aten::fill_") == 1
    assert counts.get("aten::copy_") == 1
    for layer, rows in zip(runner.cache.layers, expected, strict=True):  # the rows moved, in every layer
        assert torch.equal(layer.keys[..., past : past + 3, :], rows)
    assert kv.cache_length(runner.cache) == past + 3
    runner.truncate(past)  # one fill for all layers too
    assert {int(layer.cumulative_length) for layer in runner.cache.layers} == {past}
    grown = runner.length
    kept = [layer.values[..., :past, :].clone() for layer in runner.cache.layers]
    runner.reserve(grown + 10, past)  # a grown cache is packed from the start
    assert runner.length > grown and runner.packed is not packed and runner.packed is not None
    assert all(layer.keys.untyped_storage().data_ptr() == runner.packed.states.untyped_storage().data_ptr()
               for layer in runner.cache.layers)
    assert kv.cache_length(runner.cache) == past
    for layer, rows in zip(runner.cache.layers, kept, strict=True):  # the committed positions came along
        assert torch.equal(layer.values[..., :past, :], rows)


def test_a_grow_that_runs_out_of_memory_leaves_the_old_cache_in_use(monkeypatch):
    model = model_for("llama")
    la = LookaheadConfig(window=2, ngram=3, candidates=2)
    runner = StaticRunner(model, la, context_length=2048, first_length=16)
    runner.prefill([1, 2, 3, 4], 0)
    cache, packed, length = runner.cache, runner.packed, runner.length

    def no_memory(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(kv, "grow_packed", no_memory)
    with pytest.raises(RuntimeError):
        runner.reserve(runner.length + 10, 4)
    assert runner.cache is cache and runner.packed is packed and runner.length == length


class RecordingRunner(StaticRunner):
    """A StaticRunner that notes the cache length every step sees and every warm-up."""

    def __init__(self, *args, **kwargs):
        self.lengths, self.warm_ups = [], 0
        super().__init__(*args, **kwargs)

    def step(self, layout, past):
        self.lengths.append(self.length)
        return super().step(layout, past)

    def warm_up(self, committed):
        self.warm_ups += 1
        super().warm_up(committed)


def test_the_cache_grows_before_a_turn_never_during_it():
    model = model_for("llama")
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    runner = RecordingRunner(model, la, context_length=1024, first_length=16)
    runner.compiled = True  # what a compiled runner does on growth, without paying for the compile
    prompt = repetitive_prompt(random.Random(5), model.config.vocab_size, 40)
    start, grown = runner.length, runner.grows_for(len(prompt) + 600)
    assert grown is not None and grown > start
    ours, _, session = static_run(model, prompt, la, 600, runner=runner)
    assert ours == hf_greedy(model, prompt, 600)
    assert set(runner.lengths) == {grown} and runner.warm_ups == 1  # grown and warmed once, up front
    assert runner.grows_for(len(ours) + len(prompt) + 10) is None  # a turn that fits needs nothing
    runner.lengths.clear()
    longer = prompt + ours + prompt
    assert list(generate(session, longer, SamplingConfig(max_new_tokens=10), frozenset()))[-1].text_tokens
    assert len(set(runner.lengths)) == 1 and runner.warm_ups == 1


def test_the_chat_says_why_a_turn_waits_for_the_cache_to_grow():
    from tiny_models import tiny_loaded

    from ladechat.backends.events import Notice
    from ladechat.backends.local import Bot
    from ladechat.conversation import Conversation
    from ladechat.settings import Settings

    loaded = tiny_loaded()
    settings = Settings(max_new_tokens=600, store=False)
    bot = Bot(loaded, settings)
    la = settings.lookahead_config()
    runner = StaticRunner(loaded.model, la, loaded.context_length, first_length=16)
    bot.session = Session(loaded.model, la, runner=runner)
    conversation = Conversation(messages=[{"role": "user", "content": "hello there"}])
    grown = runner.grows_for(len(bot.prompt_ids(conversation)[0]) + 600)
    assert grown is not None and grown > runner.length
    notices = [e.text for e in bot.reply(conversation) if isinstance(e, Notice)]
    assert notices == [f"growing the KV cache to {grown} tokens for this turn"] and runner.length == grown
    assert [e for e in bot.reply(conversation) if isinstance(e, Notice)] == []  # the same turn again fits


class Doubler(torch.nn.Module):
    device = torch.device("cpu")

    def forward(self, x):
        return x * 2


def test_compiled_steps_have_an_explicit_limit_not_a_silent_eager_fallback():
    compiled = CompiledForward(Doubler(), limit=2)
    for n in (2, 3):  # two shapes: two graphs
        assert compiled(x=torch.ones(n)).tolist() == [2.0] * n
    with pytest.raises(ConfigError, match="this model has compiled 2 step shapes .* restart ladechat"):
        compiled(x=torch.ones(4))  # torch alone would run it eagerly, unannounced
    assert compiled(x=torch.ones(3)).tolist() == [2.0] * 3  # the shapes it has keep working


def test_one_compiled_forward_per_model_shared_by_its_runners():
    from tiny_models import tiny_loaded

    from ladechat.backends.local import Bot
    from ladechat.settings import Settings

    loaded = tiny_loaded()
    from ladechat.engine.runner import compiled_forward

    assert compiled_forward(loaded.model) is compiled_forward(loaded.model)
    first, second = (Bot(loaded, Settings(store=False), compile=True) for _ in range(2))
    assert first.session.runner.forward is second.session.runner.forward is compiled_forward(loaded.model)
    assert first.describe().endswith("; steps by torch.compile, one fixed shape)")  # /show and --debug say so


def test_a_warm_up_stopped_by_ctrl_c_is_done_again_at_the_next_turn():
    class StoppedOnce(RecordingRunner):
        def warm_up(self, committed):
            self.warm_ups += 1
            if self.warm_ups == 1:  # Ctrl-C while the first warm-up compiles
                raise KeyboardInterrupt
            StaticRunner.warm_up(self, committed)

    model = model_for("llama")
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    runner = StoppedOnce(model, la, context_length=1024, first_length=16)
    runner.compiled = True
    session = Session(model, la, runner=runner)
    prompt = repetitive_prompt(random.Random(6), model.config.vocab_size, 30)
    stopped = list(generate(session, prompt, SamplingConfig(max_new_tokens=600), frozenset()))[-1]
    assert stopped.stats.finish_reason == "interrupted" and not stopped.text_tokens
    done = list(generate(session, prompt, SamplingConfig(max_new_tokens=600), frozenset()))[-1]
    assert runner.warm_ups == 2 and list(done.text_tokens) == hf_greedy(model, prompt, 600)


def test_a_default_compile_that_fails_leaves_the_steps_uncompiled_with_a_notice():
    """--compile is the default on a GPU (backends/opener.compiles); a model it cannot compile (here sliding-window
    layers, which the fixed-shape cache does not hold) answers uncompiled and says why, unless the
    user asked for --compile."""
    from tiny_models import COMMON, tiny_tokenizer
    from transformers import MistralConfig, MistralForCausalLM

    from ladechat.backends.opener import compiled_or_not
    from ladechat.engine.load.loading import LoadedModel

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**{**COMMON, "vocab_size": len(tokenizer), "sliding_window": 16})).eval()
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny-sliding", device=model.device, dtype=model.dtype,
                         eos_ids=frozenset(), context_length=256)
    phases = []
    progress = lambda message: phases.append(message) or contextlib.nullcontext()
    _, bot = compiled_or_not(loaded, {"store": False}, True, True, progress)
    assert not bot.compiled and not bot.session.runner.fixed
    [notice] = bot.notices
    assert notice == ("the decoding steps run uncompiled, not compiled: fixed-shape steps (--compile) do not support "
                      "this model's sliding-window layers (--no-compile skips the try)")
    with pytest.raises(ConfigError, match="sliding-window layers"):  # asked for: the error is the user's to see
        compiled_or_not(loaded, {"store": False}, True, False, progress)


def test_compile_is_the_default_on_one_cuda_gpu_only():
    import subprocess
    import sys

    from ladechat.backends.opener import compiles
    from ladechat.engine.defaults import compiles_by_default

    assert compiles_by_default("cuda", quantized=False, mapped=False, weights="auto")
    assert not compiles_by_default("cpu", quantized=False, mapped=False, weights="auto")
    assert not compiles_by_default("cuda", quantized=True, mapped=False, weights="auto")  # bitsandbytes' layers
    assert not compiles_by_default("cuda", quantized=False, mapped=True, weights="auto")  # a device map
    from ladechat.backends.spec import Spec
    from ladechat.engine.load.spec import LoadSpec

    assert compiles(Spec(compile=True)) and not compiles(Spec(LoadSpec(device="cuda"), compile=False))
    assert not compiles(Spec()) and not compiles(Spec(LoadSpec(device="cpu")))  # this CPU-only torch
    # deciding it on a CPU build of torch does not import torch (the chat's prompt comes at once)
    code = ("import sys; from ladechat.backends.opener import compiles; from ladechat.backends.spec import Spec; "
            "print(compiles(Spec()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.parametrize("line, cuda", [("cuda: Optional[str] = None", False), ("cuda = None", False),
                                        ("cuda: Optional[str] = '13.0'", True), ("cuda = '12.8'", True)])
def test_a_torch_build_with_cuda_is_told_from_its_version_file(tmp_path, line, cuda):
    import subprocess
    import sys

    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (fake / "version.py").write_text(f"__version__ = '2.13.0'\ndebug = False\n{line}\nhip = None\n")
    code = "from ladechat.backends.opener import torch_has_cuda; print(torch_has_cuda())"
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == str(cuda)


def test_compiled_steps_take_each_cache_tensor_as_its_own_static_input():
    """CUDA graphs (--compile on a GPU) replay only graphs whose mutated inputs are static and not
    views of one another: aliased inputs that are written get a synthetic base, a fresh input,
    and torch then skips the CUDA graph ("skipping cudagraphs due to mutated inputs", seen on an
    H200 when the compiled runner's layers were views of one packed tensor). Checked here on the
    graph inputs torch.compile hands its backend."""
    loaded_model = model_for("llama")
    inputs_seen = []

    def backend(graph, example_inputs):
        inputs_seen.append([t for t in example_inputs if isinstance(t, torch.Tensor)])
        return graph.forward

    class RecordingCompile(CompiledForward):
        def __init__(self, model):
            self.gpu, self.limit = False, 8
            self.fn = torch.compile(model.forward, backend=backend, dynamic=False)

    la = LookaheadConfig(window=2, ngram=3, candidates=1)
    runner = StaticRunner(loaded_model, la, context_length=256, compiled=RecordingCompile(loaded_model))
    runner.warm_up(0)
    [inputs] = inputs_seen
    layers = [t for layer in runner.cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
    cache_inputs = [t for t in inputs if any(t is layer for layer in layers)]
    assert len(cache_inputs) == len(layers)  # every layer's keys, values and length: graph inputs
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in cache_inputs)  # fixed addresses
    storages = {t.untyped_storage().data_ptr() for t in cache_inputs}
    assert len(storages) == len(cache_inputs)  # none a view of another


def test_each_thread_that_runs_compiled_steps_has_its_own_cuda_graph_state():
    """A server answers on its model thread: torch before 2.13 keeps CUDA-graph bookkeeping only in
    the thread that imported it and fails an assertion in any other (pytorch#123177).
    own_cudagraph_state gives a thread its own, which torch's lookups then find."""
    import threading

    from torch._inductor import cudagraph_trees

    from ladechat.engine.runner import own_cudagraph_state

    main = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
    found = {}

    def model_thread():
        found["before"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        own_cudagraph_state()
        found["after"] = hasattr(cudagraph_trees.local, "tree_manager_containers")  # before torch's own lookup
        found["registered"] = torch._C._is_key_in_tls("tree_manager_containers")
        found["containers"] = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
        found["container"] = cudagraph_trees.get_container(0)
        own_cudagraph_state()  # a second call keeps what the first made
        found["kept"] = cudagraph_trees.local.tree_manager_containers is found["containers"]

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert found["before"] is False and found["after"] and found["registered"]  # a plain thread starts without it
    assert found["containers"] is not main and found["containers"] == {0: found["container"]} and found["kept"]


def test_a_new_step_shape_is_compiled_before_the_next_turn_not_during_it():
    """A server configures each request's settings and runs the turn; lookahead turned off there (a
    one-row shape) or W/N/G changed must compile in reserve, before the answer's clock starts."""
    model = model_for("llama")
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    runner = RecordingRunner(model, la, context_length=256)
    runner.compiled = True  # what a compiled runner does, without paying for the compile
    prompt = repetitive_prompt(random.Random(6), model.config.vocab_size, 20)
    ours, _, session = static_run(model, prompt, la, 10, runner=runner)
    assert runner.warm_ups == 0  # built warm (the chat warms it up itself at start)
    session.configure(la)  # the same settings: nothing to compile
    list(generate(session, prompt + ours, SamplingConfig(max_new_tokens=5), frozenset()))
    assert runner.warm_ups == 0
    session.configure(LookaheadConfig(window=3, ngram=3, candidates=3, enabled=False))
    runner.lengths.clear()
    events = list(generate(session, prompt, SamplingConfig(max_new_tokens=10), frozenset()))
    assert runner.warm_ups == 1 and list(events[-1].text_tokens) == hf_greedy(model, prompt, 10)
    session.configure(LookaheadConfig(window=2, ngram=3, candidates=3))  # a full shape again
    list(generate(session, prompt, SamplingConfig(max_new_tokens=5), frozenset()))
    assert runner.warm_ups == 2
    session.configure(LookaheadConfig(window=4, ngram=3, candidates=3))  # another W: another full shape
    list(generate(session, prompt, SamplingConfig(max_new_tokens=5), frozenset()))
    assert runner.warm_ups == 3


def test_the_step_cost_bench_times_fixed_steps_of_exactly_the_rows_it_names():
    from ladechat.bench.steps import fixed_config

    model = model_for("llama")
    runner = StaticRunner(model, fixed_config(8), context_length=256)
    for size in (1, 8, 16, 120):
        runner.configure(fixed_config(size))
        assert runner.shape == size
