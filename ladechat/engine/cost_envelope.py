"""The step-cost model the planner uses: the measured curve, lowered by what steps really cost.

The curve (step_cost.py) is measured once, at a model's first use on a machine. If the machine was
busy then (another build, a test suite), the curve is too high, and not uniformly: wide steps can
suffer many times more than a one-row step (a thread waiting at every barrier for a busy core), so
its shape overprices them, and the planner sizes every later step from it: smaller drafts, fewer
tokens per step, for good.

So every step the engine runs is also a measurement. The envelope keeps, per measured size, the
lowest cost seen (a machine is never faster than it can be, so the lowest time is the truest), and
uses that a step of more rows never costs less than one of fewer: a step of s rows that took t
seconds says every size up to s costs at most t. Costs are kept at one reference cache length (the
curve's shortest), and a step is brought there erring high (_at_reference): what is kept may be
too high for a while, never too low, so the planner never buys rows for less than they cost.

Steps the planner never chooses are never observed, and a curve that overprices wide steps keeps
the planner from choosing them. Two kinds of evidence put a size's cost in doubt (what it could
cost, could_cost(), is clearly, DISAGREE, below what it is kept at):
- the machine is quieter than when a step of that size last ran or was measured (a busy spell
  then, seen in how much dearer than their kept costs all steps of that time ran; a wider step
  that bettered it since only bounds it): it could cost its kept cost scaled by the difference;
- it costs more than two narrower steps together (a step of a+b rows could always run as a step
  of a and one of b): a shape no quiet machine has, so it was measured or observed under load.
A size in doubt is probed: a real, verified step of that many rows (the likeliest draft nodes
first), at most every PROBE_EVERY steps, the smallest doubted size first. A probe that leaves its
size in doubt (the machine is still busy, or it really costs that) makes that size wait
WAIT_GROWTH times longer before the next, up to MAX_WAIT steps, so a curve that is right costs ever fewer probes and one that was
wrong is corrected as soon as the machine is quiet. A quiet machine's curve is never in doubt and
never probed.

What the envelope learned, and each size's wait, is saved beside the measured curves (persist()),
so the next chat starts from it: a curve measured under load converges to the quiet one within an
answer or two of a quiet machine (tests/test_cost_envelope.py), and a quiet one is left as it is.
`ladechat bench step-cost --show` prints it; `--reset` forgets it (and the measured curves).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ladechat.engine.step_cost import (
    CONTEXTS,
    CostModel,
    Report,
    cache_path,
    cached_cost_model,
    curve_paths,
    curves_cached,
)

DISAGREE = 0.85  # a size that could cost this much less than it is kept at is in doubt
PROBE_EVERY = 8  # steps between probes, and a doubted size's first wait
RECENT = 0.25  # weight of the latest step in the moving average of the machine's load
WAIT_GROWTH = 4  # a probe that leaves its size in doubt makes it wait this much longer
MAX_WAIT = 512  # the longest a doubted size waits between probes (steps)


@dataclass
class CostEnvelope:
    """Step cost against tokens fed and cached: the measured curves (`measured`), each measured size
    lowered to the cheapest that real steps showed. `path`: where what was learned is saved (None:
    nowhere)."""

    measured: CostModel
    path: Path | None = None
    best: dict[int, float] = field(default_factory=dict)  # size -> lowest seconds seen, at the reference cache length
    basis: dict[int, float] = field(default_factory=dict)  # size -> the one-row cost, times how busy, when that size last ran (or was measured)
    wait: dict[int, int] = field(default_factory=dict)  # size -> steps it last had to wait for its probe
    due: dict[int, int] = field(default_factory=dict)  # size -> the step count from which it may be probed
    steps: int = 0  # steps observed
    busy: float = 1.0  # how much dearer than their kept cost steps run of late (a moving average; 1: quiet)
    since_probe: int = 0  # steps observed since the last probe
    _model: CostModel | None = field(default=None, repr=False)  # the curves as lowered, rebuilt on change
    _saved: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        ref = self.measured.curves[self.reference]
        self.best = {size: min(ref[size], self.best.get(size, ref[size])) for size in ref}
        one = ref[min(ref)]
        self.basis = {size: self.basis.get(size, one) for size in ref}
        self.wait = {size: min(MAX_WAIT, max(PROBE_EVERY, self.wait.get(size, PROBE_EVERY))) for size in ref}
        self.due = {size: self.due.get(size, 0) for size in ref}
        self._model = None
        self._saved = self._state()

    @classmethod
    def load(cls, measured: CostModel, path: Path | None) -> CostEnvelope:
        """The envelope saved at `path` over these measured curves (a fresh one if none is saved or
        it does not read; one saved before waits were kept starts them afresh)."""
        if path is not None:
            try:
                saved = json.loads(path.read_text())
                best = {int(size): float(seconds) for size, seconds in saved["best"].items()}
                basis = {int(size): float(seconds) for size, seconds in saved.get("basis", {}).items()}
                wait = {int(size): int(steps) for size, steps in saved.get("wait", {}).items()}
                due = {int(size): min(MAX_WAIT, max(0, int(steps))) for size, steps in saved.get("due_in", {}).items()}
                if not all(math.isfinite(v) and v > 0 for v in [*best.values(), *basis.values()]):
                    raise ValueError("not a cost")
                return cls(measured, path, best=best, basis=basis, wait=wait, due=due)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
                pass
        return cls(measured, path)

    @property
    def reference(self) -> int:
        return min(self.measured.curves)

    @property
    def one_row(self) -> int:
        """The narrowest measured size (a one-row step)."""
        return min(self.best)

    def _at_reference(self, size: int, cached: int, seconds: float) -> float:
        """What a step of `size` rows that took `seconds` after `cached` cached tokens says of its
        cost at the reference cache length, erring high, never low (a cost kept too low would buy
        rows for less than they cost): after a longer cache, the time as it is (a longer cache never
        makes a step cheaper; scaling it down by the measured curves would trust a curve that may
        have been measured busy); after a shorter one, the time scaled up by the measured curves'
        growth with the cache."""
        if cached >= self.reference or len(self.measured.curves) < 2:
            return seconds
        near, far = sorted(self.measured.curves)[:2]
        at_near, at_far = self.measured.cost(size, near), self.measured.cost(size, far)
        slope = max(0.0, (at_far - at_near) / (far - near))
        return seconds * at_near / max(at_near - slope * (near - cached), 0.5 * at_near)

    def cost(self, size: int, cached: int) -> float:
        if self._model is None:
            ref = self.measured.curves[self.reference]
            self._model = CostModel({context: {size: seconds * self.best[size] / ref[size] for size, seconds in curve.items()}
                                     for context, curve in self.measured.curves.items()})
        return self._model.cost(size, cached)

    def observe(self, size: int, cached: int, seconds: float, probe: int | None = None) -> None:
        """A step of `size` rows after `cached` cached tokens took `seconds`. probe: the size it was
        planned to probe (probe_size()), if it was a probe; it may have had fewer rows when the
        draft had fewer nodes: that size then waits as after any probe that left it in doubt."""
        at_reference = self._at_reference(size, cached, seconds)
        # how busy the machine is now: steps dearer than their kept cost (the kept cost is the
        # cheapest seen, so on a quiet machine they come close; a step cheaper than kept says the
        # curve is high there, not that the machine is quieter than quiet)
        self.busy += RECENT * (max(1.0, at_reference / self.cost(size, self.reference)) - self.busy)
        lowered = set()
        for measured_size, best in self.best.items():
            if measured_size <= size and at_reference < best:
                self.best[measured_size] = at_reference
                lowered.add(measured_size)
                self._model = None
        # the size that ran now ran at the one-row cost of this moment (a busy spell's, if one is
        # on: once it is over, the one-row step is cheaper than that and the size is in doubt again),
        # which was no more than this step's; a size a wider step bettered did not run: that step
        # bounds its cost from above, it may cost far less
        one = self.best[self.one_row]
        self.basis[self.one_row] = one
        if size in self.best and size != self.one_row:
            self.basis[size] = max(min(one * self.busy, at_reference), one)
        for measured_size in lowered:  # new evidence: a doubt that remains is a new one
            self.wait[measured_size], self.due[measured_size] = PROBE_EVERY, self.steps
        if probe is not None and probe in self.best:
            self.since_probe = -1
            if self.doubts(probe):  # still busy, or it really costs that: wait longer next time
                self.wait[probe] = min(MAX_WAIT, WAIT_GROWTH * self.wait[probe])
                self.due[probe] = self.steps + self.wait[probe]
            else:
                self.wait[probe] = PROBE_EVERY
        self.steps += 1
        self.since_probe += 1

    def could_cost(self) -> dict[int, float]:
        """Per measured size, the least the evidence allows it to cost at the reference cache
        length: its kept cost scaled by how much quieter the machine is now than when it last ran,
        and no more than two narrower sizes together (see the module's docstring)."""
        now, best = self.best[self.one_row] * self.busy, self.best
        could: dict[int, float] = {}
        for size in sorted(best):
            least = best[size] * min(1.0, now / self.basis[size])
            for part in could:  # kept costs, not what they could be: a doubt rests on evidence
                if size - part in best:
                    least = min(least, best[part] + best[size - part])
            could[size] = least
        return could

    def doubts(self, size: int, could: dict[int, float] | None = None) -> bool:
        """Whether `size` could cost clearly less than it is kept at."""
        could = self.could_cost() if could is None else could
        return could[size] < DISAGREE * self.best[size]

    @property
    def in_doubt(self) -> bool:
        """Some size could cost clearly less than it is kept at."""
        could = self.could_cost()
        return any(self.doubts(size, could) for size in self.best)

    def probe_size(self, largest: int) -> int | None:
        """The size of step to run now to test a doubted cost, None if none is due: the smallest
        size in doubt whose wait is over, up to `largest` (the most rows a step can have), at most
        every PROBE_EVERY steps."""
        if self.since_probe < PROBE_EVERY:
            return None
        could = self.could_cost()
        due = [size for size in sorted(self.best)
               if 1 < size <= largest and self.due[size] <= self.steps and self.doubts(size, could)]
        return due[0] if due else None

    def summary(self) -> list[dict]:
        """Per measured size, for a person: measured and kept seconds (reference cache length), what
        it could cost, whether it is in doubt, and in how many steps it may be probed next."""
        ref = self.measured.curves[self.reference]
        could = self.could_cost()
        return [{"size": size, "measured_s": ref[size], "kept_s": self.best[size], "could_s": could[size],
                 "in_doubt": self.doubts(size, could), "probe_in": max(0, self.due[size] - self.steps)}
                for size in sorted(self.best)]

    def _state(self) -> tuple:
        return (tuple(sorted(self.best.items())), tuple(sorted(self.basis.items())),
                tuple(sorted(self.wait.items())), tuple(sorted(self._due_in().items())))

    def _due_in(self) -> dict[int, int]:
        return {size: max(0, due - self.steps) for size, due in self.due.items()}

    def persist(self) -> None:
        """Save what was learned, if anything, for the next session on this machine (an unwritable
        cache only loses the lesson)."""
        if self.path is None or self._state() == self._saved:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"best": self.best, "basis": self.basis, "wait": self.wait,
                                             "due_in": self._due_in()}))
            temporary.replace(self.path)  # a concurrent reader sees the old file or the new, whole
        except OSError:
            return
        self._saved = self._state()


