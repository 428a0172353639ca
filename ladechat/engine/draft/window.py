"""The lookahead window: Jacobi iteration as a draft source (Fu et al., ICML 2024).

N-1 levels of W guesses for the positions after the step's input t. Every step that carries the
window recomputes its columns: each level moves down one and the last level takes the model's
new guesses (argmax of its rows), so a column's guesses converge towards what the model would
say. Once each level has been recomputed, a column's levels and its new guess form an n-gram,
which goes into the pool (pool.py); the pool's n-grams are what the window contributes to
the draft tree. A step may carry only the first columns (the planner decides how many); the
others keep their guesses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladechat.engine.draft.pool import NGramPool


class JacobiWindow:
    def __init__(self, width: int, ngram: int) -> None:
        self.width = width  # W columns
        self.depth = ngram - 1  # N-1 levels
        self.levels: list[list[int]] | None = None  # filled at the first step that carries it
        self.age = 0  # steps since the window was filled; its n-grams are harvested after N-2
        self.rng = torch.Generator().manual_seed(0)  # the fill's random picks: deterministic runs

    def resize(self, width: int, ngram: int) -> None:
        """New W and N: the window is filled afresh at the next step (its random picks go on)."""
        self.width, self.depth, self.levels = width, ngram - 1, None

    def fill(self, t: int, before_t: int, history: list[int],
             successors: Callable[[int, int], tuple[list[int], bool]]) -> list[list[int]]:
        """The window for a step from t (level 0, column 0 is t). The first time, all N-1 levels are
        filled at once (not with N-2 warm-up steps), so every step has the same shape and the first
        steps already verify drafts. Level l, column j guesses position p+l+j: the model's recycled
        top-1 chain from t (successors(prev, token), the successor table's lookup) where it has one
        (the window then starts near the model's own trajectory), else conversation tokens. Its
        n-grams are junk until each level has been recomputed once, so harvesting waits N-2 steps."""
        if self.levels is None:
            chain, prev, tok = [], before_t, t
            source = history or [t]
            for _ in range(self.width + self.depth - 1):
                nxt, _ = successors(prev, tok)
                prev, tok = tok, nxt[0] if nxt else source[int(torch.randint(len(source), (1,), generator=self.rng))]
                chain.append(tok)
            self.levels = [[t] + chain[: self.width - 1]] + [chain[level - 1 : level - 1 + self.width]
                                                             for level in range(1, self.depth)]
            self.age = 0
        self.levels[0][0] = t
        return self.levels

    def advance(self, new_tokens: list[int], pool: NGramPool) -> None:
        """After a step that computed the first len(new_tokens) columns (new_tokens: their last
        level's new guesses): pool each such column's n-gram, then move those columns down one level."""
        levels, k = self.levels, len(new_tokens)
        if self.age >= len(levels) - 1:
            for col, last in enumerate(new_tokens):
                gram = [level[col] for level in levels] + [last]
                pool.add(gram[0], tuple(gram[1:]))
        for level in range(len(levels) - 1):
            levels[level][:k] = levels[level + 1][:k]
        levels[-1][:k] = new_tokens
        self.age += 1
