"""One draft tree per step, from every source, each node priced by how likely it is to be accepted.

Sources propose continuations of the step's input token t:
  context  - text that followed the conversation's last tokens earlier in the conversation
  store    - text that followed them in the model's past answers (store.py)
  pool     - n-grams the lookahead window produced (Jacobi iterations)
  recycle  - the model's own top-k after each token (or pair of tokens), from earlier forward
             passes (recycle.py)
They are merged into one trie. Each node carries q = P(accepted | its parent accepted), learned
online per bucket (source, match length or rank, depth, and the share of textual hits that agree
or whether a recycled guess followed the same pair), and p = the product of q along its path,
the probability that verification reaches it. A step of nodes T then yields 1 + sum(p) tokens on
average and costs cost(1 + |T|): `worth_feeding` keeps the most likely nodes while that ratio
improves, and nothing at all (a plain step) when no node is worth its cost.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass

# Prior P(accepted | parent accepted) per bucket, worth PRIOR_WEIGHT observations. Learned values
# replace them within a few dozen steps; the priors only decide the first steps of a session.
PRIOR_WEIGHT = 4.0
HALF_LIFE = 400.0  # observations: older evidence fades, so a bucket follows the current text
MIN_PATH_P = 0.02  # nodes less likely than this are not worth proposing at all
MAX_DEPTH = 16


@dataclass(frozen=True)
class Node:
    token: int
    parent: int  # index of the parent node in the draft, -1 for the step's input token
    source: str  # "context", "store", "pool" or "recycle"
    bucket: tuple  # statistics bucket of q
    p: float  # probability that verification accepts this node (product of q along the path)


SHARE_PRIOR = (0.3, 0.6, 0.85, 1.0)  # per share bucket (see share_bucket)


def share_bucket(share: float) -> int:
    """How many of the textual hits below a node's parent agree on this node: 3 = all of them."""
    return 3 if share >= 0.999 else 2 if share >= 0.6 else 1 if share >= 0.3 else 0


@functools.cache  # a few hundred buckets, asked for ~100 times a step
def _prior(bucket: tuple) -> float:
    source, first, depth, *extra = bucket
    if source in ("context", "store"):  # first: length of the textual match; extra: the share bucket
        base = min(0.75, 0.15 * first) if depth == 1 else 0.7
        return base * (SHARE_PRIOR[extra[0]] if extra else 1.0) * (1.0 if source == "context" else 0.8)
    if source == "recycle":  # first: the token's rank in the model's recycled top-k; extra: whether
        ranks = (0.5, 0.15, 0.07) if extra and extra[0] else (0.35, 0.12, 0.06)  # it followed the same pair
        return ranks[first] if first < 3 else 0.03
    if source == "grammar":  # tokens a grammar forces: only another spelling of the same text differs
        return 0.95
    return 0.2 if depth == 1 else 0.5  # pool n-grams


class Acceptance:
    """Online P(accepted | parent accepted) per bucket: counts with a prior, fading with age."""

    def __init__(self) -> None:
        self._hits: dict[tuple, float] = {}
        self._trials: dict[tuple, float] = {}
        self.predicted: dict[str, float] = {}  # per source: sum of q over tried nodes (calibration)
        self.observed: dict[str, float] = {}  # per source: how many of those were accepted

    def q(self, bucket: tuple) -> float:
        hits, trials = self._hits.get(bucket, 0.0), self._trials.get(bucket, 0.0)
        return (hits + PRIOR_WEIGHT * _prior(bucket)) / (trials + PRIOR_WEIGHT)

    def record(self, bucket: tuple, accepted: bool) -> None:
        source = bucket[0]
        self.predicted[source] = self.predicted.get(source, 0.0) + self.q(bucket)
        self.observed[source] = self.observed.get(source, 0.0) + accepted
        trials = self._trials.get(bucket, 0.0) + 1.0
        hits = self._hits.get(bucket, 0.0) + accepted
        if trials > HALF_LIFE:
            trials, hits = trials / 2, hits / 2
        self._trials[bucket], self._hits[bucket] = trials, hits

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        """The calibration counts now, for since()."""
        return dict(self.predicted), dict(self.observed)

    def since(self, snapshot: tuple[dict[str, float], dict[str, float]]) -> dict[str, tuple[float, float]]:
        """Per source, (accepted nodes expected, accepted nodes seen) since the snapshot, for the
        sources tried since."""
        predicted, observed = snapshot
        return {src: (round(self.predicted[src] - predicted.get(src, 0.0), 2),
                      round(self.observed[src] - observed.get(src, 0.0), 2))
                for src in self.predicted if self.predicted[src] != predicted.get(src, 0.0)}


