"""Greedy lookahead output == model.generate(do_sample=False) output, token for token, in fp32."""

import random
import zlib

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.draft.store import AnswerStore
from ladechat.engine.events import Done, Step
from ladechat.engine.kernels.attention import use_grouped_sdpa
from ladechat.engine.models import llama, transformers_model
from ladechat.engine.runner import ModelRunner, default_runner
from ladechat.engine.step_cost import CostModel

MODELS = {}


def model_for(family, grouped: bool = False):
    """The family's tiny model with transformers' SDPA, or (grouped) with ladechat's grouped
    attention as load() sets it, and for the Llama family run by engine/models/llama.py, as load()
    runs it."""
    if (family, grouped) not in MODELS:
        model = tiny_model(family)
        if grouped:
            assert use_grouped_sdpa(model)
            if llama.accepts(model) is None:
                model = llama.Llama.adopt(model)
        MODELS[family, grouped] = model
    return MODELS[family, grouped]


def run(model, prompt, la, max_new, eos=frozenset()):
    steps, done = [], None
    for event in generate(Session(model, la), prompt, SamplingConfig(max_new_tokens=max_new), eos):
        if isinstance(event, Step):
            steps.append(event)
        else:
            done = event
    assert isinstance(done, Done)
    return list(done.text_tokens), steps, done.stats


def hf_greedy(model, prompt, max_new, eos=None):
    ids = torch.tensor([prompt])
    # an explicit mask: otherwise generate() masks out prompt tokens equal to pad_token_id
    out = transformers_model(model).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def repetitive_prompt(rng, vocab, length):
    # Random models settle into loops; a prompt with repeats gives the pool something to find.
    motif = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
    noise = [rng.randrange(vocab) for _ in range(rng.randint(2, 10))]
    return (noise + motif * 4)[:length]


GRID = [(f, w, n, g) for f in FAMILIES for (w, n, g) in
        [(1, 2, 0), (1, 2, 3), (3, 2, 2), (5, 4, 5), (4, 3, 0), (2, 5, 7), (7, 5, 7), (1, 4, 4)]]


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
@pytest.mark.parametrize("family,w,n,g", GRID)
def test_greedy_identical_to_generate(family, w, n, g, attention):
    model = model_for(family, grouped=attention == "grouped")
    # ladechat's Llama steps run where the model is grouped and of their families; transformers' forward elsewhere
    assert (type(default_runner(model)) is ModelRunner) == (attention == "grouped" and family in llama.FAMILIES)
    rng = random.Random(zlib.crc32(f"{family}-{w}-{n}-{g}".encode()))
    for trial in range(2):
        prompt = repetitive_prompt(rng, model.config.vocab_size, rng.randint(5, 40))
        max_new = rng.randint(20, 60)
        ours, steps, stats = run(model, prompt, LookaheadConfig(window=w, ngram=n, candidates=g), max_new)
        assert ours == hf_greedy(model, prompt, max_new), (family, w, n, g, trial)
        assert len(ours) == max_new
        assert sum(len(s.tokens) for s in steps) == max_new
        assert stats.steps == len(steps)


def test_seeded_random_grid():
    """Many more (family, W, N, G, prompt, length) combinations from one seeded generator."""
    rng = random.Random(1234)
    for _ in range(30):
        family = rng.choice(sorted(FAMILIES))
        model = model_for(family)
        la = LookaheadConfig(window=rng.randint(1, 8), ngram=rng.randint(2, 6), candidates=rng.randint(0, 8),
                             context_candidates=rng.randint(0, 3), context_len=rng.randint(1, 10),
                             seed_pool=rng.random() < 0.8)
        prompt = repetitive_prompt(rng, model.config.vocab_size, rng.randint(2, 50))
        max_new = rng.randint(1, 50)
        ours, _, _ = run(model, prompt, la, max_new)
        assert ours == hf_greedy(model, prompt, max_new), (family, la, prompt, max_new)


