"""Token ids to text: incremental detokenization, and a local model's Steps as the Pieces every
front end shows."""

from __future__ import annotations

from ladechat.backends.events import Piece, pieces
from ladechat.engine.events import Step


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


class StepText:
    """An answer's Steps as Pieces: each step's text split where its verified guesses end (shown as
    accepted in parallel) and the model's own tokens begin, with the step itself and each of its
    tokens decoded alone (for --debug) on its last piece."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)

    def pieces(self, step: Step) -> list[Piece]:
        n = sum(step.guessed)
        guessed = self.detok.add(step.tokens[:n]) if n else ""
        own = self.detok.add(step.tokens[n:])
        spelled = tuple(self.tokenizer.decode([token]) for token in step.tokens)
        return list(pieces([(guessed, True), (own, False)], step, spelled))
