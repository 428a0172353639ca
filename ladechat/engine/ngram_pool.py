"""Where candidate continuations come from: the n-gram pool and the conversation itself."""

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


class ContextIndex:
    """Finds earlier places in the conversation whose last tokens match the current ones.

    For each match length m in `match_lens` (longest first), positions are keyed by the m tokens
    that end there; looking up the conversation's own last m tokens gives the tokens that followed
    them before (prompt-lookup decoding, over the whole conversation, maintained incrementally).
    Longer matches come first: they are rarer but far more often right.
    """

    def __init__(self, match_lens: tuple[int, ...] = (3, 2, 1), max_hits: int = 4) -> None:
        self.match_lens = match_lens
        self.max_hits = max_hits
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            for m in self.match_lens:
                if end >= m:
                    ends = self._ends.setdefault(tuple(self.tokens[end - m : end]), [])
                    ends.append(end)
                    if len(ends) > self.max_hits * 4:
                        del ends[: -self.max_hits * 2]

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` tokens (a conversation was edited)."""
        if length >= len(self.tokens):
            return
        kept = self.tokens[:length]
        self.tokens = []
        self._ends = {}
        self.extend(kept)

    def continuations(self, tail: list[int], length: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` distinct continuations of up to `length` tokens that once followed `tail`,
        from the longest matches first and, within one match length, the most recent first."""
        return [cont for cont, _ in self.matches(tail, length, limit)]

    def matches(self, tail: list[int], length: int, limit: int, longest: int = 8) -> list[tuple[tuple[int, ...], int]]:
        """continuations() with how many tokens before each one equal the end of `tail` (up to
        `longest`): the longer the match, the likelier the continuation."""
        found: dict[tuple[int, ...], int] = {}
        for m in self.match_lens:
            if len(found) >= limit or len(tail) < m:
                continue
            for end in reversed(self._ends.get(tuple(tail[-m:]), ())):
                cont = tuple(self.tokens[end : end + length])
                if cont and cont not in found:
                    found[cont] = _match_length(self.tokens, end, tail, longest)
                    if len(found) == limit:
                        break
        return list(found.items())


def _match_length(tokens: list[int], end: int, tail: list[int], longest: int) -> int:
    """How many tokens before position `end` of `tokens` equal the last tokens of `tail`."""
    n = 0
    while n < longest and n < end and n < len(tail) and tokens[end - 1 - n] == tail[-1 - n]:
        n += 1
    return n
