"""`ladechat --api` when the server fails: the question is never lost. Gone mid-answer (kill -9,
an error event, a stream cut short): the partial answer is kept, marked interrupted, the error on a
line of its own, and /retry answers once a server is back. Gone before the answer: the question
stays, with the local path's "Up recalls it" and /retry.

The first tests drive a ChatApp in this process against a scripted stdlib server (as in
test_foreign_server.py); the last one a real `ladechat serve` killed with SIGKILL under the real
chat in a pseudo-terminal."""

import io
import json
import os
import re

import pexpect
import pytest
from conftest import ladechat_bin
from consoles import InterruptedConsole
from rich.console import Console
from serve_process import Server
from stub_openai import StubHandler, serve

from ladechat.backends.remote import Endpoint, RemoteBot
from ladechat.ui.chat import ChatApp

MODEL = "scripted"
WORDS = ["Once", " upon", " a", " time", ",", " a", " dragon", " baked", " bread", "."]


def chunk(delta: dict | None, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}


class Scripted(StubHandler):
    """Answers as `mode` says: ok (the whole answer), error (three words, then an error event and
    [DONE], as OpenAI's API and ladechat serve fail mid-answer), cut (three words, then the
    connection closes), busy (503 with Retry-After), bad (400)."""

    model = MODEL
    mode = "ok"

    def do_POST(self) -> None:
        self.read_request()
        mode = Scripted.mode
        if mode == "busy":
            self.send_json(503, {"error": {"message": "the server is busy"}}, {"Retry-After": "2"})
            return
        if mode == "bad":
            self.send_json(400, {"error": {"message": "temperature: must be a finite number"}})
            return
        words = WORDS if mode == "ok" else WORDS[:3]
        events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": w}) for w in words]
        if mode == "ok":
            events += [chunk({}, finish="stop"), "[DONE]"]
        elif mode == "error":
            events += [{"error": {"message": "CUDA out of memory", "type": "server_error"}}, "[DONE]"]
        self.send_events(events)
        # "cut": the handler returns and the (HTTP/1.0) connection closes, mid-answer


@pytest.fixture(scope="module")
def scripted():
    server, url = serve(Scripted)
    yield url
    server.shutdown()


def chat(url):
    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(RemoteBot(Endpoint.of(url, None), None, {}, set()), None, False, Console(file=out, width=200),
                  Console(file=err, width=300))
    return app, out, err


