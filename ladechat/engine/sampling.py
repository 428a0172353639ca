"""Choosing tokens from rows of logits, the same way for plain decoding and for verification."""

from __future__ import annotations

import torch

from ladechat.engine.config import SamplingConfig


class TokenPicker:
    """Greedy (argmax) or sampling with repetition penalty, temperature, top-k, top-p, min-p.

    A row's history is every token the model has seen before it (prompt + accepted tokens + the
    path through the candidate being verified), so the repetition penalty inside a step is the
    same as it would be one token at a time.
    """

    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self.generator = torch.Generator()
        if cfg.seed is not None:
            self.generator.manual_seed(cfg.seed)
        else:
            self.generator.seed()

    @property
    def plain_argmax(self) -> bool:
        """True when a whole batch of rows can be decided by one argmax."""
        return self.cfg.greedy and self.cfg.repetition_penalty == 1.0

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """Next-token probabilities of each row of penalized `scores` (..., vocab)."""
        cfg = self.cfg
        scores = scores / cfg.temperature
        if cfg.top_k and cfg.top_k < scores.shape[-1]:
            kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            sorted_probs = sorted_scores.softmax(-1)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= cfg.top_p  # keep the token that crosses top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        if cfg.min_p > 0:
            probs = probs.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def pick_rows(self, logits: torch.Tensor, history: list[int], paths: list[list[int]],
                  depths: list[int]) -> list[int]:
        """The token each row of `logits` (rows, vocab) picks, all rows at once and with one
        transfer to the host (a GPU would otherwise wait once per verified row). Row r's history
        is `history` + paths[r]. Rows at the same depth of the draft tree share one uniform draw:
        verification visits at most one row per depth, so the draws it uses are independent."""
        cfg = self.cfg
        rows, vocab = logits.shape
        scores = logits.float().clone()
        if cfg.repetition_penalty != 1.0:
            seen = torch.zeros(rows, vocab, dtype=torch.bool, device=scores.device)
            seen[:, sorted(set(history))] = True
            extra = [(r, tok) for r, path in enumerate(paths) for tok in path]
            if extra:
                seen[[r for r, _ in extra], [tok for _, tok in extra]] = True
            penalty = cfg.repetition_penalty
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if cfg.greedy:
            return scores.argmax(-1).tolist()
        uniform = torch.rand(max(depths) + 1, generator=self.generator)[depths]
        return inverse_cdf(self.probabilities(scores), uniform).tolist()

    def pick(self, logits: torch.Tensor, history: list[int]) -> int:
        """The token one row of logits (vocab,) picks."""
        if self.plain_argmax:
            return int(logits.argmax())
        return self.pick_rows(logits.unsqueeze(0), history, [[]], [0])[0]


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` (rows, vocab), the token drawn by the uniform number in [0, 1) of that
    row: the first whose cumulative probability passes it (scaled by the row's total, which rounding
    keeps from being exactly 1). A product that rounds up to the total falls to the last token that
    can be drawn, never to a filtered one."""
    cumulative = probs.cumsum(-1)
    targets = uniform.to(cumulative.device, cumulative.dtype).unsqueeze(-1) * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, targets, right=True).squeeze(-1)
    last_possible = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last_possible)
