"""The chats kept as they go (ladechat/ui/history.py): the files, the listing, and the chat writing,
reopening and listing them in-process on a tiny model. tests/test_chat_pty.py drives the real
command: a killed chat continued, `ladechat history`."""

import io
import json
import os
import stat

import pytest
from rich.console import Console
from test_chat_app import error_lines
from tiny_models import tiny_loaded

from ladechat.backends.local import Bot
from ladechat.conversation import Conversation
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp
from ladechat.ui.history import ChatLog, HistoryError, find_chat, list_chats, markdown, write_private


def kept_chat(root, max_new_tokens=6, context_length=1024):
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=max_new_tokens)
    err = io.StringIO()
    app = ChatApp(Bot(tiny_loaded(context_length), settings), None, False, Console(file=io.StringIO()),
                  Console(file=err, width=300), log=ChatLog(root))
    return app, err


def chat_file(root, name, messages, model="m", mtime=None):
    path = root / f"{name}.json"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": "ladechat-conversation", "version": 1, "model": model, "system": None,
                                "messages": messages, "settings": {}}))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_every_question_and_answer_is_in_the_chat_file_as_it_goes(tmp_path):
    app, err = kept_chat(tmp_path)
    assert app.log.path is None  # nothing written before the first message
    app.ask("hi there")
    path = app.log.path
    data = json.loads(path.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "hi there" and data["messages"][1]["content"] == app.conversation.messages[1]["content"]
    assert data["settings"]["W"] == 2 and data["model"] == app.bot.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    app.command("/set w=3")  # kept after every command
    assert json.loads(path.read_text())["settings"]["W"] == 3
    app.command("/undo")
    assert json.loads(path.read_text())["messages"] == []
    assert error_lines(err) == []
    # no temporary file left; beside the chat, the lock that says this chat writes it
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{path.stem}.lock", path.name]


def test_the_question_is_kept_before_its_answer_begins(tmp_path):
    app, _ = kept_chat(tmp_path)
    seen = []
    answer = app.answer
    app.answer = lambda: (seen.append(json.loads(app.log.path.read_text())["messages"]), answer())
    app.ask("what is kept?")
    assert seen == [[{"role": "user", "content": "what is kept?"}]]


def test_clear_and_load_begin_a_new_chat_file_and_keep_the_old(tmp_path):
    app, _ = kept_chat(tmp_path / "chats")
    app.ask("first chat")
    first = app.log.path
    app.command("/clear")
    app.ask("second chat")
    second = app.log.path
    saved = tmp_path / "saved.json"
    app.command(f"/save {saved}")
    app.command(f"/load {saved}")
    third = app.log.path
    assert len({first, second, third}) == 3
    assert json.loads(first.read_text())["messages"][0]["content"] == "first chat"
    def said(path):
        return [(m["role"], m["content"]) for m in json.loads(path.read_text())["messages"]]

    assert said(third) == said(second) and said(second)[0] == ("user", "second chat")


def test_messages_dropped_for_the_context_stay_in_the_kept_chat(tmp_path):
    app, err = kept_chat(tmp_path, context_length=120)  # the tiny tokenizer: one token per character
    for question in ["a" * 30, "b" * 30, "c" * 30]:
        app.ask(question)
    assert "dropped the oldest" in err.getvalue()
    kept = json.loads(app.log.path.read_text())["messages"]
    assert [m["content"] for m in kept if m["role"] == "user"] == ["a" * 30, "b" * 30, "c" * 30]
    assert app.conversation.transcript() == kept
    assert len(app.conversation.messages) < len(kept)  # what the model reads is shorter


def test_reopened_chat_goes_on_in_its_file_with_its_settings(tmp_path):
    app, _ = kept_chat(tmp_path)
    app.command("/system Answer in French.")
    app.ask("remember me")
    app.command("/set n=4 temperature=0.5 seed=3")
    path = app.log.path
    app.log.start_over()  # the first chat ends (else the second goes on in a file of its own: test_chat_twice)
    other, err = kept_chat(tmp_path)
    other.reopen(find_chat(tmp_path, "1"))
    assert other.log.path == path and other.bot.settings == app.bot.settings
    assert other.conversation.chat_messages() == app.conversation.chat_messages()
    assert other.conversation.system == "Answer in French."
    assert f"reopened chat {path.stem}: 2 messages" in err.getvalue()
    other.ask("and now?")
    assert [m["role"] for m in json.loads(path.read_text())["messages"]] == ["user", "assistant"] * 2
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_history_command_lists_and_opens_kept_chats(tmp_path):
    app, err = kept_chat(tmp_path)
    app.ask("the first one")
    first = app.log.path
    os.utime(first, (1, 1))  # older
    app.command("/clear")
    app.ask("the second one")
    app.command("/history")
    listing = err.getvalue().splitlines()
    assert any(line.startswith("  1  ") and "the second one" in line and "(this chat)" in line for line in listing)
    assert any(line.startswith("  2  ") and "the first one" in line for line in listing)
    app.command("/history 2")
    assert app.log.path == first and app.conversation.messages[0]["content"] == "the first one"
    app.command("/history 9")
    assert error_lines(err) == ["error: no chat number 9: there are 2 (see: ladechat history)"]


def test_without_a_log_nothing_is_written_and_history_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=4)
    err = io.StringIO()
    app = ChatApp(Bot(tiny_loaded(), settings), None, False, Console(file=io.StringIO()), Console(file=err, width=300))
    app.ask("hi")
    app.keep()
    app.command("/history")
    assert error_lines(err) == ["error: chats are not kept in this session (--no-history)"]
    assert list(tmp_path.iterdir()) == []


