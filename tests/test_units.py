"""Mask/positions against the diagram in layout.py, pool eviction, KV gather, stopping, config."""

import pytest
import torch
from transformers import DynamicCache

from ladechat.engine import kv
from ladechat.engine.draft.pool import NGramPool
from ladechat.engine.draft.suffix import SuffixIndex
from ladechat.engine.layout import build_layout, step_inputs, tree_layout, tree_mask
from ladechat.engine.load.placement import arguments as placement
from ladechat.engine.load.placement import choose_dtype, resolve_dtype
from ladechat.engine.load.spec import LoadSpec
from ladechat.engine.stopping import StopRule
from ladechat.engine.verify import verify

# The diagram of layout.py: W=3, N=3, candidates "a b" and "a c" (t=0, a=10, b=11, c=12).
DIAGRAM = """
x........
xx.......
xxx......
x..x.....
xx..x....
xxx..x...
x.....x..
x.....xx.
x.....x.x
"""


def diagram_layout():
    window = [[0, 1, 2], [3, 4, 5]]
    return build_layout(window, [((10, 11), "pool"), ((10, 12), "pool")])


def test_mask_matches_diagram():
    layout = diagram_layout()
    sees, depth = tree_mask(layout.parents)
    expected = [[c == "x" for c in row] for row in DIAGRAM.split()]
    assert sees.tolist() == expected
    assert depth.tolist() == [0, 1, 2, 1, 2, 3, 1, 2, 2]
    assert layout.tokens == [0, 1, 2, 3, 4, 5, 10, 11, 12]


def test_step_inputs_positions_and_committed_prefix():
    layout = diagram_layout()
    ids, positions, mask = step_inputs(layout, past=7, dtype=torch.float32, device=torch.device("cpu"))
    assert positions.tolist() == [[7, 8, 9, 8, 9, 10, 8, 9, 9]]
    assert mask.shape == (1, 1, 9, 16)
    assert (mask[0, 0, :, :7] == 0).all()  # every row sees all committed KV
    blocked = mask[0, 0, :, 7:] != 0
    assert blocked.tolist() == [[c != "x" for c in row] for row in DIAGRAM.split()]
    _, _, longer = step_inputs(layout, past=8, dtype=torch.float32, device=torch.device("cpu"))
    assert longer.shape == (1, 1, 9, 17) and longer.stride(-2) == 24  # rows SDPA's efficient kernel takes as they are
    assert torch.equal(longer[..., 1:], mask)  # one more committed token: one more visible column


def test_a_step_reads_the_logits_of_every_row():
    """Verification reads row 0 and the candidate rows, the window its last level, and the recycled
    successor table every row's top-k: a step returns them all, in row order, as the model computes
    them (the default runner and the fixed-shape one, which pads the step and drops the padding)."""
    from tiny_models import tiny_model

    from ladechat.engine.config import LookaheadConfig
    from ladechat.engine.runner import DynamicRunner, StaticRunner

    model = tiny_model("llama")
    layout = diagram_layout()
    ids, positions, mask = step_inputs(layout, past=4, dtype=model.dtype, device=model.device)
    la = LookaheadConfig(window=3, ngram=3, candidates=2, context_candidates=0, recycle=0, store=False)
    for runner in (DynamicRunner(model), StaticRunner(model, la, context_length=64)):
        runner.prefill([7, 8, 9, 10], 0)
        with torch.inference_mode():
            full = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         **{kv.cache_argument(model): _prefilled(model, [7, 8, 9, 10])}).logits[0]
        logits = runner.step(layout, 4)
        assert logits.shape == (layout.size, model.config.vocab_size)
        assert torch.allclose(logits, full, atol=1e-4), type(runner).__name__


def _prefilled(model, tokens):
    cache = kv.new_cache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), **{kv.cache_argument(model): cache}, use_cache=True)
    return cache


def test_verify_walks_trie_and_adds_bonus():
    layout = diagram_layout()
    choices = {0: 10, 6: 12, 8: 99}  # model says a, then c, then 99 (the bonus)
    accepted, matched, source = verify(layout, lambda row, path: choices[row])
    assert accepted == [10, 12, 99] and matched == [6, 8] and source == "pool"
    accepted, matched, source = verify(layout, lambda row, path: 42)
    assert accepted == [42] and matched == [] and source == "none"


def test_pool_evicts_least_recently_added():
    pool = NGramPool(ngram=3, per_key=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # re-added: most recent again
    pool.add(1, (6, 7))  # evicts (4, 5)
    assert pool.get(1) == [(6, 7), (2, 3)]
    assert len(pool) == 2
    zero = NGramPool(ngram=3, per_key=0)
    zero.add(1, (2, 3))
    assert zero.get(1) == [] and len(zero) == 0


def test_pool_seed_and_context_index():
    pool = NGramPool(ngram=3, per_key=4)
    pool.seed([1, 2, 3, 1, 2, 4])
    assert pool.get(1) == [(2, 4), (2, 3)]
    ctx = SuffixIndex()
    ctx.extend([5, 6, 7, 8, 5, 6])
    assert ctx.matches(ctx.tokens(), 3, 2) == [((7, 8, 5), 2)]
    ctx.truncate(3)
    assert ctx.tokens() == [5, 6, 7] and ctx.matches(ctx.tokens(), 3, 2) == []


@pytest.mark.parametrize("make", [DynamicCache, kv.GrowingCache])
def test_commit_kv_gathers_accepted_rows(make):
    cache = make()
    past, step = 4, 6
    keys = torch.arange(past + step, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 2, 1, 3)
    cache.update(keys.clone(), keys.clone() + 100, 0)
    cache.update(keys.clone(), keys.clone() + 100, 1)
    kv.commit_kv(cache, past, [0, 3, 5])
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 9]
        assert layer.values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 104, 107, 109]
    kv.commit_kv(cache, 5, [0, 1])  # a prefix: plain crop
    assert kv.cache_length(cache) == 7


