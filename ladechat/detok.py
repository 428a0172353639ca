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

    def add_step(self, tokens, guessed) -> tuple[str, str]:
        """Append a step's tokens; return their text split where its verified guesses end:
        (the guessed tokens' text, shown as accepted in parallel; the model's own tokens' text)."""
        n = sum(guessed)
        return (self.add(tokens[:n]) if n else ""), self.add(tokens[n:])
