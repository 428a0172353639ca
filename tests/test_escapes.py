"""Nothing from a model, a server, a file or a kept chat reaches the terminal as a control
sequence: C0 and C1 controls, CSI (clear the screen), OSC (set the clipboard, retitle the window)
are shown escaped on every printing path (the chat, `ask` on a terminal, `history`, `--continue`),
and reach a pipe as they are."""

import io
import json
import os
import re
import subprocess

import pexpect
import pytest
from conftest import ladechat_bin
from hypothesis import given
from hypothesis import strategies as st
from rich.text import Text
from stub_openai import StubHandler, serve

from ladechat.backends.events import Piece
from ladechat.ui.stream import StreamPrinter
from ladechat.ui.terminal import SafeConsole, json_text, visible

# what an answer (or a file, or a kept chat) might carry, each as the terminal would obey it
PAYLOADS = {
    "clipboard": "\x1b]52;c;cm0gLXJmIH4=\x07",  # OSC 52: the clipboard set to 'rm -rf ~'
    "title": "\x1b]0;pwned\x1b\\",  # OSC 0 ended by ST
    "clear": "\x1b[2J\x1b[H",  # CSI: clear the screen, cursor home
    "c1-csi": "\x9b31m",  # the C1 CSI alone (some terminals obey it)
    "bell": "\x07",
    "backspace": "ab\x08\x08cd",
    "cr": "hidden\rshown",
    "nul-del": "\x00\x7f",
}
ANSWER = "Before " + " ".join(PAYLOADS.values()) + " after."
# the console's own styles (bold for parallel tokens, NO_COLOR keeps it), the redraw's erasing of
# the lines (CR, erase the line, cursor up)
OWN = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r(?=\x1b\[2K)")


def obeyed(screen: str) -> list[str]:
    """The payloads a terminal would obey in `screen`: each one present raw."""
    return [name for name, payload in PAYLOADS.items() if payload in screen]


def test_visible_writes_out_every_control_character():
    assert visible("a\x1b[2Jb\x9b\x00\x7f\tc\r\nd\re") == "a\\x1b[2Jb\\x9b\\x00\\x7f\tc\nd\\x0de"
    assert visible("plain text, ünïcode, 漢字\n") == "plain text, ünïcode, 漢字\n"
    assert json.loads(json_text({"t": ANSWER})) == {"t": ANSWER}
    assert not re.search("[\x00-\x1f\x7f-\x9f]", json_text({"t": ANSWER}))


@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2fff), max_size=60))
def test_no_control_character_survives_visible(text):
    shown = visible(text)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown)
    assert shown.replace("\\x", "") .count("\n") == text.replace("\r\n", "\n").count("\n")


def terminal_console(**kwargs) -> tuple[SafeConsole, io.StringIO]:
    file = io.StringIO()
    return SafeConsole(file=file, force_terminal=True, width=120, color_system="standard", **kwargs), file


@pytest.mark.parametrize("markdown", [False, True])
def test_the_stream_and_its_markdown_redraw_show_payloads_escaped(markdown):
    out, screen = terminal_console()
    err, _ = terminal_console()
    printer = StreamPrinter(out, err, markdown=markdown)
    for i, piece in enumerate(["```python\n", ANSWER, "\n```\n", "- item " + PAYLOADS["clipboard"] + "\n"]):
        printer.handle(Piece(piece, parallel=i % 2 == 1))
    printer.finish()
    shown = screen.getvalue()
    assert obeyed(shown) == []
    assert "\\x1b]52;c;cm0gLXJmIH4=" in shown and "\\x9b31m" in shown  # (rich drops BEL, BS, CR itself)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", OWN.sub("", shown))
    assert printer.text.endswith(PAYLOADS["clipboard"] + "\n")  # the conversation keeps the text as it was


def test_a_pipe_gets_the_text_as_it_is():
    file = io.StringIO()
    SafeConsole(file=file, force_terminal=False).print(Text(PAYLOADS["clear"]), end="")
    assert file.getvalue() == PAYLOADS["clear"]


class Payload(StubHandler):
    def do_POST(self) -> None:
        self.read_request()
        self.send_answer([ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)])


@pytest.fixture(scope="module")
def payload_server():
    server, url = serve(Payload)
    yield url
    server.shutdown()


def pty_run(tmp_path, *args) -> str:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    child = pexpect.spawn(ladechat_bin(), list(args), env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


def test_every_printing_path_shows_payloads_escaped(tmp_path, payload_server):
    """ask on a terminal; the chat answering, then reopened with --continue; history's listing and
    a kept chat as Markdown and as JSON; a file read with /read; and ask into a pipe, untouched."""
    asked = pty_run(tmp_path, "ask", "--api", payload_server, "Say it " + PAYLOADS["title"])
    assert "Before" in asked and obeyed(asked) == [] and "\\x1b[2J" in asked
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    note = tmp_path / "note.txt"
    note.write_text("a file's " + PAYLOADS["clear"] + PAYLOADS["clipboard"] + " text\n")
    chat = pexpect.spawn(ladechat_bin(), ["--api", payload_server], env=env, encoding="utf-8", timeout=120,
                         dimensions=(40, 200))
    chat.expect(">>>")
    chat.sendline(f"/read {note}")
    chat.expect(">>>")
    chat.sendline("Tell me " + PAYLOADS["c1-csi"])
    chat.expect("as 127.0.0.1")  # the footer
    screen = chat.before
    chat.expect(">>>")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    assert "after." in screen and obeyed(screen) == []
    reopened = pexpect.spawn(ladechat_bin(), ["--api", payload_server, "--continue"], env=env, encoding="utf-8",
                             timeout=120, dimensions=(40, 200))
    reopened.sendline("/exit")  # read once the chat's prompt is up (after the transcript's ">>>" lines)
    reopened.expect(pexpect.EOF)
    shown = reopened.before
    assert "after." in shown and obeyed(shown) == [] and "\\x1b]52;c;" in shown
    for args in (("history",), ("history", "1"), ("history", "1", "--json")):
        out = pty_run(tmp_path, *args)
        assert obeyed(out) == [] and ("\\x1b" in out or "\\u001b" in out), args
    piped = subprocess.run([ladechat_bin(), "history", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert PAYLOADS["clipboard"] in piped.stdout  # a pipe or a file gets the kept text as it is
