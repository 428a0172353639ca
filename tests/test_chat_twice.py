"""The same kept chat open in two terminals: the second goes on in a new file (with a notice), so
nothing either chat says is lost; the first keeps its file. Two real chats in two pseudo-terminals,
against a stub server (no model)."""

import json
import os

import pexpect
from conftest import ladechat_bin
from stub_openai import StubHandler, serve


class Echo(StubHandler):
    """Answers each question with 'answer to ' and the question."""

    def do_POST(self) -> None:
        question = self.read_request()["messages"][-1]["content"]
        self.send_answer([f"answer to {question}"])


def spawn(env, url, *args):
    child = pexpect.spawn(ladechat_bin(), ["--api", url, *args], env=env, encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    return child


def say(child, question):
    child.sendline(question)
    child.expect(f"answer to {question}")
    child.expect("reported")


def transcript(path):
    return [m["content"] for m in json.loads(path.read_text())["messages"]]


def test_a_chat_continued_in_a_second_terminal_loses_nothing(tmp_path):
    server, url = serve(Echo)
    state = tmp_path / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "NO_COLOR": "1"}
    chats = state / "ladechat" / "chats"
    try:
        first = spawn(env, url)
        first.expect(">>>")
        say(first, "one")
        (kept,) = chats.glob("*.json")
        second = spawn(env, url, "--continue")
        second.expect("is open in another ladechat: this one goes on in a new file")
        second.expect(">>>")
        say(first, "two from the first")
        say(second, "two from the second")
        say(first, "three from the first")
        for child in (first, second):
            child.sendline("/exit")
            child.expect(pexpect.EOF)
        files = sorted(chats.glob("*.json"))
        assert len(files) == 2 and kept in files
        (other,) = [f for f in files if f != kept]
        assert transcript(kept) == ["one", "answer to one", "two from the first", "answer to two from the first",
                                    "three from the first", "answer to three from the first"]
        assert transcript(other) == ["one", "answer to one", "two from the second", "answer to two from the second"]
        # both closed: the file is free again, and a chat continued now writes on to the newest
        third = spawn(env, url, "--continue")
        third.expect(">>>")
        say(third, "four")
        third.sendline("/exit")
        third.expect(pexpect.EOF)
        assert "is open in another" not in third.before
        newest = max(chats.glob("*.json"), key=lambda f: f.stat().st_mtime)
        assert transcript(newest)[-2:] == ["four", "answer to four"] and len(list(chats.glob("*.json"))) == 2
    finally:
        server.shutdown()
