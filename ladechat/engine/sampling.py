"""Choosing a token from a row of logits, the same way for plain decoding and for verification."""

from __future__ import annotations

import torch

from ladechat.engine.config import SamplingConfig


class Chooser:
    """Greedy (argmax) or sampling with repetition penalty, temperature, top-k, top-p, min-p.

    `history` is every token the model has seen before this row (prompt + accepted tokens + the
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

    def probabilities(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        cfg = self.cfg
        scores = logits.float().clone()
        if cfg.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), device=scores.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * cfg.repetition_penalty, picked / cfg.repetition_penalty)
        if cfg.greedy:
            out = torch.zeros_like(scores)
            out[scores.argmax()] = 1.0
            return out
        scores = scores / cfg.temperature
        if cfg.top_k and cfg.top_k < scores.numel():
            kth = torch.topk(scores, cfg.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_scores.softmax(-1) >= cfg.top_p  # keep the token that crosses top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        if cfg.min_p > 0:
            probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return probs

    def pick(self, logits: torch.Tensor, history: list[int]) -> int:
        if self.plain_argmax:
            return int(logits.argmax())
        probs = self.probabilities(logits, history)
        if self.cfg.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
