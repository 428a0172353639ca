"""`ladechat --api` against an OpenAI-compatible server that is not ladechat serve (as vLLM,
llama.cpp's server or ollama answer): plain streaming, a footer of what the server reported, the
request carrying only what the user chose, and lookahead settings refused in one line.

The server is a stdlib HTTP server in this process that answers the way vLLM's
/v1/chat/completions does (role chunk, content chunks, a finish chunk, a usage chunk, [DONE])."""

import json
import os
import subprocess

import pexpect
import pytest
from conftest import ladechat_bin
from stub_openai import StubHandler, serve

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WORDS = ["The", " capital", " of", " France", " is", " Paris", "."]


def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> dict:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                   "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body


class Handler(StubHandler):
    model, owned_by = MODEL, "vllm"
    requests: list = []  # the JSON bodies of the chat requests, in order

    def do_POST(self) -> None:
        Handler.requests.append(self.read_request())
        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"content": word}) for word in WORDS]
        events += [chunk({}, finish="stop"), chunk(None, usage={"prompt_tokens": 17, "completion_tokens": 7,
                                                                "total_tokens": 24})]
        self.send_events([*events, "[DONE]"])


@pytest.fixture(scope="module")
def foreign():
    server, url = serve(Handler)
    yield url
    server.shutdown()


def ladechat(*args, stdin=None):
    return subprocess.run([ladechat_bin(), *args], input=stdin, capture_output=True, timeout=120, text=True,
                          check=False, env={**os.environ, "NO_COLOR": "1"})


def test_ask_streams_the_answer_and_the_servers_own_account(foreign):
    Handler.requests.clear()
    done = ladechat("ask", "--api", foreign, "What is the capital of France?", "--temperature", "0.7")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The capital of France is Paris.\n"
    footer = done.stderr.strip().splitlines()[-1]
    assert footer.startswith("7 tokens, ") and footer.endswith(f"as {foreign.split('/')[2]} reported"), done.stderr
    request = Handler.requests[-1]
    # Only what the user chose (and ask's greedy default) goes out; no ladechat extension.
    assert request["model"] == MODEL and request["stream"] is True
    assert request["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert request["temperature"] == 0.7 and "ladechat" not in request and "top_k" not in request


def test_ask_json_reports_the_servers_usage(foreign):
    done = ladechat("ask", "--api", foreign, "--json", "hi")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["text"] == "The capital of France is Paris." and record["model"] == MODEL
    assert record["stats"]["new_tokens"] == 7 and record["stats"]["finish_reason"] == "stop"


@pytest.mark.parametrize("flag", [["-W", "3"], ["--no-lookahead"], ["--recycle", "4"]])
def test_lookahead_settings_are_refused_in_one_line(foreign, flag):
    done = ladechat("ask", "--api", foreign, *flag, "hi")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"apply to ladechat serve only: the server at {foreign} decodes its own way" in done.stderr


def test_chat_in_a_pty_streams_plainly_and_refuses_what_the_server_cannot_do(foreign, tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    child = pexpect.spawn(ladechat_bin(), ["--api", foreign], env=env, encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    child.expect(f"{MODEL} at {foreign} \\(not ladechat serve\\)")
    child.expect(">>>")
    child.sendline("What is the capital of France?")
    child.expect_exact("The capital of France is Paris.")
    child.expect(r"7 tokens, [\d.]+ tok/s, first token after [\d.]+ s, as 127\.0\.0\.1:\d+ reported")
    child.expect(">>>")
    child.sendline("/lookahead on")  # it is off: the server decodes its own way
    child.expect("apply to ladechat serve only")
    child.expect(">>>")
    child.sendline("/stats")
    child.expect("reports no decoding statistics")
    child.expect(">>>")
    child.sendline(f"/save {tmp_path / 'c.json'}")
    child.expect("saved 2 messages")
    child.expect(">>>")
    child.sendeof()
    child.expect(pexpect.EOF)
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["messages"][1]["content"] == "The capital of France is Paris."
    assert "ladechat" not in Handler.requests[-1]