@pytest.mark.parametrize("kind", ["growing", "rows"])
@pytest.mark.parametrize("gather", ["kernel", "torch"])
def test_a_growing_cache_writes_after_what_it_keeps_and_grows_past_its_room(gather, kind, monkeypatch):
    """Steps of 1-9 rows, each keeping some: a GrowingCache (transformers' forward's) and a
    RowsCache (a Llama's own steps') hold what a DynamicCache holds, through truncations, gathers
    (by ladechat's keep_rows kernel, or torch's ops where it is not loaded) and buffers growing
    (the first hold 256 positions)."""
    import random

    from ladechat.engine.kernels import native, step_ops
    from ladechat.paths import cache_root

    if gather == "kernel" and step_ops.load(cache_root() / "kernels"):
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build ladechat's step kernels here")
    if gather == "torch":
        monkeypatch.setattr(kv, "_moves_rows_on_host", lambda layers: False)

    rng = random.Random(5)
    growing = kv.GrowingCache() if kind == "growing" else kv.RowsCache(1, 2, 4, torch.float32, torch.device("cpu"))
    dynamic = DynamicCache()
    assert kv.cache_length(growing) == 0
    committed = 0
    for step in range(120):
        rows = rng.randint(1, 9)
        states = torch.randn(1, 2, rows, 4)
        for cache in (growing, dynamic):
            if cache is growing and kind == "rows":
                keys, _ = cache.layers[0].write(states, states * 2)
            else:
                keys, _ = cache.update(states, states * 2, 0)
            assert keys.shape[-2] == committed + rows
        keep = sorted({0, *rng.sample(range(rows), rng.randint(0, rows - 1))})
        for cache in (growing, dynamic):
            kv.commit_kv(cache, committed, keep, rows)
        committed += len(keep)
        if step == 60:  # a new turn reusing part of the conversation
            committed -= 7
            for cache in (growing, dynamic):
                kv.truncate(cache, committed)
        assert torch.equal(growing.layers[0].keys, dynamic.layers[0].keys)
        assert torch.equal(growing.layers[0].values, dynamic.layers[0].values)
    assert committed > kv.GROWING_MIN  # the buffers grew at least once
    assert growing.layers[0]._buffers[0].shape[-2] >= committed


def test_stop_rule():
    rule = StopRule(frozenset([9]), max_new_tokens=10)
    assert rule.cut([1, 2], [3, 9, 4]) == (2, "eos")
    assert rule.cut(list(range(8)), [1, 2, 3]) == (2, "length")
    assert rule.cut([], [1, 2]) == (2, None)
    text = {1: "he", 2: "llo", 3: " wor", 4: "ld"}
    words = StopRule(frozenset(), 100, ("lo w",), decode=lambda ids: "".join(text[i] for i in ids))
    assert words.cut([1], [2, 3, 4]) == (2, "stop")  # the token completing "lo w" is kept, not "ld"


def test_gpu_defaults_follow_the_step_cost_curve():
    from ladechat.engine.defaults import default_lookahead

    flat = {1: 1.0, 64: 1.02, 128: 1.05, 256: 1.2}  # an H100-like curve: a 256-row step costs 1.2x
    knee = {1: 1.0, 16: 1.05, 32: 1.1, 48: 1.3, 64: 2.0, 256: 8.0}  # rises steeply after 48 rows
    steep = {1: 1.0, 2: 1.8, 64: 10.0}  # a small CPU
    assert (default_lookahead("cuda", flat).window, default_lookahead("cuda", flat).candidates) == (15, 15)
    assert default_lookahead("cuda", knee).window == default_lookahead("cuda", knee).candidates == 6  # 48 // 8
    assert default_lookahead("cuda", steep).window == 1
    assert default_lookahead("cuda", None).window == 15 and default_lookahead("cuda", flat).ngram == 5
    assert default_lookahead("cpu", flat) == default_lookahead("cpu")  # CPU defaults were measured separately


def test_compiled_gpu_steps_take_the_paper_defaults_without_measuring(monkeypatch):
    """--compile on a GPU: W/N/G without the eager step-cost measurement (its curve is of eager
    exact-size steps; ~20 s of a start-up that must stay under a minute)."""
    from types import SimpleNamespace

    import torch

    from ladechat.backends.opener import settings_for
    from ladechat.engine import cost_envelope

    def measure(loaded):
        raise AssertionError("measured the eager step costs")

    knee = {1: 1.0, 16: 1.05, 32: 1.1, 48: 1.3, 64: 2.0, 256: 8.0}
    loaded = SimpleNamespace(device=torch.device("cuda", 0), tokenizer=None)
    monkeypatch.setattr(cost_envelope, "measured_curve", measure)
    compiled = settings_for({}, loaded, compile=True)
    assert (compiled.window, compiled.ngram, compiled.candidates) == (15, 5, 15)
    monkeypatch.setattr(cost_envelope, "measured_curve", lambda loaded: knee)
    assert settings_for({}, loaded).window == 6  # eager: from the measured curve
    assert settings_for({"window": 4}, loaded, compile=True).window == 4  # a flag still decides


def test_successor_table_keeps_the_latest_top_k_per_token():
    import numpy as np

    from ladechat.engine.draft.recycle import SuccessorTable

    table = SuccessorTable(k=3)
    assert table.successors(5) == [] and len(table) == 0
    table.update([5, 9, 5], np.array([[1, 2, 3], [4, 5, 6], [7, 8, 0]]))
    assert table.successors(5) == [7, 8, 0]  # the later row of token 5 wins
    assert table.successors(9) == [4, 5, 6] and table.successors(123456) == []
    table.update([70000], np.array([[1, 2, 3]]))  # grows to any token id
    assert table.successors(70000) == [1, 2, 3] and len(table) == 3


