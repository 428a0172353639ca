r"""The token layout of one lookahead step and the attention mask that separates its branches.

A step is a tree of tokens rooted at the last accepted token t. Every row's position is
p + (its depth in the tree) and every row attends to all committed KV plus its own ancestors.
Example: W=3, N=3, and two pool candidates "a b" and "a c" (merged into a trie):

  row  token   position  branch
   0   t       p         input (also column 0 of level 0)
   1   l0[1]   p+1       window level 0   (a chain: each column follows the previous one)
   2   l0[2]   p+2       window level 0
   3   l1[0]   p+1       window level 1   (column j hangs off level 0, column j)
   4   l1[1]   p+2       window level 1
   5   l1[2]   p+3       window level 1
   6   a       p+1       candidate trie
   7   b       p+2       candidate trie
   8   c       p+2       candidate trie

  query \ key   t  l0 l0 l1 l1 l1 a  b  c      x = attends
  t   (p)       x
  l0[1] (p+1)   x  x
  l0[2] (p+2)   x  x  x
  l1[0] (p+1)   x        x
  l1[1] (p+2)   x  x        x
  l1[2] (p+3)   x  x  x        x
  a   (p+1)     x                 x
  b   (p+2)     x                 x  x
  c   (p+2)     x                 x     x

So t and level 0 are causal among themselves; a level-l token in column j sees level 0 up to
column j and the column-j tokens of levels 1..l; a candidate token sees t and its own prefix; no
branch sees another. Window row of (level l, column j) is l*W + j; candidate rows follow.
A step reads the logits of every row: row 0 and the candidate rows for verification (the model's
next token, and the bonus token after the last matched one), the window's last level for its new
guesses, and every row's top-k for the recycled successor table (draft/recycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ladechat.engine.draft.tree import Node


@dataclass(frozen=True)
class StepLayout:
    tokens: list[int]  # one per row
    parents: list[int]  # parent row, -1 for row 0
    window_rows: int  # rows 0 .. window_rows-1 are the window ((N-1) * W)
    last_level: range  # rows whose argmax become the new window tokens
    children: list[dict[int, int]]  # candidate trie: row -> {token: child row}; row 0 is the root
    nodes: tuple[Node, ...] = ()  # per candidate row (row window_rows + i): its draft node

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def sources(self) -> list[str]:
        return [node.source for node in self.nodes]


def window_parents(window: int, levels: int) -> list[int]:
    """Parents of the window rows: level 0 is a chain from t, level l hangs off level l-1."""
    parents = [-1] + list(range(window - 1))  # level 0: column j follows column j-1
    for level in range(1, levels):
        parents += [(level - 1) * window + j for j in range(window)]
    return parents


def tree_layout(window_tokens: list[list[int]], nodes: list[Node]) -> StepLayout:
    """window_tokens: N-1 levels of W tokens (window_tokens[0][0] is t); nodes: a draft tree whose
    parents point into `nodes` (-1: t), parents before children, no two siblings alike."""
    levels, width = len(window_tokens), len(window_tokens[0])
    tokens = [tok for level in window_tokens for tok in level]
    parents = window_parents(width, levels)
    children: list[dict[int, int]] = [dict() for _ in tokens]
    first = len(tokens)
    for node in nodes:
        parent_row = 0 if node.parent < 0 else first + node.parent
        children[parent_row][node.token] = len(tokens)
        tokens.append(node.token)
        parents.append(parent_row)
        children.append({})
    last = (levels - 1) * width
    return StepLayout(tokens, parents, levels * width, range(last, last + width), children, tuple(nodes))


def build_layout(window_tokens: list[list[int]], candidates: list[tuple[tuple[int, ...], str]]) -> StepLayout:
    """A layout from whole candidate sequences (tokens, source), merged into a trie."""
    nodes: list[Node] = []
    index: dict[tuple[int, int], int] = {}
    for cand, source in candidates:
        parent = -1
        for depth, tok in enumerate(cand, start=1):
            at = index.get((parent, tok))
            if at is None:
                at = index[(parent, tok)] = len(nodes)
                nodes.append(Node(tok, parent, source, (source, 0, depth), 0.0))
            parent = at
    return tree_layout(window_tokens, nodes)


def tree_mask(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self matrix (S, S) bool and depth (S,) of a tree given by parent rows, each
    parent before its children (every layout here is built so).

    One pass in row order: a row sees what its parent sees, and itself. On the host with numpy
    (a step's tree is small): torch's ops on tensors this small cost more than the work.
    """
    size = len(parents)
    sees = np.zeros((size, size), dtype=bool)
    depth = np.zeros(size, dtype=np.int64)
    for row, parent in enumerate(parents):
        if parent >= row:
            raise ValueError(f"row {row}'s parent {parent} does not come before it")
        if parent >= 0:
            sees[row] = sees[parent]
            depth[row] = depth[parent] + 1
        sees[row, row] = True
    return torch.from_numpy(sees), torch.from_numpy(depth)


