"""The step-cost model the planner uses: the measured curve, lowered by what steps really cost.

The curve (step_cost.py) is measured once, at a model's first use on a machine. If the machine was
busy then (another build, a browser), the curve is too high, and not uniformly: wide steps
suffer more than a one-row step, so its shape overprices them, and the planner sizes every later
step from it: smaller drafts, fewer tokens per step, for good.

So every step the engine runs is also a measurement. The envelope keeps, per measured size, the
lowest cost seen (a machine is never faster than it can be, so the lowest time is the truest), and
uses that a step of more rows never costs less than one of fewer: a step of s rows that took t
seconds says every size up to s costs at most t. Costs are compared at one reference cache length
(the curve's shortest), scaled by the measured curves' own growth with the cache.

Steps the planner never chooses are never observed, and a curve that overprices wide steps keeps
the planner from choosing them. So when the evidence disagrees with the measurement (some size ran
at least DISAGREE cheaper than measured), the envelope asks for a probe every PROBE_EVERY steps: a
step of the smallest measured size that no step has had yet (still a real, verified step: it only
feeds more or fewer of the likeliest draft nodes). A quiet machine's curve is confirmed by the steps it
already takes and is never probed.

What the envelope learned is saved beside the measured curves (persist()), so the next chat starts
from it: a curve measured under load converges to the quiet one within a conversation or two
(tests/test_cost_envelope.py), and a quiet one is left as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ladechat.engine.step_cost import CONTEXTS, CostModel, cache_path, cached_cost_model

DISAGREE = 0.85  # some size ran this much cheaper than measured: the measurement was disturbed
PROBE_EVERY = 8  # steps between probes while the measurement is in doubt


@dataclass
class CostEnvelope:
    """Step cost against tokens fed and cached: the measured curves (`measured`), each measured size
    lowered to the cheapest that real steps showed. `path`: where what was learned is saved (None:
    nowhere)."""

    measured: CostModel
    path: Path | None = None
    best: dict[int, float] = field(default_factory=dict)  # size -> lowest seconds seen, at the reference cache length
    observed: set[int] = field(default_factory=set)  # the measured sizes that some step had
    since_probe: int = 0  # steps observed since the last probe
    _model: CostModel | None = field(default=None, repr=False)  # the curves as lowered, rebuilt on change
    _saved: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        ref = self.measured.curves[self.reference]
        self.best = {size: min(ref[size], self.best.get(size, ref[size])) for size in ref}
        self._model = None
        self._saved = self._state()

    @classmethod
    def load(cls, measured: CostModel, path: Path | None) -> CostEnvelope:
        """The envelope saved at `path` over these measured curves (a fresh one if none is saved or
        it does not read)."""
        if path is not None:
            try:
                saved = json.loads(path.read_text())
                best = {int(size): float(seconds) for size, seconds in saved["best"].items()}
                return cls(measured, path, best=best, observed={int(size) for size in saved["observed"]})
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        return cls(measured, path)

    @property
    def reference(self) -> int:
        return min(self.measured.curves)

    def _at_reference(self, size: int, cached: int) -> float:
        """How much cheaper or dearer the measured curves make a step at `cached` than at the
        reference cache length."""
        return self.measured.cost(size, self.reference) / self.measured.cost(size, cached)

    def cost(self, size: int, cached: int) -> float:
        if self._model is None:
            ref = self.measured.curves[self.reference]
            self._model = CostModel({context: {size: seconds * self.best[size] / ref[size] for size, seconds in curve.items()}
                                     for context, curve in self.measured.curves.items()})
        return self._model.cost(size, cached)

    def observe(self, size: int, cached: int, seconds: float, probe: int | None = None) -> None:
        """A step of `size` rows after `cached` cached tokens took `seconds`. probe: the size it was
        planned to probe (probe_size()), if it was a probe; it may have had fewer rows when the
        draft had fewer nodes, and that size is not probed again."""
        at_reference = seconds * self._at_reference(size, cached)
        for measured_size, best in self.best.items():
            if measured_size <= size and at_reference < best:
                self.best[measured_size] = at_reference
                self._model = None
        self.observed.update({size, probe} & self.best.keys())
        self.since_probe = 0 if probe is not None else self.since_probe + 1

    @property
    def in_doubt(self) -> bool:
        """Some size ran clearly cheaper than it was measured: the measurement was disturbed."""
        ref = self.measured.curves[self.reference]
        return any(self.best[size] < DISAGREE * ref[size] for size in ref)

    def probe_size(self, largest: int) -> int | None:
        """The size of step to run now to test the measurement further, None if none is due: the
        smallest measured size no step has had, up to `largest` (the most rows a step can have),
        every PROBE_EVERY steps while the measurement is in doubt."""
        if self.since_probe < PROBE_EVERY or not self.in_doubt:
            return None
        untried = [size for size in sorted(self.best) if size not in self.observed and size <= largest]
        return untried[0] if untried else None

    def _state(self) -> tuple:
        return tuple(sorted(self.best.items())), tuple(sorted(self.observed))

    def persist(self) -> None:
        """Save what was learned, if anything, for the next session on this machine (an unwritable
        cache only loses the lesson)."""
        if self.path is None or self._state() == self._saved:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"best": self.best, "observed": sorted(self.observed)}))
            temporary.replace(self.path)  # a concurrent reader sees the old file or the new, whole
        except OSError:
            return
        self._saved = self._state()


def learned_cost_model(model, name: str, threads: int | None = None) -> CostEnvelope:
    """The cost model a chat plans with: the measured one, lowered by what real steps cost on this
    machine, saved beside it; kept for `threads` (step_cost.cache_path)."""
    return CostEnvelope.load(cached_cost_model(model, name, threads),
                             cache_path(model, name, "envelope", list(CONTEXTS), threads=threads))


# -- a loaded model's costs (engine/load/loading.LoadedModel) --------------------------------------

def measuring_threads(loaded) -> int | None:
    """The thread count a loaded model's step costs are kept for: the machine's full count, whatever
    a busy spell has set for the steps (else a chat begun then would measure them again, for
    minutes, under another key). A curve measured now runs at the count the machine's load allows
    (on all threads under load, its steps would wait at every barrier: minutes instead of seconds);
    the envelope lowers what a busy spell overpriced as real steps run."""
    if loaded.threads is None:
        return None
    loaded.threads.adjust()
    return loaded.threads.ceiling


def measured_curve(loaded) -> dict[int, float]:
    """A loaded model's step-cost curve on its device (measured once, then read from the cache)."""
    from ladechat.engine.step_cost import cached_curve

    return cached_curve(loaded.model, loaded.name, threads=measuring_threads(loaded))


def cost_model(loaded) -> CostEnvelope:
    """Step cost against tokens fed and cached for a loaded model: measured once per model, device
    and dtype, then read from the cache, and lowered by what the steps it plans really cost."""
    return learned_cost_model(loaded.model, loaded.name, threads=measuring_threads(loaded))


def costs_measured(loaded) -> bool:
    """Whether cost_model(loaded) reads its curves rather than measuring them (seconds)."""
    from ladechat.engine.step_cost import curves_cached

    return curves_cached(loaded.model, loaded.name, loaded.threads.ceiling if loaded.threads else None)
