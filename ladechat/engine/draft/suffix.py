"""Longest-suffix matching over token text: one structure for the conversation and for the store.

A SuffixIndex holds token text as segments (the conversation is one; the store of past answers has
one per answer, separated by SEP) and answers one question: where did the text's current tail
occur before, and how long is each match? For each key length m in KEY_LENS, longest first, the
places that follow an m-token key equal to the tail's last m tokens are looked up (the most recent
SCAN of them), then each match is measured backwards token by token (up to MAX_MATCH) so hits can
be ranked by how much context they share with now, then by recency. The tokens after a hit are a
draft; tree.py counts the hits into a trie, so a continuation that several hits agree on ranks
above one seen once (frequency), and the most recent breaks ties.

Layout: `text` is a growable int32 array. Keys of text[:indexed] are kept sorted per key length
(numpy searchsorted finds a key's run of positions, in text order); the keys of the newest
positions, past `indexed`, are computed as their tokens arrive (in Python: a step brings a few)
into arrays in text order, compared with a lookup's key directly, and folded into the sorted
arrays once REINDEX of them pile up. So appending a step's tokens is O(1) amortised and a lookup
is a few small numpy calls, for a conversation of a few thousand tokens and a store of a few
hundred thousand alike.
"""

from __future__ import annotations

import numpy as np

SEP = -1  # between segments; never a token id, so no key and no continuation crosses it
KEY_LENS = (4, 2, 1)
MAX_MATCH = 16  # a match is measured up to this many tokens back
SCAN = 64  # most recent positions looked at per key
REINDEX = 512  # unindexed tokens that trigger folding them into the sorted keys
RECENT_IN_PYTHON = 16  # tokens appended at once whose keys are computed one by one in Python
_MULT = np.uint64(0x9E3779B97F4A7C15)  # key hash: polynomial in this odd constant, mod 2^64
_MULT_INT, _MASK = int(_MULT), (1 << 64) - 1


def _keys(text: np.ndarray, m: int, ends: np.ndarray) -> np.ndarray:
    """Hash of text[e-m:e] for each end e (callers pass e >= m); keys that span a SEP get the
    all-ones value, which no lookup asks for."""
    h = np.zeros(len(ends), dtype=np.uint64)
    bad = np.zeros(len(ends), dtype=bool)
    for i in range(m, 0, -1):
        tok = text[ends - i]
        bad |= tok < 0
        h = h * _MULT + tok.astype(np.uint64)
    h[bad] = np.uint64(0xFFFFFFFFFFFFFFFF)
    return h


def _key(tokens: list[int]) -> np.uint64:
    """_keys of one short key, in Python integers: a lookup's (or a step's) few tokens do not pay
    for numpy's calls."""
    h = 0
    for tok in tokens:
        if tok < 0:
            return np.uint64(_MASK)
        h = (h * _MULT_INT + tok) & _MASK
    return np.uint64(h)