def _inside_block(steps):
    """Positions (1-based token counts) that fall strictly inside a multi-token step."""
    inside, done = [], 0
    for s in steps:
        inside += [done + k for k in range(1, len(s.tokens))]
        done += len(s.tokens)
    return inside


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_max_new_tokens_inside_accepted_block(family):
    model = model_for(family)
    la = LookaheadConfig(window=5, ngram=5, candidates=5)
    prompt = repetitive_prompt(random.Random(7), model.config.vocab_size, 40)
    full, steps, _ = run(model, prompt, la, 80)
    cuts = _inside_block(steps)
    assert cuts, "speculation never accepted a multi-token block on a repetitive prompt"
    for cut in cuts[:3]:
        ours, _, stats = run(model, prompt, la, cut)
        assert ours == full[:cut] == hf_greedy(model, prompt, cut)
        assert stats.finish_reason == "length"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eos_inside_accepted_block(family):
    model = model_for(family)
    la = LookaheadConfig(window=5, ngram=5, candidates=5)
    found = None
    for seed in range(11, 41):
        prompt = repetitive_prompt(random.Random(seed), model.config.vocab_size, 40)
        full, steps, _ = run(model, prompt, la, 80)
        # an EOS id whose first appearance is inside a multi-token step
        hits = [cut for cut in _inside_block(steps) if full.index(full[cut - 1]) == cut - 1]
        if hits:
            found = (prompt, full, hits[0])
            break
    assert found, "no prompt made a token first appear inside an accepted block"
    prompt, full, cut = found
    eos = full[cut - 1]
    ours, _, stats = run(model, prompt, la, 80, eos=frozenset([eos]))
    assert ours == full[:cut] == hf_greedy(model, prompt, 80, eos=eos)
    assert ours[-1] == eos and stats.finish_reason == "eos"


def test_lookahead_off_is_plain_decoding():
    model = model_for("llama")
    prompt = repetitive_prompt(random.Random(3), model.config.vocab_size, 30)
    ours, steps, stats = run(model, prompt, LookaheadConfig(enabled=False), 40)
    assert ours == hf_greedy(model, prompt, 40)
    assert all(len(s.tokens) == 1 and s.fed == 1 and s.source == "plain" for s in steps)
    assert stats.compression == 1.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_steps_pass_the_cache_as_the_model_names_it(family):
    """No deprecation warning from transformers on any step (since 5.24 `past_key_values` warns on
    every call, which a user would see under every answer), and the answer is still exact."""
    import inspect
    import warnings

    from ladechat.engine.kv import cache_argument

    model = model_for(family)
    assert cache_argument(model) in inspect.signature(model.forward).parameters
    prompt = repetitive_prompt(random.Random(5), model.config.vocab_size, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        ours, _, _ = run(model, prompt, LookaheadConfig(window=3, ngram=3, candidates=2), 20)
        plain, _, _ = run(model, prompt, LookaheadConfig(enabled=False), 20)
    assert ours == plain == hf_greedy(model, prompt, 20)


def test_session_reuses_cache_across_turns():
    """A second prompt that extends the first prefills only the new tokens and stays exact."""
    model = model_for("qwen2")
    la = LookaheadConfig(window=4, ngram=3, candidates=4)
    session = Session(model, la)
    first = repetitive_prompt(random.Random(5), model.config.vocab_size, 30)
    events = list(generate(session, first, SamplingConfig(max_new_tokens=20), frozenset()))
    answer = list(events[-1].text_tokens)
    second = first + answer + [1, 2, 3]
    events = list(generate(session, second, SamplingConfig(max_new_tokens=30), frozenset()))
    stats = events[-1].stats
    assert stats.prefill_tokens == 3  # the answer's KV was already there (its last token is the step input)
    assert list(events[-1].text_tokens) == hf_greedy(model, second, 30)


@pytest.mark.parametrize("curve", [
    {1: 1.0, 2: 1.8, 4: 1.9, 8: 2.0, 64: 4.0},  # steep: the window is mostly left out
    {1: 1.0, 64: 1.01},  # flat (GPU-like): always the full step
])
def test_cost_aware_planning_stays_exact(curve):
    rng = random.Random(99)
    for family in ("llama", "qwen3"):
        model = model_for(family)
        for _ in range(4):
            prompt = repetitive_prompt(rng, model.config.vocab_size, rng.randint(5, 40))
            la = LookaheadConfig(window=rng.randint(1, 6), ngram=rng.randint(2, 5), candidates=rng.randint(0, 6))
            events = list(generate(Session(model, la, step_cost=CostModel({192: curve})), prompt, SamplingConfig(max_new_tokens=40),
                                   frozenset()))
            assert list(events[-1].text_tokens) == hf_greedy(model, prompt, 40)
            fed = [e.fed for e in events[:-1]]
            if len(curve) == 2:
                assert all(f >= la.window * (la.ngram - 1) for f in fed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recycled_drafts_alone_stay_exact_and_are_accepted(family):
    """Only the model's recycled top-k drafts (no window, pool or context matches), full steps."""
    model = model_for(family)
    rng = random.Random(zlib.crc32(family.encode()))
    accepted = 0
    for _ in range(3):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 30))]
        la = LookaheadConfig(window=1, ngram=2, candidates=0, context_candidates=0, recycle=12)
        ours, steps, stats = run(model, prompt, la, 50)
        assert ours == hf_greedy(model, prompt, 50)
        accepted += stats.source_counts.get("recycle", 0)
    assert accepted > 0  # random models loop: the model's own top-1 successors are right often


