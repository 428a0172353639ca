"""A reasoning model's thinking, told apart from its answer: the text between `<think>` and
`</think>` (DeepSeek-R1, Qwen3, QwQ and their kin write it so), found as the answer streams, a tag
possibly cut across pieces."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkingSplitter:
    """feed(piece) -> [(thinking?, text), ...] in order; what could still be the start of a tag is
    held back until the next piece (or flush()) says."""

    def __init__(self) -> None:
        self.inside = False
        self.held = ""
        self.thinking = ""  # all the thinking so far
        self.answer = ""  # all the rest

    def feed(self, piece: str) -> list[tuple[bool, str]]:
        text, self.held = self.held + piece, ""
        out: list[tuple[bool, str]] = []
        while text:
            tag = CLOSE if self.inside else OPEN
            at = text.find(tag)
            if at >= 0:
                self._emit(out, text[:at])
                text = text[at + len(tag):]
                self.inside = not self.inside
                continue
            keep = _partial_tag(text, tag)
            self._emit(out, text[: len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        self._emit(out, self.held)
        self.held = ""
        return out

    def _emit(self, out: list[tuple[bool, str]], text: str) -> None:
        if not text:
            return
        if self.inside:
            self.thinking += text
        else:
            # the answer after a thought starts on its own line in the model's text: not twice on screen
            if not self.answer and self.thinking:
                text = text.lstrip("\n")
                if not text:
                    return
            self.answer += text
        out.append((self.inside, text))


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split(text: str) -> tuple[str, str]:
    """(thinking, answer) of a whole text."""
    splitter = ThinkingSplitter()
    splitter.feed(text)
    splitter.flush()
    return splitter.thinking, splitter.answer