def test_a_chat_that_cannot_be_written_says_so_once_and_goes_on(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    app, err = kept_chat(blocked / "chats")  # a folder that cannot be made
    app.ask("one")
    app.ask("two")
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: this chat is not being kept (") and "/save still works" in lines[0]
    assert len(app.conversation.messages) == 4


def test_listing_newest_first_with_titles_and_unreadable_files_marked(tmp_path):
    chat_file(tmp_path, "20260101-000000-aaaa", [{"role": "user", "content": "old\nquestion"}], mtime=100)
    chat_file(tmp_path, "20260102-000000-bbbb", [{"role": "assistant", "content": "x"},
                                                   {"role": "user", "content": "q" * 100}], mtime=200)
    (tmp_path / "broken.json").write_text("{")
    os.utime(tmp_path / "broken.json", (50, 50))
    chats = list_chats(tmp_path)
    assert [c.id for c in chats] == ["20260102-000000-bbbb", "20260101-000000-aaaa", "broken"]
    assert chats[2].problem == "not valid JSON (Expecting property name enclosed in double quotes at line 1)"
    assert chats[2].line(3).endswith("  broken  unreadable: not valid JSON (Expecting property name enclosed in "
                                     "double quotes at line 1)")
    assert chats[0].title == "q" * 59 + "…" and chats[1].title == "old question" and chats[0].messages == 2
    assert find_chat(tmp_path, "2").name == "20260101-000000-aaaa.json"
    assert find_chat(tmp_path, "20260102").name == "20260102-000000-bbbb.json"
    assert find_chat(tmp_path, "broken").name == "broken.json"  # deletable by id
    with pytest.raises(HistoryError, match="2 kept chats have the id '202601'"):
        find_chat(tmp_path, "202601")
    with pytest.raises(HistoryError, match="no kept chat has the id 'zzz'"):
        find_chat(tmp_path, "zzz")
    with pytest.raises(HistoryError, match="no chats have been kept yet"):
        find_chat(tmp_path / "none", "1")


def test_markdown_of_a_chat(tmp_path):
    path = chat_file(tmp_path, "20260101-000000-aaaa", [{"role": "user", "content": "Hi?"},
                                                         {"role": "assistant", "content": "Hello.", "interrupted": True}])
    assert markdown(path) == ("# Chat 20260101-000000-aaaa\n\nModel: m\n\n## You\n\nHi?\n\n"
                              "## Assistant (interrupted)\n\nHello.\n")


def test_write_private_replaces_whole_files_only(tmp_path):
    path = tmp_path / "c" / "x.json"
    write_private(path, "one")
    write_private(path, "two")
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]


def test_transcript_keeps_the_dropped_messages_in_order():
    conversation = Conversation(messages=[{"role": "user", "content": str(i)} for i in range(5)])
    conversation.forget_oldest(2)
    conversation.drop_oldest_exchange()
    assert [m["content"] for m in conversation.messages] == ["3", "4"]
    assert [m["content"] for m in conversation.transcript()] == ["0", "1", "2", "3", "4"]
    assert json.loads(conversation.to_json("m", {}))["messages"] == conversation.transcript()
