"""The lines typed at the chat's prompt, kept for Up/Down across chats: private to the user (the
file 0600 in a 0700 folder, as the kept chats are), and never in the way. A history that cannot be
read or written (a full or read-only disk, a file of another owner) costs only itself: one notice,
the chat goes on without it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from prompt_toolkit.history import FileHistory


class PrivateHistory(FileHistory):
    """prompt_toolkit's FileHistory in a private file; `failure` says why it stopped working (once,
    through take_notice())."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failure: str | None = None
        self._noticed = False
        try:
            private(path)
        except OSError as exc:
            self._failed("kept", exc)
        super().__init__(str(path))

    def load_history_strings(self) -> Iterable[str]:
        try:
            return list(super().load_history_strings())
        except OSError as exc:
            self._failed("read", exc)
            return []

    def store_string(self, string: str) -> None:
        if self.failure is not None:
            return
        try:
            super().store_string(string)
        except OSError as exc:
            self._failed("kept", exc)

    def _failed(self, how: str, exc: OSError) -> None:
        if self.failure is None:
            self.failure = (f"the input history {self.path} cannot be {how} ({exc.strerror or exc}); "
                            "Up/Down recall only this chat's lines")

    def take_notice(self) -> str | None:
        """The failure, the first time it is asked for after it happened; else None."""
        if self.failure is None or self._noticed:
            return None
        self._noticed = True
        return self.failure


def private(path: Path) -> None:
    """Make `path`'s folder 0700 and the file 0600 (created empty if missing)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(descriptor, 0o600)
    finally:
        os.close(descriptor)
