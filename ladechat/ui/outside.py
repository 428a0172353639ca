"""The chat's two doors to the rest of the desktop: the terminal's clipboard (OSC 52) for /copy,
and the user's editor for /edit."""

from __future__ import annotations

import base64
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from ladechat.errors import UserError


class OutsideError(UserError):
    pass


def osc52(text: str) -> str:
    """The escape sequence that asks a terminal to put `text` on the system clipboard (xterm's
    OSC 52; iTerm2, kitty, WezTerm, Windows Terminal and tmux with set-clipboard take it)."""
    return f"\x1b]52;c;{base64.b64encode(text.encode('utf-8')).decode('ascii')}\x07"


def editor_command() -> list[str]:
    """$VISUAL, else $EDITOR, else vi, split as a shell would (an editor with flags, say 'code -w')."""
    return shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")


def edit(text: str = "") -> str:
    """`text` opened in the user's editor; what the file holds when the editor exits (stripped).
    OutsideError when the editor cannot start or ends with an error (nothing is sent then)."""
    command = editor_command()
    with tempfile.TemporaryDirectory(prefix="ladechat-edit-") as folder:
        path = Path(folder) / "message.md"
        path.write_text(text, encoding="utf-8")
        try:
            done = subprocess.run([*command, str(path)], check=False)
        except OSError as exc:
            raise OutsideError(f"cannot start the editor {command[0]!r} ({exc.strerror or exc}); "
                               "set VISUAL or EDITOR") from None
        if done.returncode != 0:
            raise OutsideError(f"the editor {command[0]!r} ended with status {done.returncode}; nothing sent")
        return path.read_text(encoding="utf-8", errors="replace").strip()
