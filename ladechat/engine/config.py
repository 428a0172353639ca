"""Frozen settings for one generation: how to speculate and how to choose tokens.

The engine takes them as they are; what users give is checked (types and ranges) by
ladechat.settings.Settings, which builds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladechat.errors import UserError


class ConfigError(UserError, ValueError):
    """A setting a user gave is of the wrong type or out of range, or does not fit the runner (e.g. a
    fixed-shape step); the message is one line meant for them."""


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

    The defaults are the CPU's (the only place they are stated: settings.Settings and the CLI take
    them from here; a GPU's are chosen from its step-cost curve, defaults.gpu_lookahead). Chosen
    against plain decoding (measured: BENCHMARKS.md): small windows win, since on a CPU every extra
    row costs; the model's recycled top-k pays as a draft source, and W of 1 or 2 made no
    measurable difference.
    """

    window: int = 2
    ngram: int = 3
    candidates: int = 1
    context_candidates: int = 2
    context_len: int = 12
    recycle: int = 16
    store: bool = True
    seed_pool: bool = True
    enabled: bool = True


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from a row of logits. temperature == 0 means greedy. The defaults
    are every front end's (settings.Settings and the CLI take them from here); max_new_tokens is
    the default of a setting, the commands have their own (cli.MAX_NEW_TOKENS)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
