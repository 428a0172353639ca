"""bitsandbytes 4-bit / 8-bit weights and accelerate disk offload on the CPU: lookahead unchanged."""

import pytest
import torch

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.load import packing
from ladechat.engine.load.gguf import files as gguf_files
from ladechat.engine.load.loading import LoadSpec, load

pytestmark = pytest.mark.slow
PROMPTS = ["Write a Python function that checks if a number is prime.",
           "List three facts about the Moon, one per line."]
LOOKAHEAD = LookaheadConfig(window=4, ngram=4, candidates=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The embedded model as a Hugging Face folder (bitsandbytes quantizes a checkpoint's floats, not
    a GGUF's blocks): transformers' own GGUF load, saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, target = gguf_files.embedded_gguf(), tmp_path_factory.mktemp("embedded-hf")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # transformers saves no model it calls quantized with gguf
    plain = type(loaded)(type(loaded.config).from_dict(config))
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(target)
    return str(target)


def answer(lm, prompt, la, max_new=40):
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    events = list(generate(Session(lm.model, la), list(ids), SamplingConfig(max_new_tokens=max_new), lm.eos_ids))
    return list(events[-1].text_tokens), events[-1].stats


def test_4bit_lookahead_identical_to_plain(folder):
    lm = load(LoadSpec(model=folder, dtype="float32", device="cpu", load_in_4bit=True))
    assert type(lm.model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    assert not packing.is_packed(lm.model)  # not even its plain output layer: quantized models stay as loaded
    assert not any("near-tie" in n for n in lm.notices)
    for prompt in PROMPTS:
        plain, _ = answer(lm, prompt, LookaheadConfig(enabled=False))
        ours, stats = answer(lm, prompt, LOOKAHEAD)
        assert ours == plain and len(ours) >= 20
        assert stats.compression > 1


def test_8bit_loads_and_answers_with_a_notice(folder):
    lm = load(LoadSpec(model=folder, dtype="float32", device="cpu", load_in_8bit=True))
    assert type(lm.model.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"
    assert any("8-bit weights (LLM.int8)" in n and "--load-in-4bit keeps them identical" in n for n in lm.notices)
    ours, stats = answer(lm, PROMPTS[0], LOOKAHEAD, max_new=24)
    assert "def" in lm.tokenizer.decode(ours) and stats.new_tokens == 24


def test_disk_offload_through_device_map_is_exact(folder):
    lm = load(LoadSpec(model=folder, dtype="float32", device="cpu", device_map="auto",
                       max_memory="cpu=250MiB"))
    assert {"cpu", "disk"} <= set(lm.model.hf_device_map.values())  # some layers really live on disk
    assert not packing.is_packed(lm.model)  # accelerate's hooks sit on the Linear modules
    # the reference on the same kernels: a device map keeps the Linear weights as loaded (unpacked)
    reference = load(LoadSpec(model=folder, dtype="float32", device="cpu", pack_weights=False))
    for prompt in PROMPTS:
        plain, _ = answer(reference, prompt, LookaheadConfig(enabled=False), max_new=32)
        ours, _ = answer(lm, prompt, LOOKAHEAD, max_new=32)
        assert ours == plain
