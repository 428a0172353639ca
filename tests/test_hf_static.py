"""The bench's hf-static method: transformers' generate on one static cache, compiled once."""

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_loaded

from ladechat.bench import hf_static
from ladechat.bench.prompts import run
from ladechat.engine.models import transformers_model
from ladechat.settings import Settings


def test_the_cache_is_long_enough_for_every_turn_and_rounded():
    assert hf_static.cache_length(100, 1, 256, 8192) == 512  # 100 + 320, rounded up
    assert hf_static.cache_length(300, 2, 256, 8192) == 1024  # 300 + 2 x 320
    assert hf_static.cache_length(5000, 2, 256, 4096) == 4096  # never past the model's context


def test_compiled_once_for_a_whole_run_and_the_same_answers_as_hf(tmp_path):
    """Every answer of a two-item run (one of two turns) on one static cache: the decoding step
    compiles during the warm-up and never again, and the fp32 greedy answers equal HF's own."""
    data = tmp_path / "set.jsonl"
    data.write_text('{"turns": ["Hello there", "And then?"]}\n{"turns": ["def f(x): return x"]}\n')
    loaded = replace(tiny_loaded(), eos_ids=frozenset({2}))
    summary = run(loaded, [str(data)], ["hf-static"], Settings(max_new_tokens=12), limit=None, compile=True)
    report = summary["hf_static"]
    assert report == {"cache_length": 256, "graphs_first_answer": report["graphs_first_answer"], "recompiles": 0}
    assert report["graphs_first_answer"] >= 1  # it did compile
    row = summary["datasets"][str(data)]["hf-static"]
    assert row["items"] == 2 and row["tokens"] == summary["datasets"][str(data)]["hf"]["tokens"] > 0
    assert row["identical_items"] == 2
    assert summary["cudagraph_skips"] == 0  # reported whenever the bench compiles (no CUDA graphs on a CPU)


def test_uncompiled_it_compiles_nothing_and_reuses_its_cache():
    loaded = tiny_loaded()
    generator = hf_static.StaticGenerate(transformers_model(loaded.model), 256, compile=False)
    cache = generator.cache
    first, _ = generator.answer([1, 5, 6, 7], {"do_sample": False}, 6, [])
    again, _ = generator.answer([1, 5, 6, 7], {"do_sample": False}, 6, [])
    assert first == again and len(first) == 6  # the reset cache answers as a fresh one
    assert generator.cache is cache and generator.graphs == [0, 0]
    with torch.inference_mode():
        plain = transformers_model(loaded.model).generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert plain[0, 4:].tolist() == first


def test_a_conversation_longer_than_its_cache_is_a_one_line_error():
    generator = hf_static.StaticGenerate(transformers_model(tiny_loaded().model), 256, compile=False)
    with pytest.raises(hf_static.StaticCacheError, match="hf-static: a prompt of 250 tokens and 12 new ones do not fit its static "
                                         "cache of 256"):
        generator.answer([1] * 250, {"do_sample": False}, 12, [])
