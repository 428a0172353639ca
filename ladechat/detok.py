"""Incremental detokenization: text for new tokens as they arrive, never half a character."""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, tokens) -> str:
        """Append tokens; return the text they complete (held back while a character is partial)."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return new
