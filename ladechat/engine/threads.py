"""How many threads a CPU step runs on, as the machine's other load comes and goes.

torch splits every op of a step across its threads (OpenMP), and each op ends at a barrier that
waits for all of them. On a small machine where something else is running (a build, a browser, a
second model), one of our threads is often off its core: every barrier waits for the scheduler,
thousands of times a step, and a step on fewer threads runs much faster than one on all of them
(measured: BENCHMARKS.md, scripts/thread_load.py).
So the thread count follows the cores other processes leave free: before a step, at most every
`interval_s`, the CPU time the CPUs this process may run on spent outside it since the last look
says how many of them are taken; the steps use the rest (at least one, at most torch's count when
the model was loaded, which honours OMP_NUM_THREADS), and only counts whose steps give the full
count's bits on this machine (thread_probe.py). A quiet machine keeps every thread.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

# Others' load (in cores) tolerated before giving up a thread: a quiet desktop's background noise
# (a few % of a core) must not cost a thread; a process using a fifth of a core already makes the
# barrier waits worse than a thread less.
SLACK = 0.2


@dataclass(frozen=True)
class CpuSample:
    """A look at the machine: when, how long all its CPUs have idled, how much CPU time this
    process has used (seconds)."""

    wall: float
    idle: float
    own: float


def our_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, where the OS says; else all)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return list(range(os.cpu_count() or 1))


def sample_cpu(cpus: list[int] | None = None) -> CpuSample:
    """Idle time summed over `cpus` (default: ours): others' work on CPUs we cannot use is no
    competition."""
    import psutil

    per_cpu = psutil.cpu_times(percpu=True)
    chosen = [per_cpu[i] for i in (cpus if cpus is not None else our_cpus()) if i < len(per_cpu)] or per_cpu
    # waiting for a disk is not using a core
    idle = sum(t.idle + getattr(t, "iowait", 0.0) for t in chosen)
    return CpuSample(time.monotonic(), idle, time.process_time())


def cpu_count() -> int:
    """The CPUs whose idle time sample_cpu sums: ours."""
    return len(our_cpus())


class CpuThreads:
    """Sets torch's thread count before each step from the machine's other load (see above).
    sample, get_threads, set_threads: the machine and torch's thread count, replaceable for tests."""

    def __init__(self, ceiling: int | None = None, cpus: int | None = None, interval_s: float = 0.5,
                 sample: Callable[[], CpuSample] = sample_cpu, get_threads: Callable[[], int] | None = None,
                 set_threads: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 counts: tuple[int, ...] | None = None) -> None:
        """clock: the clock of sample()'s `wall` (read first: most steps need no look). counts: the
        thread counts it may set (None: any from 1 to the ceiling); see restrict()."""
        import torch

        self.get_threads = get_threads or torch.get_num_threads
        self.set_threads = set_threads or torch.set_num_threads
        self.ceiling = ceiling or self.get_threads()
        self.cpus = cpus or cpu_count()
        self.interval_s = interval_s
        self.sample = sample
        self.clock = clock
        self.threads = self.ceiling
        self.counts = tuple(range(1, self.ceiling + 1))
        self.widest: int | None = None  # steps of more rows run on the ceiling (None: no such limit)
        if counts is not None:
            self.restrict(counts)
        self.others = 0.0  # cores the rest of the machine used over the last interval
        self.last = sample()

    def restrict(self, counts: tuple[int, ...], widest: int | None = None) -> None:
        """Set only these thread counts (the ceiling's own among them): those whose steps of up to
        `widest` rows (None: any) give the ceiling's bits (thread_probe.py); wider steps run on the
        ceiling."""
        if self.ceiling not in counts:
            raise ValueError(f"the counts {counts} must include the ceiling, {self.ceiling}")
        self.counts = tuple(sorted(c for c in counts if 1 <= c <= self.ceiling))
        self.widest = widest

    def adjust(self, rows: int | None = None) -> int:
        """Look at the machine if the last look is `interval_s` old, and set the thread count for
        the steps that follow (for a step of `rows` rows, if given); returns it."""
        if rows is not None and self.widest is not None and rows > self.widest:
            if self.get_threads() != self.ceiling:  # a step wider than the probe's: the ceiling's bits
                self.set_threads(self.ceiling)
            return self.ceiling
        if self.get_threads() != self.threads:  # after a wide step
            self.set_threads(self.threads)
        if self.ceiling == 1 or self.clock() - self.last.wall < self.interval_s:
            return self.threads
        now = self.sample()
        span = now.wall - self.last.wall  # at least interval_s: sample()'s wall is clock()
        busy = self.cpus * span - (now.idle - self.last.idle)
        self.others = max(0.0, (busy - (now.own - self.last.own)) / span)
        self.last = now
        self.threads = self.wanted(self.others)
        # asked, not remembered: something else may have set it since (the count is per OS thread
        # under OpenMP; the steps run on the thread that asks)
        if self.get_threads() != self.threads:
            self.set_threads(self.threads)
        return self.threads

    def wanted(self, others: float) -> int:
        """Threads for a machine whose other processes keep `others` cores busy: the largest allowed
        count that fits the free cores, else the smallest allowed."""
        free = self.cpus - math.ceil(max(0.0, others - SLACK))
        return max([c for c in self.counts if c <= free], default=self.counts[0])

    def describe(self) -> str:
        return f"{self.threads} of {self.ceiling} threads (others used {self.others:.1f} of {self.cpus} cores)"


def release_openmp_team() -> bool:
    """Free the OpenMP team of the calling thread (its idle worker threads exit), before another
    thread takes over the model's steps; whether there was an OpenMP runtime to ask.

    torch's parallel ops run on a team of threads that belongs to the thread calling them, and
    libgomp keeps each such team alive. A server loads the model on its main thread and answers on
    a model thread: two teams, more threads than a small machine has cores, and libgomp then stops
    spinning at its barriers and sleeps at each one instead, thousands of times a step: served steps
    ran far slower than in-process until the main thread's team was freed (measured:
    BENCHMARKS.md). omp_pause_resource_all (OpenMP 5.0) is
    how a program hands its threads back; the team comes back if this thread runs parallel ops again.
    """
    import ctypes

    try:
        runtime = ctypes.CDLL("libgomp.so.1")  # torch's own, already loaded under that name
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):  # another OpenMP runtime, or none: nothing to free this way
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft: the threads go, the runtime stays usable
