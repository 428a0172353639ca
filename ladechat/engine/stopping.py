"""Exact stopping inside an accepted block: EOS ids, stop strings, max_new_tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopRule:
    eos_ids: frozenset[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def cut(self, generated: list[int], block: list[int]) -> tuple[int, str | None]:
        """How many tokens of `block` to keep, and why generation stops there (None: it goes on).

        Tokens before the stop are never dropped and none after it are kept: an EOS is kept as
        the last token (as `generate` does), a stop string ends with the token that completes it.
        """
        strings = self.stop_strings if self.decode is not None else ()
        seen = len(self.decode(generated)) if strings else 0
        for i, tok in enumerate(block):
            if tok in self.eos_ids:
                return i + 1, "eos"
            if strings:
                text = self.decode(generated + block[: i + 1])
                if any(text.find(s, max(0, seen - len(s) + 1)) >= 0 for s in strings):
                    return i + 1, "stop"
            if len(generated) + i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return len(block), None
