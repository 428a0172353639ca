"""Models without a chat template (base models) and text continued as written: the RAW template
renders a conversation's text alone (the beginning-of-text token where the tokenizer adds one),
`ask` and the chat continue the text with a notice, the chat's /raw switches the chat format off
and on, and serve's /v1/completions continues a prompt, whole and streamed, the same tokens as
the RAW template's answer."""

import io
import json

import httpx
import openai
from conftest import PATIENCE_S
from rich.console import Console
from serve_process import Server
from test_cli import ladechat, tiny_model_folder

from ladechat import templates
from ladechat.backends.local import Bot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"


class NoTemplate:
    """A tokenizer's face without a chat template, its rendering transformers' own."""

    chat_template = None
    bos_token = "<s>"

    def __init__(self, add_bos: bool) -> None:
        self.add_bos_token = add_bos

    def apply_chat_template(self, messages, chat_template, add_generation_prompt, tokenize, **extra):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                            **extra)
        return rendered[0]


def test_the_raw_template_is_the_conversations_text_alone():
    messages = [{"role": "system", "content": "A story. "}, {"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": " there was a fox."}, {"role": "user", "content": " Then"}]
    assert templates.render(NoTemplate(False), messages) == "A story. Once upon a time there was a fox. Then"
    assert templates.render(NoTemplate(True), messages) == "<s>A story. Once upon a time there was a fox. Then"
    assert templates.render(NoTemplate(True), messages, templates.RAW).startswith("<s>A story.")


def test_the_beginning_of_text_token_comes_where_the_tokenizer_itself_adds_it():
    """A tokenizer whose post-processor adds BOS (Llama's, Gemma's) reads add_bos_token False in
    transformers; the RAW template goes by what it does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "Once": 2, "upon": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    adding = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>")
    assert adding("Once upon")["input_ids"] == [0, 2, 3]
    messages = [{"role": "user", "content": "Once upon"}]
    assert templates.encode(adding, messages, templates.RAW) == [0, 2, 3]
    core.post_processor = None
    plain = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>")
    assert templates.encode(plain, messages, templates.RAW) == [2, 3]


def test_ask_and_the_chat_continue_a_base_models_text_with_a_notice(tmp_path, embedded_fp32):
    folder = tiny_model_folder(tmp_path, embedded_fp32.tokenizer, chat_template=None)
    r = ladechat("ask", "--model", str(folder), "--dtype", "float32", "--max-new-tokens", "4", "--json", PROMPT)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert templates.NO_CHAT_TEMPLATE in " ".join(err.split())
    asked = len(embedded_fp32.tokenizer(PROMPT, add_special_tokens=True)["input_ids"])
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] == asked  # the text as given, nothing around it
    r = ladechat("--model", str(folder), "--dtype", "float32", "--max-new-tokens", "4", stdin=PROMPT.encode() + b"\n")
    assert r.returncode == 0 and templates.NO_CHAT_TEMPLATE in " ".join(r.stderr.decode().split()), r.stderr


def test_raw_switches_the_chat_format_off_and_back(embedded_fp32):
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(Bot(embedded_fp32, Settings(store=False, max_new_tokens=6, template="chatml")), None, False,
                  Console(file=out), Console(file=err, width=300))
    app.command("/raw off")  # not on: the template stays
    assert app.bot.settings.template == "chatml"
    app.command("/raw on")
    assert app.bot.settings.template == templates.RAW
    app.ask(PROMPT)
    raw = Bot(embedded_fp32, Settings(store=False, max_new_tokens=6, template=templates.RAW))
    done = next(e for e in raw.reply(Conversation(messages=[{"role": "user", "content": PROMPT}])) if isinstance(e, Done))
    assert app.conversation.messages[-1]["content"] == done.text  # the prompt continued, as RAW renders it
    app.command("/raw off")
    assert app.bot.settings.template == "chatml"  # the one before
    app.command("/raw maybe")
    assert "usage: /raw on|off" in err.getvalue()


def test_completions_continue_the_prompt_whole_and_streamed():
    server = Server("--dtype", "float32", "--no-store")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        choice = whole.choices[0]
        assert whole.object == "text_completion" and choice.text and choice.finish_reason == "length"
        assert whole.usage.completion_tokens == 12
        streamed = client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=12, temperature=0, stream=True)
        chunks = [chunk for chunk in streamed if chunk.choices]
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert chunks[-1].choices[0].finish_reason == "length"
        default = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
        assert default.usage.completion_tokens <= 16  # OpenAI's default max_tokens
        r = httpx.post(server.url + "/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": None},
                       timeout=PATIENCE_S).json()
        assert r["usage"]["completion_tokens"] <= 16
        # the same tokens as a chat request answered through the RAW template
        r = httpx.post(server.url + "/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12},
                       timeout=PATIENCE_S).json()
        chat = httpx.post(server.url + "/chat/completions", timeout=PATIENCE_S, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12}).json()
        assert r["choices"][0]["text"] == choice.text and chat["choices"][0]["message"]["content"] != choice.text
        for bad, param in (({"prompt": [1, 2, 3]}, "prompt.list[str].0"), ({"n": 2}, "n"), ({"echo": True}, "echo"),
                           ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
                           ({"response_format": {"type": "json_object"}}, "response_format"), ({"prompt": ""}, "prompt")):
            r = httpx.post(server.url + "/completions", json={"model": MODEL, "prompt": PROMPT, **bad}, timeout=PATIENCE_S)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"].startswith(param.split(".")[0]), (bad, r.text)
    finally:
        server.stop()
