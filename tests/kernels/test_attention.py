"""Grouped-query attention under a mask (engine/kernels/attention.py): the same numbers as transformers'
SDPA path, and greedy lookahead on it token-identical to HF greedy on the unchanged model."""

import copy
import random

import pytest
import torch
from test_exactness import hf_greedy, repetitive_prompt, run
from tiny_models import FAMILIES, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ladechat.engine.config import LookaheadConfig
from ladechat.engine.kernels.attention import NAME, grouped_sdpa, use_grouped_sdpa
from ladechat.engine.load.loading import LoadSpec, load


class Heads(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


@pytest.mark.parametrize("groups,rows,cached,boolean", [(2, 1, 7, False), (3, 5, 40, False), (4, 16, 100, True),
                                                         (3, 9, 0, True)])
def test_grouped_attention_matches_transformers_sdpa(groups, rows, cached, boolean):
    torch.manual_seed(groups * 100 + rows)
    kv_heads, dim, keys = 2, 16, cached + rows
    query = torch.randn(1, kv_heads * groups, rows, dim)
    key, value = torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
    visible = torch.rand(rows, keys) < 0.6
    visible[:, 0] = True  # every row sees something
    mask = visible if boolean else torch.zeros(rows, keys).masked_fill(~visible, torch.finfo(torch.float32).min)
    mask = mask[None, None]
    module = Heads(groups)
    ours, _ = grouped_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert ours.shape == theirs.shape == (1, rows, kv_heads * groups, dim)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,cached", [(3, 0), (3, 200), (4, 33)])
def test_one_row_without_a_mask_is_stacked_and_matches_transformers_sdpa(groups, cached, dtype, monkeypatch):
    # plain decoding (and HF generate) feeds one row and no mask: transformers would ask SDPA for
    # enable_gqa, which is slow on a CPU in bf16; stacked, it is one plain SDPA over each group
    torch.manual_seed(groups + cached)
    kv_heads, dim = 3, 16
    query = torch.randn(1, kv_heads * groups, 1, dim, dtype=dtype)
    key, value = (torch.randn(1, kv_heads, cached + 1, dim, dtype=dtype) for _ in range(2))
    module = Heads(groups)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=dim**-0.5)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.shape, kw)) or sdpa(q, k, v, **kw))
    ours, _ = grouped_sdpa(module, query, key, value, None, scaling=dim**-0.5)
    assert seen == [((1, kv_heads, groups, dim), {"attn_mask": None, "scale": dim**-0.5})]  # no enable_gqa
    assert ours.shape == theirs.shape == (1, 1, kv_heads * groups, dim)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(ours, theirs, **tolerance)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lookahead_on_grouped_attention_equals_hf_greedy_on_the_unchanged_model(family):
    plain = tiny_model(family)
    grouped = copy.deepcopy(plain)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == NAME
    rng = random.Random(family)
    for w, n, g in [(3, 3, 4), (5, 4, 5), (1, 2, 3)]:
        prompt = repetitive_prompt(rng, plain.config.vocab_size, rng.randint(10, 60))
        max_new = rng.randint(20, 50)
        ours, steps, _ = run(grouped, prompt, LookaheadConfig(window=w, ngram=n, candidates=g), max_new)
        assert ours == hf_greedy(plain, prompt, max_new), (family, w, n, g)
        assert any(s.fed > 1 for s in steps)  # masked multi-row steps ran on it


def test_the_loader_uses_it_only_for_grouped_query_models(tmp_path, embedded_fp32):
    from test_cli import tiny_model_folder

    assert embedded_fp32.model.config._attn_implementation == NAME  # SmolLM2: 9 query heads, 3 key/value heads
    folder = tiny_model_folder(tmp_path, embedded_fp32.tokenizer, num_attention_heads=2, num_key_value_heads=2)
    loaded = load(LoadSpec(model=str(folder), dtype="float32", device="cpu"))
    assert loaded.model.config._attn_implementation == "sdpa"
    eager = load(LoadSpec(model=str(folder), dtype="float32", device="cpu", attn="eager"))
    assert eager.model.config._attn_implementation == "eager"
