"""Verification: the longest draft path whose every token is the model's own choice, plus the
model's next token after it (the bonus token). A choice is argmax (greedy) or a draw from the
row's distribution (sampling.TokenPicker), so the answer is the one plain decoding would give."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladechat.engine.layout import StepLayout
from ladechat.engine.sampling import TokenPicker

Pick = Callable[[int, list[int]], int]  # pick(row, path) -> the model's token at that row


def verify(layout: StepLayout, pick: Pick) -> tuple[list[int], list[int], str]:
    """Walk the candidate trie along the model's own choices; pick(row, path) -> token, where
    path is the tokens accepted before that row.

    Returns (accepted tokens, candidate rows matched, source of the matched candidate). The last
    accepted token is the model's choice after the deepest match: the bonus token.
    """
    accepted: list[int] = []
    matched: list[int] = []
    node = 0
    while True:
        tok = pick(node, accepted)
        accepted.append(tok)
        child = layout.children[node].get(tok)
        if child is None:
            break
        matched.append(child)
        node = child
    source = layout.sources[matched[0] - layout.window_rows] if matched else "none"
    return accepted, matched, source


def batched_pick(layout: StepLayout, logits: torch.Tensor, picker: TokenPicker, history: list[int]) -> Pick:
    """verify's pick(row, path) from one batched choice over the root and every draft node: a
    node's path is known before verifying (its ancestors' tokens), so every row's repetition
    penalty and draw can be settled at once, with one transfer to the host."""
    rows = [0, *range(layout.window_rows, layout.size)]
    paths: dict[int, list[int]] = {0: []}
    for row in rows[1:]:  # parents come before their children
        paths[row] = paths[layout.parents[row]] + [layout.tokens[row]]
    # a row's depth in the tree is its path's length
    picked = picker.pick_rows(logits[rows], history, [paths[r] for r in rows], [len(paths[r]) for r in rows])
    chosen = dict(zip(rows, picked, strict=True))
    return lambda row, path: chosen[row]
