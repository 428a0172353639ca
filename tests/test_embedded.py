"""The embedded SmolLM2 on real prompts: exact in fp32, and speculation really happens."""

import json

import torch

from ladechat import templates
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.models import transformers_model


def real_prompts(shared_data, per_set=3):
    prompts = []
    for name in ("mtbench-dev.jsonl", "humaneval-dev.jsonl", "gsm8k-dev.jsonl"):
        with open(shared_data / name, encoding="utf-8") as fh:
            items = [json.loads(line) for line in fh if line.strip()]
        prompts += [item["turns"][0] for item in items[:per_set]]
    return prompts


def test_embedded_greedy_identical_on_real_prompts(embedded_fp32, shared_data):
    lm = embedded_fp32
    prompts = real_prompts(shared_data)
    assert len(prompts) >= 9
    compressions, multi = [], 0
    for text in prompts:
        ids = templates.encode(lm.tokenizer, [{"role": "user", "content": text}])
        ref = transformers_model(lm.model).generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=48, do_sample=False, eos_token_id=sorted(lm.eos_ids),
                                pad_token_id=sorted(lm.eos_ids)[0])[0, len(ids):].tolist()
        events = list(generate(Session(lm.model, LookaheadConfig(window=5, ngram=4, candidates=5)), ids,
                               SamplingConfig(max_new_tokens=48), lm.eos_ids))
        done = events[-1]
        assert list(done.text_tokens) == ref, text[:60]
        compressions.append(done.stats.compression)
        multi += sum(n for k, n in done.stats.accepted_histogram.items() if k >= 3)
    assert sum(compressions) / len(compressions) > 1.0
    assert multi > 0, "no step accepted 3 or more tokens"
