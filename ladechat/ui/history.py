"""The chats kept without asking: each conversation of the interactive chat is written, whole, to a
file of its own under the state folder after every question, answer and command, so that a crash or
a closed terminal loses nothing. `ladechat --continue` opens the newest again, `--resume` and
`/history` list and open any, `ladechat history` prints one as Markdown or JSON.

A chat file is a conversation file as /save writes it (conversation.py), so /load reads it too. The
files are the user's words: private (0600, in a 0700 folder), each written under a temporary name
and renamed over the old one, so a file is always a whole conversation.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ladechat.conversation import Conversation, ConversationError, read_json_file
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
    """A kept chat as a listing shows it. `problem`: why the file does not read as a chat (it is
    listed all the same, so that `ladechat history --delete` can remove it), else None."""

    path: Path
    updated: float  # the file's modification time (seconds since the epoch)
    model: str
    messages: int
    title: str  # the first question, on one line
    problem: str | None = None

    @property
    def id(self) -> str:
        return self.path.stem

    def line(self, number: int) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.updated))
        if self.problem is not None:
            return f"{number:>3}  {when}  {self.id}  unreadable: {self.problem}"
        return f"{number:>3}  {when}  {self.id}  {self.messages} messages  {self.model}  {self.title}"


def list_chats(root: Path) -> list[SavedChat]:
    """The kept chats, newest first; a file that does not read as one is listed as unreadable."""
    found = []
    for path in root.glob(f"*{SUFFIX}"):
        try:
            updated = path.lstat().st_mtime
        except OSError:  # gone since the listing
            continue
        try:
            data = read_json_file(path)
            conversation, _ = Conversation.from_data(data, path)
        except ConversationError as exc:
            found.append(SavedChat(path, updated, "?", 0, "", exc.reason))
            continue
        messages = conversation.transcript()
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        title = " ".join(first[: TITLE_CHARS * 4].split())
        if len(title) > TITLE_CHARS:
            title = title[: TITLE_CHARS - 1] + "…"
        found.append(SavedChat(path, updated, " ".join(str(data.get("model") or "?").split()), len(messages), title))
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


class Claim:
    """A chat file claimed by this process for as long as the chat writes to it: an exclusive lock
    (flock) on a hidden lock file beside it, released by release() or when the process ends, even
    by a kill. take() gives None when another chat holds it."""

    def __init__(self, handle, path: Path) -> None:
        self.handle, self.path = handle, path

    @staticmethod
    def take(chat: Path) -> Claim | None:
        import fcntl

        path = chat.with_name(f".{chat.stem}.lock")
        chat.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:
            handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+b", buffering=0)  # noqa: SIM115 (held)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # the lock file is still the one at `path` (a release meanwhile unlinks it: take the next)
                if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                    return Claim(handle, path)
            except BlockingIOError:  # another chat holds it
                handle.close()
                return None
            except FileNotFoundError:
                pass
            except BaseException:
                handle.close()
                raise
            handle.close()

    def release(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.handle.close()


class ChatLog:
    """Where the chat in progress is kept: `path`, chosen when its first message is written (None
    until then). `settings`: the last settings written (the chat's, once its model has loaded).

    Each chat file has one writer: the chat that claimed it (Claim). A chat that reopens a file
    another chat holds (the same chat continued in a second terminal) goes on in a new file, a copy
    of it from then on, so neither chat's messages overwrite the other's."""

    def __init__(self, root: Path, path: Path | None = None, settings: dict | None = None) -> None:
        self.root = root
        self.path = path
        self.settings = settings or {}
        self.failed: str | None = None  # why the last write failed (said once)
        self.claim: Claim | None = None

    def open(self, path: Path, settings: dict) -> str | None:
        """Write on to the kept chat at `path` from now on; when another chat holds it, to a new
        file instead, and say so (the notice; else None)."""
        self.start_over()
        self.settings = settings
        try:
            self.claim = Claim.take(path)
        except OSError:  # a folder that takes no lock file: write on as before
            self.path = path
            return None
        if self.claim is not None:
            self.path = path
            return None
        self.path = new_path(self.root)
        self.claim = Claim.take(self.path)
        return (f"chat {path.stem} is open in another ladechat: this one goes on in a new file, "
                f"{self.path.stem} (nothing either chat says is lost)")

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
                self.claim = Claim.take(self.path)
            except OSError:
                self.claim = None
        try:
            write_private(self.path, conversation.to_json(model, self.settings) + "\n")
        except OSError as exc:
            why = f"{exc.strerror or exc}: {exc.filename or self.path}"
            first, self.failed = self.failed is None, why
            return why if first else None
        self.failed = None
        return None

    def close(self) -> None:
        """The chat ends: its file is free for another chat to write on."""
        self.start_over()

    def start_over(self) -> None:
        """The next message begins a new chat file (the kept ones stay)."""
        self.path = None
        if self.claim is not None:
            self.claim.release()
            self.claim = None


def markdown(path: Path) -> str:
    """A kept (or saved) chat as Markdown: the model, the system prompt, each message under its role."""
    data = read_json_file(path)
    conversation, _ = Conversation.from_data(data, path)
    model = data.get("model") or "?"
    parts = [f"# Chat {path.stem}", f"Model: {model}"]
    if conversation.system:
        parts.append(f"**System:** {conversation.system}")
    for message in conversation.transcript():
        who = "You" if message["role"] == "user" else "Assistant"
        note = " (interrupted)" if message.get("interrupted") else ""
        parts.append(f"## {who}{note}\n\n{message['content']}")
    return "\n\n".join(parts) + "\n"