@pytest.mark.parametrize("family", list(FAMILIES))
def test_store_drafts_alone_stay_exact_and_are_accepted(family):
    """Only drafts from the store of past answers, filled with the model's answers to other
    prompts (no window, pool, conversation matches or recycled top-k), full steps."""
    model = model_for(family)
    rng = random.Random(zlib.crc32(b"store" + family.encode()))
    store = AnswerStore()
    fill = LookaheadConfig(enabled=False)
    for _ in range(4):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 30))]
        list(generate(Session(model, fill, store=store), prompt, SamplingConfig(max_new_tokens=50), frozenset()))
    assert store.answers == 4
    la = LookaheadConfig(window=1, ngram=2, candidates=0, context_candidates=0, recycle=0)
    accepted = 0
    for _ in range(3):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 30))]
        events = list(generate(Session(model, la, store=store), prompt, SamplingConfig(max_new_tokens=50), frozenset()))
        assert list(events[-1].text_tokens) == hf_greedy(model, prompt, 50)
        accepted += events[-1].stats.source_counts.get("store", 0)
    assert accepted > 0  # random models fall into the same loops from different prompts
    off = LookaheadConfig(window=1, ngram=2, candidates=0, context_candidates=0, recycle=0, store=False)
    before = len(store)
    events = list(generate(Session(model, off, store=store), prompt, SamplingConfig(max_new_tokens=50), frozenset()))
    assert "store" not in events[-1].stats.source_counts and len(store) == before  # off: not read, not written


def test_warm_session_stays_exact_on_other_prompts():
    """A session that learned acceptance rates and successors on one set of prompts decodes another
    set exactly (what the drafts learned only changes speed)."""
    rng = random.Random(7)
    model = model_for("llama")
    store = AnswerStore()
    session = Session(model, LookaheadConfig(window=2, ngram=3, candidates=2, recycle=16), store=store)
    for _ in range(3):  # warm up on unrelated prompts
        prompt = repetitive_prompt(rng, model.config.vocab_size, 30)
        list(generate(session, prompt, SamplingConfig(max_new_tokens=30), frozenset()))
    for _ in range(3):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 30))]
        events = list(generate(session, prompt, SamplingConfig(max_new_tokens=40), frozenset()))
        assert list(events[-1].text_tokens) == hf_greedy(model, prompt, 40)
    assert store.answers == 6