class SuffixIndex:
    def __init__(self) -> None:
        self.text = np.empty(1024, dtype=np.int32)
        self.n = 0
        self.indexed = 0
        self._sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # m -> (keys, ends), by key
        # m -> keys of the ends indexed + 1 .. n, in text order (all ones: no key, as in _keys)
        self._recent = {m: np.empty(REINDEX, dtype=np.uint64) for m in KEY_LENS}

    def __len__(self) -> int:
        return self.n

    def tokens(self) -> list[int]:
        return self.text[: self.n].tolist()

    # -- text -----------------------------------------------------------------------------------
    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.n + len(tokens) > len(self.text):
            grown = np.empty(max(2 * len(self.text), self.n + len(tokens)), dtype=np.int32)
            grown[: self.n] = self.text[: self.n]
            self.text = grown
        self.text[self.n : self.n + len(tokens)] = tokens
        start, self.n = self.n, self.n + len(tokens)
        if self.n - self.indexed > REINDEX:
            self._reindex()
        elif len(tokens) > RECENT_IN_PYTHON:
            self._recent_keys(start)
        else:
            offset = max(0, start - max(KEY_LENS))  # the new keys' tokens start no earlier
            window = self.text[offset : self.n].tolist()
            for end in range(start + 1, self.n + 1):
                for m in KEY_LENS:
                    self._recent[m][end - self.indexed - 1] = \
                        _key(window[end - m - offset : end - offset]) if end >= m else np.uint64(_MASK)

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` tokens (the conversation was edited)."""
        if length >= self.n:
            return
        self.n = length
        if self.indexed > length:
            self.indexed = 0
            self._sorted = {}
            self._reindex()

    def drop_front(self, count: int) -> None:
        """Forget the first `count` tokens (the store's oldest answers)."""
        self.text = self.text[count : self.n].copy()
        self.n -= count
        self.indexed = 0
        self._sorted = {}
        self._reindex()

    def _recent_keys(self, start: int) -> None:
        """The keys of the ends start + 1 .. n into the recent arrays, with numpy (many tokens)."""
        ends = np.arange(start + 1, self.n + 1, dtype=np.int64)
        for m in KEY_LENS:
            keys = np.full(len(ends), _MASK, dtype=np.uint64)
            long_enough = ends >= m
            keys[long_enough] = _keys(self.text[: self.n], m, ends[long_enough])
            self._recent[m][start - self.indexed : self.n - self.indexed] = keys

    def _reindex(self) -> None:
        text = self.text[: self.n]
        for m in KEY_LENS:
            ends = np.arange(m, self.n + 1, dtype=np.int64)
            keys = _keys(text, m, ends)
            order = np.argsort(keys, kind="stable")  # stable: equal keys stay in text order
            self._sorted[m] = (keys[order], ends[order])
        self.indexed = self.n

    # -- lookup ---------------------------------------------------------------------------------
    def _ends_after(self, key: np.uint64, m: int) -> np.ndarray:
        """Positions right after an occurrence of the m-token key, oldest first, the last SCAN."""
        found = []
        if m in self._sorted:
            keys, ends = self._sorted[m]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            found.append(ends[max(lo, hi - SCAN) : hi])
        if self.n > self.indexed:
            found.append(np.flatnonzero(self._recent[m][: self.n - self.indexed] == key) + (self.indexed + 1))
        return np.concatenate(found)[-SCAN:] if found else np.empty(0, dtype=np.int64)

    def _match_lengths(self, ends: np.ndarray, tail: np.ndarray) -> np.ndarray:
        """How many tokens before each end equal the last tokens of `tail` (up to MAX_MATCH)."""
        # all the steps back at once, (ends, depth), then each row's leading run of equal tokens: a
        # few numpy calls whatever the depth (token by token, ~5 calls a step back)
        depth = min(MAX_MATCH, len(tail))
        back = np.arange(1, depth + 1)
        at = ends[:, None] - back[None, :]
        same = (at >= 0) & (self.text[np.maximum(at, 0)] == tail[len(tail) - back][None, :])
        return np.where(same.all(axis=1), depth, same.argmin(axis=1))

    def matches(self, tail: list[int], length: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` places where `tail`'s end occurred before: (the up to `length` tokens that
        followed, match length), longest match first, then most recent. A place whose continuation
        is empty (the tail itself, at the end of the text) is skipped."""
        if limit <= 0 or not tail or self.n == 0:
            return []
        tail_arr = np.asarray(tail[-MAX_MATCH:], dtype=np.int64)
        found: dict[int, int] = {}
        for m in KEY_LENS:
            if len(found) >= limit or len(tail_arr) < m:
                continue
            key = _key(tail_arr[-m:].tolist())
            if key == _MASK:  # a tail across a segment's end: no key spans one
                continue
            ends = self._ends_after(key, m)
            ends = ends[ends < self.n]
            if found:  # places a longer key already found (a few: Python's set test, not np.isin)
                ends = np.array([end for end in ends.tolist() if end not in found], dtype=np.int64)
            if not len(ends):
                continue
            lengths = self._match_lengths(ends, tail_arr)
            for end, matched in zip(ends.tolist(), lengths.tolist()):
                if matched >= m:  # else a hash collision
                    found[end] = matched
        ranked = sorted(found.items(), key=lambda hit: (-hit[1], -hit[0]))[:limit]
        out = []
        for end, matched in ranked:
            cont = self.text[end : min(end + length, self.n)]
            cut = np.flatnonzero(cont < 0)
            cont = cont[: cut[0]] if len(cut) else cont
            if len(cont):
                out.append((tuple(cont.tolist()), matched))
        return out
