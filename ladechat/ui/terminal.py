"""What reaches the terminal: text from a model, a file, a server or a kept chat is shown there,
never obeyed. A control character in it (ESC starting a CSI or OSC sequence that would clear the
screen, set the clipboard or retitle the window; a C1 control, which some terminals obey alone) is
written out as its escape (`\\x1b`) instead. Only a terminal gets the escapes: a pipe or a file gets
the text as it is, byte for byte."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import TextIO

from rich.console import Console
from rich.segment import Segment

# C0 controls but tab and newline, DEL, and the C1 controls
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with each control character written out as its escape (a line's CR LF as LF), so a
    terminal shows it instead of acting on it."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))


class SafeConsole(Console):
    """A rich Console whose text reaches a terminal with its control characters shown (visible());
    the console's own control output (styles, the cursor moves of a redraw) passes as it is."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        if self.is_terminal:
            buffer = [segment if segment.control or not _CONTROL.search(segment.text)
                      else Segment(visible(segment.text), segment.style, segment.control) for segment in buffer]
        return super()._render_buffer(buffer)


def write(text: str, stream: TextIO | None = None) -> None:
    """Write `text` to `stream` (stdout): shown safely on a terminal, as it is to a pipe or a file."""
    stream = stream or sys.stdout
    stream.write(visible(text) if _is_terminal(stream) else text)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


def json_text(record, indent: int | None = None) -> str:
    """`record` as JSON (one line, or indented), every control character escaped (json escapes C0
    controls itself; DEL and C1 too here), other characters as they are: safe on a terminal, and
    the same document anywhere."""
    import json

    text = json.dumps(record, ensure_ascii=False, indent=indent)
    return re.sub("[\x7f-\x9f]", lambda m: f"\\u{ord(m.group()):04x}", text)