def test_successor_table_prefers_the_pair_of_tokens_and_falls_back_to_the_token():
    import numpy as np

    from ladechat.engine.draft.recycle import SuccessorTable

    table = SuccessorTable(k=2)
    table.update([5, 5, 9], np.array([[1, 2], [3, 4], [6, 7]]), [8, 2, -1])
    assert table.lookup(8, 5) == ([1, 2], True)  # after "8 5"
    assert table.lookup(2, 5) == ([3, 4], True)  # after "2 5", also the latest after 5 alone
    assert table.lookup(7, 5) == ([3, 4], False) and table.lookup(-1, 5) == ([3, 4], False)
    assert table.lookup(1, 9) == ([6, 7], False)  # 9 came with no previous token: no pair
    assert table.lookup(3, 4) == ([], False) and table.pairs() == 2
    small = SuccessorTable(k=2, pair_slots=1 << 4)
    for prev in range(100):  # more pairs than slots: the table stays its size, the newest pairs win
        small.update([5], np.array([[prev, prev + 1]]), [prev + 1000])
    assert small.pairs() <= 16 and small.lookup(1099, 5) == ([99, 100], True)


def test_one_row_updates_fill_the_successor_table_as_a_step_of_many_rows_does():
    """A one-row step's update (its own short path) leaves the table as the general one would."""
    import numpy as np

    from ladechat.engine.draft.recycle import SuccessorTable

    rng = np.random.default_rng(0)
    rows = [(int(rng.integers(0, 50)), int(rng.integers(-1, 50)), rng.integers(0, 50, 4)) for _ in range(200)]
    alone, general = SuccessorTable(k=3, pair_slots=1 << 5), SuccessorTable(k=3, pair_slots=1 << 5)
    for token, prev, top in rows:
        alone.update([token], top[None], [prev])
        general.update([token, token], np.stack([top, top]), [prev, prev])  # the same row twice: many rows
    for token in range(60):
        for prev in range(-1, 60):
            assert alone.lookup(prev, token) == general.lookup(prev, token)
    alone.update([77], np.array([[1, 2]]))  # rows narrower than k, no previous token; a new id grows the table
    assert alone.successors(77) == [1, 2] and alone.lookup(5, 77) == ([1, 2], False)


def test_acceptance_starts_at_the_prior_and_learns():
    from ladechat.engine.draft.tree import Acceptance

    acc = Acceptance()
    bucket = ("recycle", 0, 1)
    prior = acc.q(bucket)
    for _ in range(50):
        acc.record(bucket, True)
    assert acc.q(bucket) > 0.9 > prior
    for _ in range(800):
        acc.record(bucket, False)
    assert acc.q(bucket) < 0.1  # old evidence fades
    assert acc.observed["recycle"] == 50 and acc.predicted["recycle"] > 0


def test_draft_tree_merges_sources_and_worth_feeding_weighs_cost():
    from ladechat.engine.draft.tree import Acceptance, DraftTree, worth_feeding

    tree = DraftTree(Acceptance())
    tree.add_chain((10, 11, 12), "context", 4)
    successors = {7: [10, 20], 10: [11, 30], 11: [12], 20: [21]}
    tree.add_recycled(7, -1, lambda prev, tok: (successors.get(tok, []), False), limit=10)
    first = [n for n in tree.nodes if n.parent == -1]
    assert sorted(n.token for n in first) == [10, 20]  # 10 proposed twice, kept once
    flat = worth_feeding(tree, lambda size: 1.0)
    assert len(flat) == len(tree.nodes)  # free rows: every node is worth feeding
    for i, node in enumerate(flat):
        assert node.parent < i and node.p <= (1.0 if node.parent < 0 else flat[node.parent].p) + 1e-9
    assert worth_feeding(tree, lambda size: 1.0 if size == 1 else 10.0) == []  # too dear: a plain step
    assert len(worth_feeding(tree, None, limit=2)) == 2
    layout = tree_layout([[7]], flat)
    accepted, matched, source = verify(layout, lambda row, path: [10, 11, 12, 99][len(path)])
    assert accepted == [10, 11, 12, 99] and source == "context"


def test_suffix_matches_longest_first_then_most_recent():
    ctx = SuffixIndex()
    ctx.extend([1, 2, 3, 4, 5, 9, 2, 3, 4])
    assert ctx.matches(ctx.tokens(), 2, 4) == [((5, 9), 3)]
    ctx.extend([7, 1, 2])
    # "1 2" matched 2 tokens back; the later "2" after 9 only 1: both places count
    assert ctx.matches(ctx.tokens(), 2, 4) == [((3, 4), 2), ((3, 4), 1)]
    assert ctx.matches(ctx.tokens(), 2, 1) == [((3, 4), 2)]
    assert ctx.matches([8, 8], 2, 4) == []


