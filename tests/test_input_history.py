"""The lines typed at the chat's prompt are kept privately (0600 in a 0700 folder), and a history
that cannot be kept costs one notice, never the chat."""

import os
import stat

import pexpect
import pytest
from conftest import ladechat_bin
from stub_openai import StubHandler, serve

from ladechat.ui.input_history import PrivateHistory


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_history_is_private_and_kept(tmp_path):
    folder = tmp_path / "state" / "ladechat"
    history = PrivateHistory(folder / "history")
    assert mode(folder) == 0o700 and mode(folder / "history") == 0o600
    history.store_string("first line")
    history.store_string("two\nlines")
    assert list(PrivateHistory(folder / "history").load_history_strings()) == ["two\nlines", "first line"]
    assert history.take_notice() is None


def test_an_open_history_is_made_private(tmp_path):
    folder = tmp_path / "ladechat"
    folder.mkdir(mode=0o755)
    (folder / "history").write_text("\n# old\n+kept line\n")
    os.chmod(folder / "history", 0o644)
    history = PrivateHistory(folder / "history")
    assert mode(folder) == 0o700 and mode(folder / "history") == 0o600
    assert list(history.load_history_strings()) == ["kept line"]


@pytest.mark.parametrize("blocked", ["a folder", "under a file"])
def test_a_history_that_cannot_be_kept_is_one_notice(tmp_path, blocked):
    if blocked == "a folder":
        path = tmp_path / "history"
        path.mkdir()
    else:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "history"
    history = PrivateHistory(path)
    history.store_string("a line")  # no error
    assert list(history.load_history_strings()) == []
    notice = history.take_notice()
    assert notice.startswith(f"the input history {path} cannot be ") and "Up/Down recall only this chat's" in notice
    assert history.take_notice() is None  # once


class Echo(StubHandler):
    def do_POST(self) -> None:
        self.read_request()
        self.send_answer(["fine"])


def test_the_chat_goes_on_when_its_history_cannot_be_written(tmp_path):
    server, url = serve(Echo)
    state = tmp_path / "state"
    (state / "ladechat" / "history").mkdir(parents=True)  # a folder where the file goes: every write fails
    env = {**os.environ, "XDG_STATE_HOME": str(state), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    try:
        chat = pexpect.spawn(ladechat_bin(), ["--api", url, "--no-history"], env=env, encoding="utf-8",
                             timeout=120, dimensions=(40, 200))
        chat.expect(">>>")
        screens = []
        for question in ("one?", "two?", "three?"):
            chat.sendline(question)
            chat.expect("reported")
            screens.append(chat.before)
            chat.expect(">>>")
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
        shown = "".join(screens) + chat.before
    finally:
        server.shutdown()
    assert shown.count("notice: the input history") == 1 and "fine" in shown
    assert "Traceback" not in shown and "Press ENTER" not in shown
