"""Frozen, validated settings for one generation: how to speculate and how to choose tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A setting a user gave is of the wrong type or out of range; the message is one line meant for them."""


@dataclass(frozen=True)
class LookaheadConfig:
    """W, N, G of the paper plus our CPU-minded knobs.

    window (W):     columns of the Jacobi window (level 0 includes the input token as column 0).
    ngram (N):      n-gram size; the window has N-1 levels, candidates are N-1 tokens long.
    candidates (G): at most G n-grams per key in the pool and G pool candidates per step.
    context_candidates: extra candidates found by matching the conversation's last tokens
                    against earlier text (prompt-lookup style); free to find, paid for per token.
    context_len:    how many tokens such a context candidate proposes.
    recycle:        most nodes per step drafted from the model's own recycled top-k (0: none).
    store:          draft from the store of the model's past answers, and add each answer to it.
    seed_pool:      put the prompt's n-grams into the pool before decoding.
    enabled:        False runs plain one-token decoding through the same loop.
    """

    window: int = 5
    ngram: int = 4
    candidates: int = 5
    context_candidates: int = 2
    context_len: int = 8
    recycle: int = 16
    store: bool = True
    seed_pool: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        _whole("W (window)", self.window)
        _whole("N (n-gram size)", self.ngram)
        _whole("G (candidates)", self.candidates)
        _whole("context candidates", self.context_candidates)
        _whole("context length", self.context_len)
        _whole("recycled nodes", self.recycle)
        _flag("store", self.store)
        _flag("seed_pool", self.seed_pool)
        _flag("lookahead", self.enabled)
        _check(self.ngram >= 2, f"N (n-gram size) must be >= 2, got {self.ngram}")
        _check(self.window >= 1, f"W (window) must be >= 1, got {self.window}")
        _check(self.candidates >= 0, f"G (candidates) must be >= 0, got {self.candidates}")
        _check(self.context_candidates >= 0, f"context candidates must be >= 0, got {self.context_candidates}")
        _check(self.context_len >= 1, f"context length must be >= 1, got {self.context_len}")
        _check(self.recycle >= 0, f"recycled nodes must be >= 0, got {self.recycle}")
        _check(self.ngram <= 16 and self.window <= 64 and self.candidates <= 64 and self.recycle <= 256,
               "W, N, G are too large (limits: W <= 64, N <= 16, G <= 64, recycled nodes <= 256)")


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from a row of logits. temperature == 0 means greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _whole("max_new_tokens", self.max_new_tokens)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _number(name, getattr(self, name))
        _whole("top_k", self.top_k)
        if self.seed is not None:
            _whole("seed", self.seed)
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop),
               f"stop must be a list of strings, got {self.stop!r}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Settings also come from files (/load), where a value of the wrong type would pass the range checks
# (2.5 >= 1, True >= 1) and only fail deep inside decoding, or compare with a str and raise TypeError.
def _whole(name: str, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be a whole number, got {value!r}")


def _number(name: str, value) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} must be a number, got {value!r}")


def _flag(name: str, value) -> None:
    _check(isinstance(value, bool), f"{name} must be true or false, got {value!r}")
