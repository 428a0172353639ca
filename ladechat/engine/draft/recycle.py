"""The model's own top-k, recycled: per token, the next tokens the model last ranked highest.

Every forward step already computes a row of logits for each token it feeds (the input token,
window guesses, candidates). Their top-k are free by-products: a row fed token x says which tokens
the model expects after x in that context. Kept per token id (a vocab x k table, ~1.5 MB for a
49k vocabulary at k=8) they draft continuations when the conversation offers no textual match
(Token Recycling, Luo et al., ACL 2025). The table only proposes; verification decides.

Each row is also kept under the pair (previous token, token): two tokens of context pick the
model's next token far more often than one (measured: BENCHMARKS.md). Pairs live in a fixed
hash table (PAIR_SLOTS slots, a newer pair overwrites an older one in its slot), so memory stays
bounded whatever the vocabulary.
"""

from __future__ import annotations

import numpy as np

TOP_K = 8
PAIR_SLOTS = 1 << 17  # ~5 MB at k=8; a long chat sees fewer distinct pairs than this
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key * this (mod 2^64) pick the slot


class SuccessorTable:
    def __init__(self, k: int = TOP_K, pair_slots: int = PAIR_SLOTS) -> None:
        self.k = k
        self._table: np.ndarray | None = None  # (vocab, k) int32, -1 = nothing seen yet
        self._shift = 64 - (pair_slots.bit_length() - 1)
        self._pair_keys = np.full(pair_slots, -1, dtype=np.int64)  # (prev << 32 | token) per slot, -1: empty
        self._pair_rows = np.full((pair_slots, k), -1, dtype=np.int32)

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.astype(np.uint64) * np.uint64(_MIX)) >> np.uint64(self._shift)).astype(np.int64)

    def _slot(self, key: int) -> int:  # _slots for one key, without numpy's per-call overhead
        return ((key * _MIX) & 0xFFFFFFFFFFFFFFFF) >> self._shift

    def update(self, tokens: list[int], top: np.ndarray, prevs: list[int] | None = None) -> None:
        """top[i]: the model's top-k next tokens (best first) computed for the row fed tokens[i],
        whose previous token was prevs[i] (-1: none). Later rows win where a token (or pair)
        repeats, so callers put the rows they trust most last."""
        width = min(top.shape[1], self.k)
        if len(tokens) == 1:  # a one-row step (most steps on a CPU): no index arrays to build
            token, prev = tokens[0], prevs[0] if prevs is not None else -1
            self._room_for(token)
            self._table[token, :width] = top[0, :width]
            if prev >= 0:
                key = (prev << 32) | token
                slot = self._slot(key)
                self._pair_keys[slot] = key
                self._pair_rows[slot, :width] = top[0, :width]
            return
        last = {tok: i for i, tok in enumerate(tokens)}  # the last row of each token id
        ids = np.fromiter(last.keys(), dtype=np.int64, count=len(last))
        rows = np.fromiter(last.values(), dtype=np.int64, count=len(last))
        self._room_for(int(ids.max()))
        self._table[ids, :width] = top[rows, :width]
        if prevs is None:
            return
        pairs: dict[int, int] = {}  # pair key -> its last row, in the order of those last rows
        for i, (prev, tok) in enumerate(zip(prevs, tokens, strict=True)):
            if prev >= 0:
                key = (prev << 32) | tok
                pairs.pop(key, None)
                pairs[key] = i
        if pairs:
            keys = np.fromiter(pairs.keys(), dtype=np.int64, count=len(pairs))
            rows = np.fromiter(pairs.values(), dtype=np.int64, count=len(pairs))
            slots = self._slots(keys)
            self._pair_keys[slots] = keys  # two pairs in one slot: the later row's stays (numpy's last write)
            self._pair_rows[slots, :width] = top[rows, :width]

    def _room_for(self, token: int) -> None:
        """Grow the table to hold `token` (to the largest token id seen: vocab sizes vary by model)."""
        if self._table is None:
            self._table = np.full((0, self.k), -1, dtype=np.int32)
        if token >= len(self._table):
            grown = np.full((max(token + 1, 2 * len(self._table)), self.k), -1, dtype=np.int32)
            grown[: len(self._table)] = self._table
            self._table = grown

    def successors(self, token: int) -> list[int]:
        """The model's latest top-k after `token`, best first (empty if never seen)."""
        if self._table is None or token >= len(self._table):
            return []
        return _listed(self._table[token])

    def lookup(self, prev: int, token: int) -> tuple[list[int], bool]:
        """The latest top-k after the pair (prev, token) if on record, else after `token` alone;
        and whether it was the pair's."""
        if prev >= 0:
            key = (prev << 32) | token
            slot = self._slot(key)
            if self._pair_keys[slot] == key:
                return _listed(self._pair_rows[slot]), True
        return self.successors(token), False

    def __len__(self) -> int:
        """Token ids with successors on record."""
        return 0 if self._table is None else int((self._table[:, 0] >= 0).sum())

    def pairs(self) -> int:
        """Pairs on record (at most PAIR_SLOTS)."""
        return int((self._pair_keys >= 0).sum())


def _listed(row: np.ndarray) -> list[int]:
    return [x for x in row.tolist() if x >= 0]  # -1: no successor of that rank on record
