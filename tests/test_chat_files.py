"""Kept and saved chat files are read only as regular files of a bounded size, and any file that
does not read as a chat, however it fails (generated here by the hundred), is one line: listed as
unreadable, deletable by id, refused by `history N`, `--continue` and `/load` without ending the
chat, within a bounded time and memory (a pipe is never waited on, a huge file never read)."""

import io
import json
import os
import random
import subprocess

import pytest
from conftest import ladechat_bin
from rich.console import Console
from test_chat_app import error_lines
from tiny_models import tiny_loaded

from ladechat.backends.local import Bot
from ladechat.conversation import MAX_FILE_BYTES, Conversation, ConversationError
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp
from ladechat.ui.history import find_chat, list_chats, markdown

GOOD = {"format": "ladechat-conversation", "version": 1, "model": "m", "system": None,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "settings": {}}


def broken_texts(seed: int, count: int) -> list[bytes]:
    """File contents that are not a chat: the good file cut, its bytes flipped, its fields of the
    wrong type, JSON nested far past the parser's depth, not UTF-8."""
    rng = random.Random(seed)
    good = json.dumps(GOOD).encode()
    made = [b"", b"\xff\xfe\x00garbage", b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
            json.dumps({**GOOD, "messages": [[[[]]]] * 3}).encode(), json.dumps([GOOD]).encode(),
            json.dumps({**GOOD, "format": "other"}).encode(), json.dumps({**GOOD, "system": 5}).encode(),
            b'{"format": "ladechat-conversation", "messages": [' + b"7" * 5000 + b"]}"]  # past int()'s digits
    fields = ["format", "messages", "system", "settings", "model"]
    values = [None, 5, "x", [], {}, [{"role": "user"}], [{"role": "bot", "content": "x"}], [{"content": 1}], 1e308]
    while len(made) < count:
        kind = rng.randrange(3)
        if kind == 0:
            made.append(good[: rng.randrange(len(good))])
        elif kind == 1:
            data = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            made.append(bytes(data))
        else:
            made.append(json.dumps({**GOOD, rng.choice(fields): rng.choice(values)}).encode())
    return made


def readable(data: bytes) -> bool:
    try:
        Conversation.from_data(json.loads(data.decode("utf-8")), "x")
        return True
    except (ValueError, RecursionError, ConversationError):
        return False


def special_files(root) -> list:
    """A pipe, a folder and a device under chat names, and a file past the size bound (sparse)."""
    os.mkfifo(root / "pipe.json")
    (root / "folder.json").mkdir()
    os.symlink("/dev/zero", root / "zero.json")
    with open(root / "huge.json", "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    return ["pipe", "folder", "zero", "huge"]


def test_every_unreadable_file_is_listed_refused_in_one_line_and_deletable(tmp_path):
    root = tmp_path / "chats"
    root.mkdir()
    texts = [t for t in broken_texts(1, 300) if not readable(t)]
    assert len(texts) > 200
    for i, text in enumerate(texts):
        (root / f"bad-{i:03}.json").write_bytes(text)
    names = special_files(root)
    (root / "good.json").write_text(json.dumps(GOOD))
    chats = {chat.id: chat for chat in list_chats(root)}
    assert len(chats) == len(texts) + len(names) + 1
    assert chats["good"].problem is None and chats["good"].messages == 2
    for chat_id, chat in chats.items():
        if chat_id == "good":
            continue
        assert chat.problem and "\n" not in chat.problem, chat_id
        with pytest.raises(ConversationError) as failed:
            markdown(find_chat(root, chat_id))
        assert "\n" not in str(failed.value) and str(chat.path) in str(failed.value)
    assert chats["pipe"].problem == "it is not a regular file" and chats["zero"].problem == "it is not a regular file"
    assert chats["folder"].problem == "it is a folder"
    assert chats["huge"].problem == "it is larger than 64 MiB, too large for a conversation"
    assert "nested too deeply" in chats["bad-002"].problem


def test_load_of_any_unreadable_file_keeps_the_chat(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    names = special_files(root)
    texts = [t for t in broken_texts(2, 60) if not readable(t)]
    for i, text in enumerate(texts):
        (root / f"bad-{i}.json").write_bytes(text)
    err = io.StringIO()
    app = ChatApp(Bot(tiny_loaded(), Settings(max_new_tokens=4)), None, False, Console(file=io.StringIO()),
                  Console(file=err, width=300))
    app.ask("hello")
    for name in [*names, *(f"bad-{i}" for i in range(len(texts)))]:
        assert app.command(f"/load {root / name}.json") is True  # the chat goes on
    errors = error_lines(err)
    assert len(errors) == len(names) + len(texts) and len(app.conversation.messages) == 2
    assert all(line.startswith(f"error: cannot read {root}/") or f"{root}/" in line for line in errors)


def test_the_commands_on_unreadable_chats(tmp_path):
    state = tmp_path / "state"
    root = state / "ladechat" / "chats"
    root.mkdir(parents=True)
    (root / "20260101-000000-nest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    os.mkfifo(root / "20260101-000001-pipe.json")
    (root / "20260101-000002-dir.json").mkdir()
    env = {**os.environ, "XDG_STATE_HOME": str(state), "NO_COLOR": "1"}

    def run(*args):
        return subprocess.run([ladechat_bin(), *args], capture_output=True, text=True, env=env, timeout=120)

    listing = run("history")
    assert listing.returncode == 0 and listing.stdout.count("unreadable:") == 3, listing.stderr
    for args in (("history", "20260101-000000-nest"), ("history", "20260101-000001-pipe", "--json"), ("--continue",)):
        done = run(*args)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("ladechat: error: cannot read "), done.stderr
    for chat_id in ("20260101-000000-nest", "20260101-000001-pipe", "20260101-000002-dir"):
        gone = run("history", chat_id, "--delete")
        assert gone.returncode == 0 and f"deleted chat {chat_id}" in gone.stderr
    assert list(root.iterdir()) == []
