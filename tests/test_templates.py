"""Shipped templates render known-good strings (Llama-2 keeps its system prompt in <<SYS>>)."""

import pytest

from ladechat import templates


class Tok:
    """Just what apply_chat_template needs: the real rendering is transformers' own."""

    bos_token, eos_token = "<s>", "</s>"

    def apply_chat_template(self, messages, chat_template, add_generation_prompt, tokenize, **extra):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                            eos_token=self.eos_token, **extra)
        return rendered[0]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]

EXPECTED = {
    "llama-2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "vicuna": "Be brief. USER: Hi ASSISTANT: Hello!</s> USER: Bye ASSISTANT:",
    "zephyr": "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n<|user|>\nBye</s>\n"
              "<|assistant|>\n",
    "alpaca": "Be brief.\n\n### Instruction:\nHi\n\n### Response:\nHello!</s>\n\n### Instruction:\nBye\n\n"
              "### Response:\n",
}
EXPECTED["raw"] = "Be brief.HiHello!Bye"  # the text alone (a base model's: tests/test_base_models.py)
EXPECTED["hermes"] = EXPECTED["chatml"]  # with no tools, ChatML itself (its tools: tests/test_tools.py)


def test_every_shipped_template_is_tested():
    assert templates.names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_renders_known_good_string(name):
    assert templates.render(Tok(), MESSAGES, name) == EXPECTED[name]


def test_llama2_without_system_prompt():
    got = templates.render(Tok(), MESSAGES[1:], "llama-2")
    assert got == "<s>[INST] Hi [/INST] Hello! </s><s>[INST] Bye [/INST]"


def test_unknown_template():
    with pytest.raises(templates.TemplateError, match="unknown template 'nope'"):
        templates.source("nope")