def errors(err) -> list[str]:
    return [line for line in err.getvalue().splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("mode,message", [
    ("error", "the server at {url} failed mid-answer: CUDA out of memory"),
    ("cut", "the server at {url} ended the stream before the answer was finished"),
])
def test_server_failing_mid_answer_keeps_question_and_partial_answer(scripted, tmp_path, mode, message):
    app, out, err = chat(scripted)
    Scripted.mode = "ok"
    app.ask("Say hello.")
    Scripted.mode = mode
    app.ask("Tell me a story.")
    partial = "".join(WORDS[:3])
    assert app.conversation.messages[2:] == [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": partial, "interrupted": True}]
    assert out.getvalue().endswith(partial + "\n")  # the partial answer's line is ended before the error
    assert errors(err) == [f"error: {message.format(url=scripted)} (the partial answer is kept; /retry answers again)"]
    app.command(f"/save {tmp_path / 'c.json'}")
    saved = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert saved[3] == {"role": "assistant", "content": partial, "interrupted": True}
    # the server is back: /retry answers the same question again, whole
    Scripted.mode = "ok"
    app.command("/retry")
    assert app.conversation.messages[2:] == [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": "".join(WORDS), "interrupted": False}]
    assert len(errors(err)) == 1


def test_ctrl_c_while_printing_ends_the_answer_with_its_statistics(scripted):
    """Ctrl-C lands while a word is printed, outside the stream: the stream ends all the same as it
    does for one that lands while it waits for the server, with what the client measured."""
    app, _, err = chat(scripted)
    app.out = Console(file=InterruptedConsole(at=3), width=200)
    Scripted.mode = "ok"
    app.ask("Tell me a story.")
    answer = app.conversation.messages[-1]
    assert answer["interrupted"] and WORDS[0] in answer["content"] and answer["content"] != "".join(WORDS)
    assert re.search(rf"\d+ tokens, [\d.]+ tok/s, first token after [\d.]+ s, as {re.escape(app.bot.host)} "
                     r"reported \(interrupted\)", err.getvalue())
    assert "interrupted: the partial answer is kept" in err.getvalue()
    app.ask("And another?")  # the next answer is whole
    assert app.conversation.messages[-1] == {"role": "assistant", "content": "".join(WORDS), "interrupted": False}


def test_server_busy_before_the_answer_keeps_the_question(scripted):
    app, _, err = chat(scripted)
    Scripted.mode = "busy"
    app.ask("Tell me a story.")
    assert app.conversation.messages == [{"role": "user", "content": "Tell me a story."},
                                         {"role": "assistant", "content": "", "interrupted": True}]
    assert errors(err) == [(f"error: the server at {scripted} is busy: the server is busy (retry after 2 s) "
                           "(the question was not answered; /retry asks it again, Up recalls it)")]
    Scripted.mode = "ok"
    app.command("/retry")
    assert app.conversation.messages[-1] == {"role": "assistant", "content": "".join(WORDS), "interrupted": False}


def test_a_request_the_server_refuses_drops_the_question_as_locally(scripted):
    """A 400 is about the request: asking again would be refused again. As a question the local
    model refuses, it is dropped (Up recalls it) and the conversation is as before."""
    app, _, err = chat(scripted)
    Scripted.mode = "bad"
    app.ask("Tell me a story.")
    assert app.conversation.messages == []
    assert errors(err) == [(f"error: the server at {scripted} answered 400: temperature: must be a finite number "
                           "(the question was not answered; Up recalls it)")]


PROMPT = ">>>"
LONG = "Write a very long story about a dragon who learns to bake bread."
ANSI = r"(?:\x1b\[[0-9;?]*[A-Za-z])*"


def test_chat_against_a_killed_server_keeps_everything_and_retries_once_it_is_back(tmp_path):
    """The issue's reproduction: `ladechat --api`, a long answer, kill -9 the server mid-answer,
    /save. Then a server is back on the same port and /retry answers; then the server is gone
    before an answer starts. The model has no end-of-text token and the first answer may run for
    minutes: it is still running when its server is killed. Lookahead off: no highlighting splits
    the answer's text on the screen."""
    from tiny_models import endless_model_folder

    folder = str(endless_model_folder(tmp_path / "endless"))
    serving = ("--model", folder, "--dtype", "float32", "--no-store", "--max-new-tokens", "200000")
    first = Server(*serving)
    second = None
    saved = tmp_path / "c.json"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    child = pexpect.spawn(ladechat_bin(), ["--api", first.url, "--max-new-tokens", "200000", "--no-lookahead"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    try:
        child.expect(PROMPT)
        child.sendline(LONG)
        child.expect_exact("\x1b[?2004l")  # prompt-toolkit gave the terminal back: the answer streams
        child.expect(r"[!-~]{20}")  # twenty printable characters of it in a row
        shown = child.after
        first.kill()
        child.expect(r"error: the connection to 127\.0\.0\.1:\d+ broke mid-answer: [^\r\n]*"
                     r"\(the partial answer is kept; /retry answers again\)")
        screen = shown + child.before + child.after
        child.expect(PROMPT)
        # the error is on a line of its own, after the partial answer
        assert re.search(rf"\n{ANSI}error: the connection", screen), repr(screen[-400:])
        child.sendline(f"/save {saved}")
        child.expect("saved 2 messages")
        child.expect(PROMPT)
        question, partial = json.loads(saved.read_text())["messages"]
        assert question == {"role": "user", "content": LONG}
        assert partial["role"] == "assistant" and partial["interrupted"] is True and partial["content"]
        words = re.findall(r"[A-Za-z]{2,}", partial["content"])
        assert words and all(word in screen for word in words[:3])
        # a server is back where the chat expects it: /retry answers the question again
        second = Server(*serving, port=first.port)
        child.sendline("/set max_new_tokens=24")
        child.expect("lookahead off: W=")  # what /set says: not the typed line's echo
        child.expect(PROMPT)
        child.sendline("/retry")
        child.expect(r"tokens/step, lookahead off")
        child.expect(PROMPT)
        # gone before the answer starts: the question stays, with the local path's hint
        second.kill()
        child.sendline("Name a fruit.")
        child.expect(r"error: cannot reach the server at http://127\.0\.0\.1:\d+/v1: [^\r\n]*"
                     r"\(the question was not answered; /retry asks it again, Up recalls it\)")
        child.expect(PROMPT)
        child.sendline(f"/save {saved}")
        child.expect("saved 4 messages")
        child.expect(PROMPT)
        messages = json.loads(saved.read_text())["messages"]
        assert messages[0] == {"role": "user", "content": LONG}
        assert messages[1]["interrupted"] is False and messages[1]["content"]  # answered again, whole
        assert messages[2:] == [{"role": "user", "content": "Name a fruit."},
                                {"role": "assistant", "content": "", "interrupted": True}]
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        assert "Traceback" not in child.before
    finally:
        child.close(force=True)
        first.stop()
        if second is not None:
            second.stop()
