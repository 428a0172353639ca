"""The chats kept without asking: each conversation of the interactive chat is written, whole, to a
file of its own under the state folder after every question, answer and command, so that a crash or
a closed terminal loses nothing. `ladechat --continue` opens the newest again, `--resume` and
`/history` list and open any, `ladechat history` prints one as Markdown or JSON.

A chat file is a conversation file as /save writes it (conversation.py), so /load reads it too. The
files are the user's words: private (0600, in a 0700 folder), each written under a temporary name
and renamed over the old one, so a file is always a whole conversation.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ladechat.conversation import Conversation
from ladechat.errors import UserError
from ladechat.paths import state_root

SUFFIX = ".json"
TITLE_CHARS = 60  # of the first question, in a listing


class HistoryError(UserError):
    """A chat that cannot be found or read; the message is one line."""


def chats_root() -> Path:
    """The folder of the kept chats: $XDG_STATE_HOME/ladechat/chats."""
    return state_root() / "chats"


@dataclass(frozen=True)
class SavedChat:
    """A kept chat as a listing shows it."""

    path: Path
    updated: float  # the file's modification time (seconds since the epoch)
    model: str
    messages: int
    title: str  # the first question, on one line

    @property
    def id(self) -> str:
        return self.path.stem

    def line(self, number: int) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.updated))
        return f"{number:>3}  {when}  {self.id}  {self.messages} messages  {self.model}  {self.title}"


def list_chats(root: Path) -> list[SavedChat]:
    """The kept chats, newest first; a file that does not read as a conversation is left out."""
    found = []
    for path in root.glob(f"*{SUFFIX}"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            messages = data["messages"]
            updated = path.stat().st_mtime
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(messages, list):
            continue
        first = next((m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"), "")
        title = " ".join(str(first).split())
        if len(title) > TITLE_CHARS:
            title = title[: TITLE_CHARS - 1] + "…"
        found.append(SavedChat(path, updated, str(data.get("model") or "?"), len(messages), title))
    return sorted(found, key=lambda chat: (chat.updated, chat.id), reverse=True)


def find_chat(root: Path, ref: str) -> Path:
    """The kept chat `ref` names: its number in the listing (1: the newest) or its id (or the
    start of one that no other id shares). HistoryError when there is none."""
    chats = list_chats(root)
    if not chats:
        raise HistoryError("no chats have been kept yet")
    ref = ref.strip()
    if ref.isdigit() and len(ref) < 6:  # ids start with a date: 8 digits
        number = int(ref)
        if not 1 <= number <= len(chats):
            raise HistoryError(f"no chat number {number}: there are {len(chats)} (see: ladechat history)")
        return chats[number - 1].path
    matches = [chat.path for chat in chats if chat.id.startswith(ref)] if ref else []
    if len(matches) != 1:
        why = "no kept chat has" if not matches else f"{len(matches)} kept chats have"
        raise HistoryError(f"{why} the id {ref!r} (see: ladechat history)")
    return matches[0]


def new_path(root: Path) -> Path:
    """A file name for a new chat: when it began, and a few random letters."""
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}{SUFFIX}"


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner only, whole or not at all."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")  # 0600
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


class ChatLog:
    """Where the chat in progress is kept: `path`, chosen when its first message is written (None
    until then). `settings`: the last settings written (the chat's, once its model has loaded)."""

    def __init__(self, root: Path, path: Path | None = None, settings: dict | None = None) -> None:
        self.root = root
        self.path = path
        self.settings = settings or {}
        self.failed: str | None = None  # why the last write failed (said once)

    def keep(self, conversation: Conversation, model: str, settings: dict | None) -> str | None:
        """Write the conversation (no file for one that has had no message yet); the reason when
        the write failed for the first time in a row (the chat goes on without it), else None."""
        if self.path is None and not conversation.transcript():
            return None
        if settings is not None:
            self.settings = settings
        if self.path is None:
            self.path = new_path(self.root)
        try:
            write_private(self.path, conversation.to_json(model, self.settings) + "\n")
        except OSError as exc:
            why = f"{exc.strerror or exc}: {exc.filename or self.path}"
            first, self.failed = self.failed is None, why
            return why if first else None
        self.failed = None
        return None

    def start_over(self) -> None:
        """The next message begins a new chat file (the kept ones stay)."""
        self.path = None


def markdown(path: Path) -> str:
    """A kept (or saved) chat as Markdown: the model, the system prompt, each message under its role."""
    conversation, _ = Conversation.from_file(path)
    model = json.loads(path.read_text(encoding="utf-8")).get("model") or "?"
    parts = [f"# Chat {path.stem}", f"Model: {model}"]
    if conversation.system:
        parts.append(f"**System:** {conversation.system}")
    for message in conversation.transcript():
        who = "You" if message["role"] == "user" else "Assistant"
        note = " (interrupted)" if message.get("interrupted") else ""
        parts.append(f"## {who}{note}\n\n{message['content']}")
    return "\n\n".join(parts) + "\n"