class DraftTree:
    """A trie of proposed nodes under the step's input token; the same token under the same
    parent is one node, kept at the highest probability any source gave it."""

    def __init__(self, acceptance: Acceptance) -> None:
        self.acceptance = acceptance
        self.nodes: list[Node] = []
        self._depths: list[int] = []  # per node: its depth below t (1 for t's children)
        self._index: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def path_p(self, parent: int) -> float:
        return 1.0 if parent < 0 else self.nodes[parent].p

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self._depths[node]

    def add(self, parent: int, token: int, source: str, bucket: tuple) -> int:
        p = self.path_p(parent) * self.acceptance.q(bucket)
        at = self._index.get((parent, token))
        if at is None:
            self._index[(parent, token)] = len(self.nodes)
            self.nodes.append(Node(token, parent, source, bucket, p))
            self._depths.append(self.depth(parent) + 1)
            return len(self.nodes) - 1
        if p > self.nodes[at].p:
            self.nodes[at] = Node(token, parent, source, bucket, p)
        return at

    def add_chain(self, tokens: tuple[int, ...], source: str, first: int) -> None:
        """A textual candidate: each token hangs off the previous one."""
        parent = -1
        for depth, tok in enumerate(tokens[:MAX_DEPTH], start=1):
            parent = self.add(parent, tok, source, (source, first, min(depth, 4)))
            if self.nodes[parent].p < MIN_PATH_P:
                break

    def add_matches(self, source: str, hits: list[tuple[tuple[int, ...], int]]) -> None:
        """Textual hits (continuation, match length), counted into a trie: a node's bucket holds
        the longest match behind it, its depth, and the share of its parent's hits that continue
        through it, so text that several earlier places agree on ranks above a one-off."""
        count: list[int] = []
        longest: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (local parent, token) -> local node
        order: list[tuple[int, int]] = []  # (local parent, token), parents before children
        for cont, matched in hits:
            parent = -1
            for tok in cont[:MAX_DEPTH]:
                at = index.get((parent, tok))
                if at is None:
                    at = index[(parent, tok)] = len(order)
                    order.append((parent, tok))
                    count.append(0)
                    longest.append(0)
                count[at] += 1
                longest[at] = max(longest[at], matched)
                parent = at
        placed: list[int] = []  # local node -> node in this tree (-2: pruned)
        for at, (parent, tok) in enumerate(order):
            up = -1 if parent < 0 else placed[parent]
            if up == -2:
                placed.append(-2)
                continue
            share = count[at] / (len(hits) if parent < 0 else count[parent])
            depth = self.depth(up) + 1
            node = self.add(up, tok, source, (source, min(longest[at], 8), min(depth, 4), share_bucket(share)))
            placed.append(node if self.nodes[node].p >= MIN_PATH_P else -2)

    def add_recycled(self, t: int, before_t: int, lookup: Callable[[int, int], tuple[list[int], bool]],
                     limit: int) -> None:
        """Best-first expansion of the model's recycled top-k below t (whose previous token is
        `before_t`, -1 if none), and below every node already in the tree (a recycled guess can
        continue a textual one), up to `limit` nodes. lookup(prev, token) -> (successors, whether
        they were recorded after that same pair)."""
        heap: list[tuple[float, int, int, int, tuple]] = []  # (-p, order, parent, token, bucket)
        order = 0

        def push_children(parent: int, token: int, prev: int) -> None:
            nonlocal order
            depth = self.depth(parent) + 1
            if depth > MAX_DEPTH:
                return
            following, paired = lookup(prev, token)
            for rank, nxt in enumerate(following):
                bucket = ("recycle", rank, min(depth, 3), int(paired))
                p = self.path_p(parent) * self.acceptance.q(bucket)
                if p < MIN_PATH_P:
                    break
                heapq.heappush(heap, (-p, order, parent, nxt, bucket))
                order += 1

        def token_of(node: int) -> int:
            return t if node < 0 else self.nodes[node].token

        push_children(-1, t, before_t)
        for i, node in enumerate(list(self.nodes)):
            push_children(i, node.token, token_of(node.parent))
        added = 0
        while heap and added < limit:
            _, _, parent, token, bucket = heapq.heappop(heap)
            known = (parent, token) in self._index
            at = self.add(parent, token, "recycle", bucket)
            if not known:
                added += 1
                push_children(at, token, token_of(parent))

    def keep_valid(self, valid_prefix: Callable[[list[int]], int]) -> None:
        """Drop every node whose path from the input token is not all valid (valid_prefix(path):
        how many of its first tokens are), and the nodes under it: a grammar's refusals are never fed."""
        kept: list[int] = []  # old node -> new node, -1: dropped
        nodes, depths = self.nodes, self._depths
        self.nodes, self._depths, self._index = [], [], {}
        paths: list[list[int]] = []
        for node, depth in zip(nodes, depths, strict=True):
            up = -1 if node.parent < 0 else kept[node.parent]
            path = ([] if node.parent < 0 else paths[node.parent]) + [node.token]
            paths.append(path)
            if (node.parent >= 0 and up < 0) or valid_prefix(path) < len(path):
                kept.append(-1)
                continue
            self._index[(up, node.token)] = len(self.nodes)
            self.nodes.append(Node(node.token, up, node.source, node.bucket, node.p))
            self._depths.append(depth)
            kept.append(len(self.nodes) - 1)

    def by_probability(self) -> list[int]:
        """Node indices, most likely first. A parent always comes first: every q is below 1 and a
        merge only ever raises a node's p, so a child stays less likely than its parent."""
        return sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].p, i))


def worth_feeding(tree: DraftTree, step_cost: Callable[[int], float] | None, limit: int | None = None) -> list[Node]:
    """The nodes worth feeding, re-indexed so that parents point into the returned list (-1: the
    input token). With a cost function: the likeliest prefix (parents first) that maximises the
    expected tokens per second, (1 + sum of p) / step_cost(1 + nodes), which is empty when no node
    pays for itself. Without one (full steps): the likeliest `limit` nodes."""
    order = tree.by_probability()[:limit]
    best_k = len(order)
    if step_cost is not None:
        best_k, best_rate = 0, 1.0 / step_cost(1)
        expected = 1.0
        for k, i in enumerate(order, start=1):
            expected += tree.nodes[i].p
            rate = expected / step_cost(1 + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
    kept = order[:best_k]
    new_index = {old: new for new, old in enumerate(kept)}
    return [Node(n.token, new_index[n.parent] if n.parent >= 0 else -1, n.source, n.bucket, n.p)
            for n in (tree.nodes[i] for i in kept)]