def step_inputs(layout: StepLayout, past: int, dtype: torch.dtype, device: torch.device):
    """input_ids, position_ids and the additive 4D mask (1, 1, S, past + S) for one step.

    The mask is made on the device; only the (S, S) tree block crosses from the host, not S x past
    zeros every step. Its rows are cut from rows of a multiple of 8 columns: SDPA's memory-efficient
    kernel needs aligned rows, and would otherwise copy the mask into padded ones (with a warning)."""
    sees, depth = tree_mask(layout.parents)
    size, keys = layout.size, past + layout.size
    mask = torch.zeros(1, 1, size, -(-keys // 8) * 8, dtype=dtype, device=device)[..., :keys]
    mask[0, 0, :, past:].masked_fill_(~sees.to(device), torch.finfo(dtype).min)
    ids = torch.tensor([layout.tokens], dtype=torch.long)
    positions = (depth + past).unsqueeze(0)
    return ids.to(device), positions.to(device), mask


def fixed_step_inputs(layout: StepLayout, past: int, size: int, cache_len: int, dtype: torch.dtype,
                      device: torch.device):
    """The step padded to `size` rows, with a mask over a whole pre-allocated cache (1, 1, size, cache_len).

    Every step then has the same shapes, so a compiled graph (or a CUDA graph) can be replayed:

      key slot:   0 .. p-1 (committed) | p .. p+size-1 (this step)        | p+size .. (free)
      tree row    x x x ... x          | ancestors-or-self, as above      | .
      pad row     x x x ... x          | itself only                      | .

    Padding rows (token 0 at position p) see at least themselves, so their outputs stay finite
    (an all-masked row would give NaN), no real row sees them, and the cache slots they write lie
    beyond what commit_kv keeps. The mask is built on the device: no host round trip.
    """
    sees, depth = tree_mask(layout.parents)
    real = layout.size
    block = torch.eye(size, dtype=torch.bool)
    block[:real, :real] = sees
    slots = torch.arange(cache_len, device=device)
    visible = (slots < past).expand(size, cache_len).clone()
    visible[:, past : past + size] = block.to(device, non_blocking=True)
    mask = torch.zeros(1, 1, size, cache_len, dtype=dtype, device=device)
    mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
    ids = torch.tensor([layout.tokens + [0] * (size - real)], dtype=torch.long)
    positions = torch.cat([depth + past, torch.full((size - real,), past)]).unsqueeze(0)
    return ids.to(device), positions.to(device), mask


def rows_device(model) -> torch.device:
    """Where a step's row indices (`logits_to_keep`) must live: with the last hidden states they
    index. On one device that is `model.device`; a device map over several devices can leave them
    on another GPU than the one `model.device` names (and the output layer's weight can be tied to
    the embeddings on the first), so there the index goes on the CPU, which every device accepts."""
    placed = set((getattr(model, "hf_device_map", None) or {}).values())
    return torch.device("cpu") if len(placed) > 1 else model.device