def test_suffix_index_sorted_and_recent_parts_agree():
    """Past REINDEX tokens the keys move into sorted arrays; lookups, truncation and dropping the
    front give what a brute-force scan of the text gives."""
    import random

    from ladechat.engine.draft.suffix import REINDEX

    rng = random.Random(1)
    text = [rng.randrange(6) for _ in range(3 * REINDEX + 17)]
    ctx = SuffixIndex()
    for i in range(0, len(text), 7):
        ctx.extend(text[i : i + 7])
    assert ctx.tokens() == text and ctx.indexed > 0

    def brute(text, tail, length, limit):
        hits = []
        for end in range(1, len(text)):
            n = 0
            while n < min(16, len(tail), end) and text[end - 1 - n] == tail[-1 - n]:
                n += 1
            if n:
                hits.append((n, end))
        hits.sort(key=lambda h: (-h[0], -h[1]))
        return [(tuple(text[end : end + length]), n) for n, end in hits[:limit]]

    for tail_len in (1, 3, 9):
        tail = text[-tail_len:]
        got = ctx.matches(tail, 5, 6)
        want = brute(text, tail, 5, 60)
        assert got[0] == want[0]  # the longest, most recent match
        assert all(hit in want for hit in got) and [n for _, n in got] == sorted((n for _, n in got), reverse=True)
    ctx.truncate(REINDEX // 2)
    assert ctx.tokens() == text[: REINDEX // 2]
    assert ctx.matches(text[:3], 4, 1)[0] == brute(text[: REINDEX // 2], text[:3], 4, 1)[0]
    ctx.drop_front(10)
    assert ctx.tokens() == text[10 : REINDEX // 2]


def test_suffix_index_agrees_with_a_scan_through_small_and_large_appends_and_cuts():
    """The keys of recent tokens are made as they arrive (one by one for a step's few, with numpy
    for a prompt's many) and kept through truncation: every lookup still finds the longest, most
    recent match a scan of the text finds, segments never crossed."""
    import random

    from ladechat.engine.draft.suffix import REINDEX, SEP

    def scan(text, tail, length):
        hits = []
        for end in range(1, len(text)):
            n = 0
            while n < min(16, len(tail), end) and text[end - 1 - n] == tail[-1 - n]:
                n += 1
            cont = text[end : end + length]
            cont = cont[: cont.index(SEP)] if SEP in cont else cont
            if n and cont:
                hits.append((n, end, tuple(cont)))
        hits.sort(key=lambda h: (-h[0], -h[1]))
        return [(cont, n) for n, _, cont in hits]

    rng = random.Random(7)
    ctx, text = SuffixIndex(), []
    for round_ in range(300):
        roll = rng.random()
        if roll < 0.05 and text:
            keep = rng.randrange(len(text))
            ctx.truncate(keep)
            text = text[:keep]
        else:
            count = rng.choice([1, 2, 3, 40]) if roll < 0.97 else REINDEX // 3
            chunk = [SEP if rng.random() < 0.03 else rng.randrange(5) for _ in range(count)]
            ctx.extend(chunk)
            text += chunk
        assert ctx.tokens() == text
        tail = [tok for tok in text[-rng.randrange(1, 8):] if tok != SEP] or [1]
        got, want = ctx.matches(tail, 4, 6), scan(text, tail, 4)
        assert (got[:1] == want[:1]) and all(hit in want for hit in got), round_


def test_suffix_matches_never_cross_a_segment_end():
    from ladechat.engine.draft.suffix import SEP

    ctx = SuffixIndex()
    ctx.extend([1, 2, 3, SEP, 4, 5, SEP])
    assert ctx.matches([9, 1, 2], 5, 4) == [((3,), 2)]
    assert ctx.matches([3], 5, 4) == []  # 3 ends an answer: nothing follows it
    assert ctx.matches([3, 4], 5, 4) == [((5,), 1)]  # no key spans SEP


def test_answer_store_persists_caps_and_clears(tmp_path):
    from ladechat.engine.draft.store import AnswerStore, clear_stores, list_stores, store_path

    path = store_path(tmp_path, "org/model")
    store = AnswerStore.open(path, "org/model", vocab_size=100)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7])
    again = AnswerStore.open(path, "org/model", vocab_size=100)
    assert again.answers == 2 and again.matches([9, 5, 6], 3, 4) == [((7,), 2)]
    with open(path, "ab") as f:  # an answer cut short by a crash, mid-write
        f.write(b"\x08\x00\x00\x00\x09\x00")
    assert AnswerStore.open(path, "org/model", vocab_size=100).answers == 2
    assert AnswerStore.open(path, "org/model", vocab_size=6).answers == 0  # ids of another tokenizer
    [info] = list_stores(tmp_path)
    assert (info.model, info.answers) == ("org/model", 2)
    capped = AnswerStore(max_tokens=20)
    for start in range(0, 60, 6):
        capped.add(list(range(start, start + 5)))
    assert len(capped) <= 20 and capped.answers == len(capped) // 6
    assert capped.matches([54], 2, 1) == [((55, 56), 1)] and capped.matches([0], 2, 1) == []
    assert [i.model for i in clear_stores(tmp_path, "other")] == [] and path.exists()
    assert [i.model for i in clear_stores(tmp_path)] == ["org/model"] and not path.exists()


def test_draft_counts_agreeing_hits():
    from ladechat.engine.draft.tree import Acceptance, DraftTree

    tree = DraftTree(Acceptance())
    tree.add_matches("store", [((1, 2, 3), 4), ((1, 2, 9), 4), ((1, 5), 2), ((7,), 1)])
    by_path = {}
    for node in tree.nodes:
        prefix = by_path.get(node.parent, ())
        by_path[len(by_path)] = prefix + (node.token,)
    buckets = {by_path[i]: n.bucket for i, n in enumerate(tree.nodes)}
    assert buckets[(1,)] == ("store", 4, 1, 2)  # 3 of 4 hits agree on 1
    assert buckets[(7,)] == ("store", 1, 1, 0)
    assert buckets[(1, 2)] == ("store", 4, 2, 2)  # 2 of the 3 below 1
    assert buckets[(1, 2, 3)][3] == 1  # 1 of 2 below (1, 2)
    p = {by_path[i]: n.p for i, n in enumerate(tree.nodes)}
    assert p[(1,)] > p[(7,)] and p[(1, 2)] > p[(1, 5)]


def test_cost_model_interpolates_in_cached_length():
    from ladechat.engine.step_cost import CostModel

    model = CostModel({100: {1: 1.0, 8: 2.0}, 1100: {1: 2.0, 8: 6.0}})
    assert model.cost(1, 100) == 1.0 and model.cost(8, 1100) == 6.0
    assert model.cost(8, 600) == pytest.approx(4.0) and model.cost(8, 2100) == pytest.approx(10.0)
    assert model.cost(8, 0) == 2.0  # never below the shortest measured context


def test_step_cost_curve_is_measured_once_then_read_back(tmp_path, monkeypatch):
    from tiny_models import tiny_model

    from ladechat.engine.step_cost import SIZES, cached_curve
    from ladechat.paths import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tiny_model("llama")
    first = cached_curve(model, "tiny-llama", context=16)
    curves = list((cache_root() / "step-cost").iterdir())
    # the sizes up to where a step got dear (measure()): at least two, from the first on
    assert len(curves) == 1 and len(first) >= 2 and sorted(first) == list(SIZES[: len(first)])
    assert cached_curve(model, "tiny-llama", context=16) == first  # read back: a new measurement would differ
    assert len(list((cache_root() / "step-cost").iterdir())) == 1
    cached_curve(model, "tiny-llama", context=32)  # another cache length is another curve
    assert len(list((cache_root() / "step-cost").iterdir())) == 2


def fake_steps(monkeypatch, seconds_of):
    """step_cost.time_step replaced: each step takes seconds_of(rows) (no step runs); the sizes
    timed, in order, are returned."""
    from ladechat.engine import step_cost

    timed = []
    monkeypatch.setattr(step_cost, "time_step", lambda runner, layout, past: timed.append(layout.size) or seconds_of(layout.size))
    monkeypatch.setattr(step_cost, "prefill_random", lambda runner, context: None)
    return timed


def test_a_curve_stops_at_the_first_size_past_three_one_row_steps(monkeypatch):
    """On a 7B on 2 cores every row costs: sizes that no draft could pay for are not measured (the
    planner extrapolates past the last), and slow steps are timed fewer times."""
    from tiny_models import tiny_model

    from ladechat.engine.step_cost import AFFORDABLE, SIZES, SLOW_REPS, SLOW_STEP_S, measure

    model = tiny_model("llama")
    timed = fake_steps(monkeypatch, lambda rows: 0.001 * (1 + 0.25 * rows))  # 3x the first at 10.25 rows
    curve = measure(model, SIZES, 16, reps=5)
    assert AFFORDABLE == 3.0 and list(curve) == [1, 2, 4, 8, 12]  # 12 is the first past: measured, the last
    assert timed == [1, 1, 2, 2, 4, 4, 8, 8, 12, 12] + [1, 2, 4, 8, 12] * 5  # a warm-up round (each twice), five
    spells = iter([0.001, 0.001, 0.009, 0.0011] + [0.001] * 1000)  # a busy spell in size 2's first step
    timed = fake_steps(monkeypatch, lambda rows: next(spells))
    assert list(measure(model, SIZES, 16, reps=1)) == list(SIZES)  # not cut short by it
    timed = fake_steps(monkeypatch, lambda rows: SLOW_STEP_S * 2 * (1 + rows))
    curve = measure(model, SIZES, 16, reps=5)
    # timed once past the first in the warm-up, which is one of the repetitions
    assert list(curve) == [1, 2, 4, 8] and timed == [1, 1, 2, 4, 8] + [1, 2, 4, 8] * (SLOW_REPS - 1)
    timed = fake_steps(monkeypatch, lambda rows: 0.001)  # flat: every size
    assert list(measure(model, SIZES, 16, reps=1)) == list(SIZES)
    timed = fake_steps(monkeypatch, lambda rows: 0.001 * rows)
    assert list(measure(model, (2, 4, 8), 16, reps=1, affordable=None)) == [2, 4, 8]  # exactly these sizes
    assert timed[-6:] == [2, 4, 8, 2, 4, 8]  # a warm-up step each (nothing to decide from it), then the rep


def test_the_longer_context_is_the_shorter_curve_plus_a_line_through_two_steps(tmp_path, monkeypatch):
    """After a long cache only the narrowest and the widest step are timed: the curve there is the
    shorter one (its sizes, its shape) plus the attention the longer cache adds, a line in the rows
    through those two; never below the shorter curve."""
    from tiny_models import tiny_model

    from ladechat.engine import step_cost
    from ladechat.engine.step_cost import CONTEXTS, cached_cost_model, measure_beside

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tiny_model("llama")
    short, long = CONTEXTS

    def weights(rows):  # a kernel that tiles rows by 4: a step within a tile costs one tile's pass
        return 0.001 * (1 + 0.5 * -(-rows // 4))

    def attention(rows, past):
        return 0.0 if past == short else 2e-4 + 5e-5 * rows

    timed = []
    monkeypatch.setattr(step_cost, "time_step", lambda runner, layout, past: timed.append((layout.size, past))
                        or weights(layout.size) + attention(layout.size, past))
    monkeypatch.setattr(step_cost, "prefill_random", lambda runner, context: None)
    costs = cached_cost_model(model, "tiny-llama")
    sizes = list(costs.curves[short])
    assert sizes == [1, 2, 4, 8, 12, 16, 24, 32] and list(costs.curves[long]) == sizes  # 32: past 3x one row
    assert {size for size, past in timed if past == long} == {1, 32}
    for size in sizes:
        assert costs.curves[long][size] == pytest.approx(weights(size) + attention(size, long))
    # a longer cache measured as cheaper (a quiet spell): the shorter curve, not below it
    assert measure_beside(model, {1: 0.01, 4: 0.012, 8: 0.02}, long) == {1: 0.01, 4: 0.012, 8: 0.02}


@pytest.mark.parametrize("forward", ["transformers", "llama"])
def test_a_long_context_is_the_prefilled_one_repeated(forward):
    """prefill_random computes PREFILLED tokens and repeats their keys and values to the length asked
    (what a step attends over, not what it holds, is what it costs), in transformers' cache and in
    the Llama's own."""
    from tiny_models import tiny_model

    from ladechat.engine import kv
    from ladechat.engine.kernels.attention import use_grouped_sdpa
    from ladechat.engine.models.llama import Llama
    from ladechat.engine.runner import DynamicRunner, ModelRunner
    from ladechat.engine.step_cost import PREFILLED, prefill_random

    model = tiny_model("llama")
    assert use_grouped_sdpa(model)  # as loading does: the Llama's grouped attention
    runner = DynamicRunner(model) if forward == "transformers" else ModelRunner(Llama.adopt(model))
    assert isinstance(runner.cache, kv.GrowingCache if forward == "transformers" else kv.RowsCache)
    prefill_random(runner, 100)
    assert kv.cache_length(runner.cache) == 100
    for layer in runner.cache.layers:
        assert torch.equal(layer.keys[..., PREFILLED : 2 * PREFILLED, :], layer.keys[..., :PREFILLED, :])
        assert torch.equal(layer.values[..., 96:100, :], layer.values[..., :4, :])
    assert not kv.repeat_to(runner.new_cache(), 10)  # nothing to repeat: the caller prefills


@pytest.mark.parametrize("name,device_type,native,expected", [
    ("auto", "cuda", True, torch.bfloat16), ("auto", "cuda", False, torch.float16),
    ("auto", "cpu", True, torch.bfloat16), ("auto", "cpu", False, torch.float32), ("auto", "mps", True, torch.float32),
    ("float32", "cuda", True, torch.float32), ("bf16", "cuda", False, torch.bfloat16),
])
def test_choose_dtype(name, device_type, native, expected):
    assert choose_dtype(name, device_type, native) == expected


def test_the_context_cap_defaults_to_the_model_up_to_8192_and_never_exceeds_it():
    from ladechat.engine.load.context import context_cap
    from ladechat.engine.load.spec import LoadError

    assert context_cap(131072, None) == 8192  # a 128k model's cache cannot grow until memory runs out
    assert context_cap(2048, None) == 2048
    assert context_cap(131072, 32768) == 32768
    assert context_cap(2048, 2048) == 2048
    with pytest.raises(LoadError, match="--ctx 4096 is more than the model's context of 2048 tokens"):
        context_cap(2048, 4096)
    with pytest.raises(LoadError, match="--ctx must be at least 64 tokens, got 8"):
        LoadSpec(context_size=8)  # checked when the spec is built, before any load


def test_the_bench_runs_the_chats_own_weights():
    """`ladechat bench` without --weights measures what users run: the chat's auto (a GGUF's blocks on
    ladechat's kernels); dense with --compile, which traces the model's own Linear modules."""
    from ladechat.engine.load.loading import bench_weights

    assert bench_weights(compile=False) == "auto"
    assert bench_weights(compile=True) == "dense"


# /proc/cpuinfo flags of the two CPU classes the suite runs on (trimmed), and of an AVX-512 CPU without bf16
AVX2_EPYC = "flags : fpu sse4_2 avx f16c fma avx2 bmi2 vaes vpclmulqdq sha_ni clzero"
AVX512_EPYC = "flags : fpu avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512_bitalg vaes"
AVX512_NO_BF16 = "flags : fpu avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni"


@pytest.mark.parametrize("cpuinfo,native,dtype", [(AVX2_EPYC, False, torch.float32), (AVX512_EPYC, True, torch.bfloat16),
                                                  (AVX512_NO_BF16, False, torch.float32), ("", False, torch.float32)])
def test_auto_dtype_on_each_cpu_class(cpuinfo, native, dtype):
    """bf16 by default only where the CPU computes it natively; fp32 on the AVX2-only class."""
    from ladechat.engine.load.placement import cpu_has_native_bf16

    assert cpu_has_native_bf16(cpuinfo) is native
    assert choose_dtype("auto", "cpu", cpu_has_native_bf16(cpuinfo)) == dtype


@pytest.mark.parametrize("capability,expected", [((7, 5), torch.float16), ((7, 0), torch.float16),
                                                 ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_dtype_asks_the_chosen_gpu(monkeypatch, capability, expected):
    """T4 (7.5) and V100 (7.0) only emulate bf16: fp16 there. The capability asked is cuda:1's."""
    asked = []

    def get_device_capability(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert resolve_dtype("auto", torch.device("cuda", 1)) == expected
    assert asked == [torch.device("cuda", 1)]


def test_weights_load_straight_onto_the_chosen_device():
    gpu1 = torch.device("cuda", 1)
    hub = "org/model"  # bitsandbytes quantizes a Hugging Face model, never a GGUF's blocks
    assert placement(LoadSpec(model=hub, load_in_4bit=True), gpu1) == {"device_map": {"": "cuda:1"}}
    assert placement(LoadSpec(model=hub, load_in_8bit=True), torch.device("cpu")) == {"device_map": {"": "cpu"}}
    assert placement(LoadSpec(), gpu1) == {"device_map": {"": "cuda:1"}}  # never a full copy in RAM first
    assert placement(LoadSpec(), torch.device("cpu")) == {}
    assert placement(LoadSpec(model=hub, load_in_4bit=True, device_map="auto"), gpu1) == {"device_map": "auto"}


def test_mask_probe_verdict_is_remembered_per_folder(tmp_path, monkeypatch):
    """A local folder's 'honours a 4D mask' verdict is kept in the cache and found again, and a
    change to the folder's files asks again (the probe is three forward passes at every start)."""
    from test_cli import tiny_model_folder
    from tiny_models import tiny_tokenizer

    from ladechat.engine.load.loading import load
    from ladechat.engine.load.mask_probe import honours_tree_mask
    from ladechat.engine.models import transformers_model
    from ladechat.paths import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    model = transformers_model(load(LoadSpec(model=str(folder), dtype="float32", device="cpu")).model)
    verdicts = cache_root() / "mask-probe"
    assert len(list(verdicts.iterdir())) == 1
    attn = model.config._attn_implementation  # the key names the implementation in use
    assert honours_tree_mask(model, str(folder), attn) and len(list(verdicts.iterdir())) == 1  # found again
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert honours_tree_mask(model, str(folder), attn) and len(list(verdicts.iterdir())) == 2  # asked again
    assert honours_tree_mask(model, None, attn) and len(list(verdicts.iterdir())) == 2  # hub ids: never kept
    # our mask and attention code is part of every kept verdict: an upgraded ladechat asks again
    from ladechat.engine import layout
    from ladechat.engine.kernels import attention
    from ladechat.paths import source_digest

    ours = source_digest(attention.__file__, layout.__file__)
    assert all(ours in verdict.read_text() for verdict in verdicts.iterdir())


def test_source_digest_follows_the_files_content(tmp_path):
    from ladechat.paths import source_digest

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    before = source_digest(str(a), str(b))
    assert source_digest(str(a), str(b)) == before and len(before) == 16
    a.write_text("x = 1  # edited\n")
    assert source_digest(str(a), str(b)) != before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_step_bench_model_is_built_in_its_dtype(dtype):
    """A 7B shape is built in its dtype (an fp32 build then a cast peaks at twice the memory), and
    the size the out-of-memory message quotes is the real parameter count."""
    from ladechat.bench import steps as step_bench

    model = step_bench.random_model("tiny", dtype, torch.device("cpu"), pack_weights=False)  # weights as parameters
    assert {p.dtype for p in model.parameters()} == {dtype} and model.config.dtype == dtype
    assert step_bench._parameters("tiny") == sum(p.numel() for p in model.parameters())
    assert step_bench._parameters("llama-2-7b") == 6_738_415_616  # Llama-2-7b's published count


def test_step_rows_go_where_every_device_accepts_them():
    """On one device the row index goes there; under a device map over several devices the last
    hidden states can sit on another GPU than model.device (and a tied output layer's weight on the
    first), so the index goes on the CPU, which every device accepts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ladechat.engine.layout import rows_device

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)
    model = LlamaForCausalLM(config).to("meta")  # stands for a GPU: not the CPU
    assert rows_device(model) == torch.device("meta")
    model.hf_device_map = {"": "meta"}  # a one-device map (how weights now load onto a GPU)
    assert rows_device(model) == torch.device("meta")
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "model.norm": 1, "lm_head": 0}
    assert rows_device(model) == torch.device("cpu")


def test_bench_tables_say_which_weights_each_method_ran_on():
    """On packed weights the tables name the two layouts, and only a greedy run claims to compare
    answers with hf-packed's (a sampled run compares none)."""
    from ladechat.ui.report import bench_tables

    row = {"items": 1, "tokens": 8, "tokens_per_s": 10.0, "speedup_vs_hf": 1.0, "compression": None,
           "item_geomean_vs_hf": 1.0, "item_p10_vs_hf": 1.0, "items_slower_than_hf": 0, "identical_items": 1}
    results = {"model": "m", "dtype": "float32", "device": "cpu", "max_new_tokens": 8, "W": 2, "N": 3, "G": 1,
               "datasets": {"set": {"hf": row}}, "overall": {"hf": row}}
    assert [t.caption for t in bench_tables({**results, "packed_weights": False})] == [None, None]
    greedy = bench_tables({**results, "packed_weights": True, "temperature": 0.0})[0].caption
    sampled = bench_tables({**results, "packed_weights": True, "temperature": 0.7})[0].caption
    assert greedy.startswith("hf and HF's prompt lookup run the weights as transformers loads them")
    assert greedy.endswith("compared with hf-packed's") and "compared" not in sampled


def test_suffix_key_of_one_lookup_is_the_indexed_key():
    """A lookup hashes its few tokens in Python integers, the index in numpy's uint64: the same
    key, or no lookup would find what the index holds."""
    import numpy as np

    from ladechat.engine.draft import suffix

    for tokens in ([0], [1], [5, 7], [3, 9, 4000, 2], [49151, 0, 12, 5], [2**31 - 1] * 4):
        text = np.asarray(tokens, dtype=np.int32)
        indexed = suffix._keys(text, len(tokens), np.array([len(tokens)]))[0]
        assert suffix._key(tokens) == indexed and isinstance(suffix._key(tokens), np.uint64)


def test_a_slow_phase_shows_what_it_is_and_for_how_long_on_a_terminal_only():
    """progress(message) of the load, the step-cost measuring and --compile's warm-up: a spinner,
    the phase and its elapsed time on a terminal, gone when it ends; nothing in a pipe."""
    import io

    from rich.console import Console

    from ladechat.ui.phase import phases

    screen = io.StringIO()
    with phases(Console(file=screen, force_terminal=True, width=100))("compiling the decoding steps"):
        pass
    shown = screen.getvalue()
    assert "compiling the decoding steps" in shown and "0:00:00" in shown
    piped = io.StringIO()
    with phases(Console(file=piped, force_terminal=False))("compiling the decoding steps"):
        pass
    assert piped.getvalue() == ""


def test_keep_rows_refuses_rows_out_of_order_before_changing_anything():
    from ladechat.engine.kernels import native, step_ops
    from ladechat.paths import cache_root

    if step_ops.load(cache_root() / "kernels"):
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build ladechat's step kernels here")
    first, second = torch.arange(24.0).view(1, 1, 6, 4), torch.arange(12.0).view(1, 1, 3, 4)
    before = first.clone()
    with pytest.raises(RuntimeError, match="rows must be ascending"):
        torch.ops.ladechat_step.keep_rows([first], 1, [0, 3, 2])
    with pytest.raises(RuntimeError, match="a row past the tensor's positions"):
        torch.ops.ladechat_step.keep_rows([first, second], 1, [0, 3])  # the second is too short
    assert torch.equal(first, before)  # nothing moved in the first either
    torch.ops.ladechat_step.keep_rows([first], 1, [0, 3, 4])
    assert first[0, 0, :4, 0].tolist() == [0, 4, 16, 20]


def test_a_tree_mask_needs_each_parent_before_its_children():
    sees, depth = tree_mask([-1, 0, 0, 2])
    assert sees.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]] and depth.tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="row 1's parent 2 does not come before it"):
        tree_mask([-1, 2, 0])


def stats_for_context(prompt: int, new: int, cap: int):
    from ladechat.engine.events import Stats

    return Stats(new_tokens=new, steps=new, prompt_tokens=prompt, prefill_tokens=prompt, prefill_s=0.1, ttft_s=0.1,
                 decode_s=1.0, total_s=1.1, accepted_histogram={1: new}, accepted_by_position=(), source_counts={},
                 pool_size=0, mean_fed=1.0, lookahead=False, window=1, ngram=2, candidates=1, finish_reason="eos",
                 context_length=cap)


def test_the_context_in_view_and_the_warning_before_it_is_full():
    from ladechat.engine.events import Stats
    from ladechat.ui.stream import context_line, nearly_full

    assert context_line(None).startswith("no answer yet")
    assert context_line(stats_for_context(10, 5, 0)) == "the server does not report its context size"
    line = context_line(stats_for_context(1000, 24, 8192))
    assert line.startswith("context: 1,024 of 8,192 tokens (12%) after the last answer (1,000 in the conversation")
    assert nearly_full(stats_for_context(1000, 24, 8192)) is None
    assert nearly_full(stats_for_context(10, 5, 0)) is None
    full = nearly_full(stats_for_context(6000, 600, 8192))
    assert full.startswith("the conversation fills 81% of the context (6,600 of 8,192 tokens)")
    # what a server sends survives the trip
    again = Stats.from_dict(stats_for_context(6000, 600, 8192).as_dict())
    assert again.context_length == 8192 and Stats.from_dict({**again.as_dict(), "context_length": 0}).context_length == 0


def test_users_are_told_where_a_lookahead_answer_can_part_from_plain_decoding():
    """From given facts, so every machine checks the GPU's cases: the CPU's paths that are identical
    say nothing; a GPU in half precision, bitsandbytes' 4-bit on a GPU and LLM.int8 anywhere say so
    (the H200's measurements: BENCHMARKS.md)."""
    from ladechat.engine.load.placement import parting_notices

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert parting_notices("cpu", fp32, False, False) == []
    assert parting_notices("cpu", bf16, True, False) == []
    assert parting_notices("cuda", fp32, False, False) == []
    gpu = parting_notices("cuda", bf16, False, False)
    assert len(gpu) == 1 and "on a GPU in bfloat16" in gpu[0] and "--dtype float32" in gpu[0]
    assert "float16" in parting_notices("cuda", fp16, False, False)[0]
    four = parting_notices("cuda", bf16, True, False)
    assert len(four) == 1 and four[0].startswith("4-bit weights (bitsandbytes) on a GPU")
    assert "--load-in-4bit keeps them identical" in parting_notices("cpu", fp32, False, True)[0]
    assert "--load-in-4bit" not in parting_notices("cuda", bf16, False, True)[0]


def test_the_settings_before_a_load_import_neither_torch_nor_transformers():
    """The chat shows its prompt while the model loads: the settings' check before a model is loaded
    (opener.settings_for with none, as the bench's flags are checked) imports none of the heavy
    modules (a subprocess: this one has them; the spec's own check: tests/test_spec.py)."""
    import subprocess
    import sys

    script = ("import sys\nfrom ladechat.backends.opener import settings_for\nsettings_for({}, None)\n"
              "print(sorted(m for m in ('torch', 'transformers', 'ladechat.engine.step_cost') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_prompt_the_tokenizer_turns_into_nothing_is_one_line(monkeypatch):
    from tiny_models import tiny_tokenizer

    from ladechat import templates
    from ladechat.conversation import Conversation, ConversationError

    monkeypatch.setattr(templates, "encode", lambda tokenizer, messages, template, tools=None: [])
    conversation = Conversation(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ConversationError, match="^the model's tokenizer turns this prompt into no tokens$"):
        conversation.encode(tiny_tokenizer(), None, 100)
    assert conversation.messages == [{"role": "user", "content": "hi"}]


def test_the_kernels_build_step_names_each_library_or_why_not(tmp_path):
    """`python -m ladechat.engine.load.build_kernels` (the Makefile's install step): each library's path, exit
    status 0; with no compiler on the PATH and nothing built, one line each saying so, status 1."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from conftest import PATIENCE_S

    from ladechat.engine.kernels import native, q4, step_ops
    from ladechat.paths import cache_root

    command = [sys.executable, "-m", "ladechat.engine.load.build_kernels"]
    if shutil.which(native.COMPILER) is not None:
        built = subprocess.run(command, capture_output=True, text=True, check=False, timeout=PATIENCE_S)
        assert built.returncode == 0, built.stdout + built.stderr
        lines = built.stdout.splitlines()
        assert [line.split(": ")[0] for line in lines] == ["blocks.cpp", "step_ops.cpp"]
        assert all(Path(line.split(": ", 1)[1]).parent == cache_root() / "kernels" for line in lines)
        assert native.built_before(q4.SOURCE, cache_root() / "kernels") and native.built_before(step_ops.SOURCE, cache_root() / "kernels")
    bare = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PATH": str(tmp_path)}
    none = subprocess.run(command, capture_output=True, text=True, check=False, env=bare, timeout=PATIENCE_S)
    assert none.returncode == 1
    assert none.stdout.splitlines() == [f"blocks.cpp: not built: no C++ compiler ({native.COMPILER}) to build blocks.cpp",
                                        f"step_ops.cpp: not built: no C++ compiler ({native.COMPILER}) to build step_ops.cpp"]
