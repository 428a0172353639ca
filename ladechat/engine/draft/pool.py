"""The n-gram pool: what the lookahead window's Jacobi iterations produced, keyed by first token."""

from __future__ import annotations

from collections import OrderedDict


class NGramPool:
    """n-grams keyed by their first token: key -> up to `per_key` continuations of N-1 tokens.

    The lookahead window feeds it one n-gram per column per step; the prompt can seed it. When a key
    is full the least recently added continuation is evicted; adding one that is already there
    makes it the most recent again (the window keeps confirming n-grams that are likely).
    """

    def __init__(self, ngram: int, per_key: int) -> None:
        self.ngram = ngram
        self.per_key = per_key
        self._table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if self.per_key == 0:
            return
        entries = self._table.setdefault(key, OrderedDict())
        if continuation in entries:
            entries.move_to_end(continuation)
            return
        entries[continuation] = None
        if len(entries) > self.per_key:
            entries.popitem(last=False)

    def seed(self, tokens: list[int]) -> None:
        """Add every n-gram of a token sequence (e.g. the prompt)."""
        n = self.ngram
        for i in range(len(tokens) - n + 1):
            self.add(tokens[i], tuple(tokens[i + 1 : i + n]))

    def get(self, key: int) -> list[tuple[int, ...]]:
        """Continuations for `key`, most recently added first."""
        entries = self._table.get(key)
        return list(reversed(entries)) if entries else []

    def __len__(self) -> int:
        return sum(len(v) for v in self._table.values())
