"""The typed events of an answer in token ids, and how its stream can fail.

The engine (decode.generate) streams Step events (Session.step's own record, timed), then one
Done; or it raises OutOfMemory midway. The text events the backends make of them are in
backends/events.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    """Tokens committed by one forward pass.

    guessed[i] is True when tokens[i] was a verified guess (a candidate token that matched the
    model's own choice), i.e. it arrived in parallel with the step's first token. The last token of
    a step is always the model's own choice (the "bonus" token), never a guess.
    """

    tokens: tuple[int, ...]
    guessed: tuple[bool, ...]
    source: str  # the accepted guesses' draft source ("context", "store", "pool", "recycle"); "none" when
    # no guess was accepted; "plain" for every step with lookahead off
    fed: int  # tokens in the forward pass
    seconds: float  # the step's wall time (decode.generate's clock; 0 where none was taken)
    stop: str | None = None  # why the answer ends with this step ("eos", "length", "stop"), None if it goes on


@dataclass(frozen=True)
class Stats:
    """What one generation cost and how well speculation worked."""

    new_tokens: int
    steps: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens that were not already in the KV cache
    prefill_s: float
    ttft_s: float
    decode_s: float
    total_s: float
    accepted_histogram: dict[int, int]  # tokens committed per step -> how many steps
    accepted_by_position: tuple[int, ...]  # guesses verified at depth 1, 2, ... of a candidate
    source_counts: dict[str, int]  # which source supplied the winning guess, per step
    pool_size: int
    mean_fed: float  # tokens per forward pass
    lookahead: bool
    window: int
    ngram: int
    candidates: int
    finish_reason: str  # "eos", "length", "stop", "interrupted"
    # per draft source: (accepted nodes the planner expected, accepted nodes seen) over the nodes
    # whose parent was accepted; close numbers mean the planner's estimates are calibrated
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)
    context_length: int = 0  # the most tokens the conversation may hold (--ctx); 0 where not known

    @property
    def context_used(self) -> int:
        """Tokens the conversation holds after this answer: what it was given and what it added."""
        return self.prompt_tokens + self.new_tokens

    @property
    def compression(self) -> float:
        """Tokens per forward pass: how many sequential steps lookahead saved."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "compression": round(self.compression, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s": round(self.ttft_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_s": round(self.decode_s, 4),
            "total_s": round(self.total_s, 4),
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "accepted_by_position": list(self.accepted_by_position),
            "source_counts": dict(self.source_counts),
            "pool_size": self.pool_size,
            "mean_fed": round(self.mean_fed, 3),
            "lookahead": self.lookahead,
            "W": self.window,
            "N": self.ngram,
            "G": self.candidates,
            "finish_reason": self.finish_reason,
            "calibration": {src: {"predicted": p, "observed": o} for src, (p, o) in self.calibration.items()},
            "context_length": self.context_length,
        }

    @staticmethod
    def from_dict(d: dict) -> Stats:
        """Stats from as_dict()'s form (a server's last chunk)."""
        return Stats(
            new_tokens=d["new_tokens"], steps=d["steps"], prompt_tokens=d["prompt_tokens"],
            prefill_tokens=d["prefill_tokens"], prefill_s=d["prefill_s"], ttft_s=d["ttft_s"], decode_s=d["decode_s"],
            total_s=d["total_s"], accepted_histogram={int(k): v for k, v in d["accepted_histogram"].items()},
            accepted_by_position=tuple(d["accepted_by_position"]), source_counts=dict(d["source_counts"]),
            pool_size=d["pool_size"], mean_fed=d["mean_fed"], lookahead=d["lookahead"], window=d["W"], ngram=d["N"],
            candidates=d["G"], finish_reason=d["finish_reason"],
            calibration={k: (v["predicted"], v["observed"]) for k, v in d.get("calibration", {}).items()},
            context_length=d.get("context_length", 0))


@dataclass
class Tally:
    """One answer's Steps added up as they come: the part of its Stats that the steps decide
    (decode.generate's, and the client's for an answer a server cut short)."""

    tokens: list[int] = field(default_factory=list)  # every token committed, in order
    steps: int = 0
    fed: int = 0  # tokens fed over all steps
    histogram: Counter[int] = field(default_factory=Counter)  # tokens committed per step -> steps
    by_position: Counter[int] = field(default_factory=Counter)  # guess depth -> steps that verified it
    sources: Counter[str] = field(default_factory=Counter)  # the source of a step's verified guesses -> steps

    def add(self, step: Step) -> None:
        self.tokens += step.tokens
        self.steps += 1
        self.fed += step.fed
        self.histogram[len(step.tokens)] += 1
        for depth in range(sum(step.guessed)):
            self.by_position[depth] += 1
        if any(step.guessed):
            self.sources[step.source] += 1

    def stats(self, **rest) -> Stats:
        """Stats of the steps so far; `rest`: the fields the steps do not decide (times, settings,
        the finish reason, ...)."""
        return Stats(new_tokens=len(self.tokens), steps=self.steps, accepted_histogram=dict(self.histogram),
                     accepted_by_position=tuple(self.by_position[d] for d in range(max(self.by_position, default=-1) + 1)),
                     source_counts=dict(self.sources), mean_fed=self.fed / self.steps if self.steps else 0.0, **rest)


@dataclass(frozen=True)
class Done:
    text_tokens: tuple[int, ...]  # every token generated, in order (including a final EOS)
    stats: Stats
    text: str = ""  # the whole answer as text, from a backend (the engine deals in ids)


class OutOfMemory(RuntimeError):
    """A forward pass ran out of device or host memory. The session was left consistent (the
    half-done step dropped), so the conversation can go on, e.g. after dropping old turns."""
