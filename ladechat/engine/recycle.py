"""The model's own top-k, recycled: per token id, the next tokens the model last ranked highest.

Every forward step already computes a row of logits for each token it feeds (the input token,
window guesses, candidates). Their top-k are free by-products: a row fed token x says which tokens
the model expects after x in that context. Kept per token id (a vocab x k table, ~1.5 MB for a
49k vocabulary at k=8) they draft continuations when the conversation offers no textual match
(Token Recycling, Luo et al., ACL 2025). The table only proposes; verification decides.
"""

from __future__ import annotations

import numpy as np

TOP_K = 8


class SuccessorTable:
    def __init__(self, k: int = TOP_K) -> None:
        self.k = k
        self._table: np.ndarray | None = None  # (vocab, k) int32, -1 = nothing seen yet

    def update(self, tokens: list[int], top: np.ndarray) -> None:
        """top[i]: the model's top-k next tokens (best first) computed for the row fed tokens[i].
        Later rows win where a token repeats, so callers put the rows they trust most last."""
        if self._table is None:
            self._table = np.full((0, self.k), -1, dtype=np.int32)
        last = {tok: i for i, tok in enumerate(tokens)}  # the last row of each token id
        ids = np.fromiter(last.keys(), dtype=np.int64, count=len(last))
        rows = np.fromiter(last.values(), dtype=np.int64, count=len(last))
        need = int(ids.max()) + 1
        if need > len(self._table):  # grow to the largest token id seen (vocab sizes vary by model)
            grown = np.full((max(need, 2 * len(self._table)), self.k), -1, dtype=np.int32)
            grown[: len(self._table)] = self._table
            self._table = grown
        self._table[ids, : top.shape[1]] = top[rows, : self.k]

    def successors(self, token: int) -> list[int]:
        """The model's latest top-k after `token`, best first (empty if never seen)."""
        if self._table is None or token >= len(self._table):
            return []
        row = self._table[token]
        return [int(x) for x in row if x >= 0]

    def __len__(self) -> int:
        """Token ids with successors on record."""
        return 0 if self._table is None else int((self._table[:, 0] >= 0).sum())