def envelope_path(model, name: str, threads: int | None = None) -> Path:
    """Where the envelope over this model's measured curves is saved."""
    return cache_path(model, name, "envelope", list(CONTEXTS), threads=threads)


def learned_cost_model(model, name: str, threads: int | None = None, report: Report | None = None) -> CostEnvelope:
    """The cost model a chat plans with: the measured one, lowered by what real steps cost on this
    machine, saved beside it; kept for `threads` (step_cost.cache_path). report(line): how far a
    measurement is (step_cost.measure)."""
    return CostEnvelope.load(cached_cost_model(model, name, threads, report), envelope_path(model, name, threads))


def kept_cost_model(model, name: str, threads: int | None = None) -> CostEnvelope | None:
    """The cost model a chat would plan with, if its curves are measured already (None: the next
    chat measures them); measures nothing."""
    if not curves_cached(model, name, threads):
        return None
    return learned_cost_model(model, name, threads)


def forget_costs(model, name: str, threads: int | None = None) -> list[Path]:
    """Remove this model's measured curves and what real steps taught (the next chat measures
    afresh); the files removed."""
    removed = []
    for path in [*curve_paths(model, name, threads), envelope_path(model, name, threads)]:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


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


def cost_model(loaded, report: Report | None = None) -> CostEnvelope:
    """Step cost against tokens fed and cached for a loaded model: measured once per model, device
    and dtype, then read from the cache, and lowered by what the steps it plans really cost.
    report(line): how far a measurement is."""
    return learned_cost_model(loaded.model, loaded.name, measuring_threads(loaded), report)


def costs_measured(loaded) -> bool:
    """Whether cost_model(loaded) reads its curves rather than measuring them (seconds)."""
    return curves_cached(loaded.model, loaded.name, _kept_for(loaded))


def _kept_for(loaded) -> int | None:
    return loaded.threads.ceiling if loaded.threads else None


def kept_costs(loaded) -> CostEnvelope | None:
    """What a chat on this loaded model would plan with (None: not measured on this machine yet)."""
    return kept_cost_model(loaded.model, loaded.name, _kept_for(loaded))


def forget(loaded) -> list[Path]:
    """Forget the loaded model's step costs: the next chat measures them afresh."""
    return forget_costs(loaded.model, loaded.name, _kept_for(loaded))
