"""The CPU steps' thread count follows the machine's other load (engine/threads.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from tiny_models import tiny_model

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done
from ladechat.engine.threads import CpuSample, CpuThreads


class Machine:
    """A machine of `cpus` CPUs whose other processes keep `others` cores busy while this process
    uses `own` cores; time moves only when told."""

    def __init__(self):
        self.now = self.idle = self.own_time = 0.0
        self.cpus, self.others, self.own = 2, 0.0, 1.0

    def run(self, seconds: float) -> None:
        self.now += seconds
        self.own_time += self.own * seconds
        self.idle += (self.cpus - self.others - self.own) * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.idle, self.own_time)


def governor(machine, ceiling=2):
    calls = []
    threads = CpuThreads(ceiling=ceiling, cpus=machine.cpus, interval_s=0.5, sample=machine.sample,
                         get_threads=lambda: calls[-1] if calls else ceiling, set_threads=calls.append,
                         clock=lambda: machine.now)
    return threads, calls


def test_a_busy_core_costs_a_thread_and_a_quiet_machine_gives_it_back():
    machine = Machine()
    threads, calls = governor(machine)
    machine.run(1.0)
    assert threads.adjust() == 2 and calls == []  # quiet: torch's threads as they are
    machine.others = 0.9  # a build starts on the other core
    machine.run(0.3)
    assert threads.adjust() == 2  # not looked at yet: the last look is 0.3 s old
    machine.run(0.3)
    assert threads.adjust() == 1 and calls == [1]
    assert abs(threads.others - 0.9) < 1e-9
    machine.run(2.0)
    assert threads.adjust() == 1 and calls == [1]  # set once, not at every step
    machine.others = 0.05  # background noise does not count
    machine.run(0.6)
    assert threads.adjust() == 2 and calls == [1, 2]
    calls.append(1)  # something else in the process set torch's count: set again at the next look
    machine.run(0.6)
    assert threads.adjust() == 2 and calls == [1, 2, 1, 2]


def test_the_count_stays_between_one_and_the_ceiling():
    machine = Machine()
    machine.cpus = 8
    threads, calls = governor(machine, ceiling=4)
    assert [threads.wanted(o) for o in (0.0, 0.2, 0.3, 3.5, 4.0, 7.9, 12.0)] == [4, 4, 4, 4, 4, 1, 1]
    one, calls = governor(machine, ceiling=1)
    machine.others = 7.0
    machine.run(1.0)
    assert one.adjust() == 1 and calls == []


def test_a_real_busy_process_is_seen():
    """psutil's CPU times: a process spinning on one core while this one sleeps reads as about one
    core used by others."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        threads = CpuThreads(ceiling=2, interval_s=0.4, get_threads=lambda: 2, set_threads=lambda n: None)
        time.sleep(1.0)
        threads.adjust()
    finally:
        spin.kill()
        spin.wait()
    assert 0.7 <= threads.others <= (os.cpu_count() or 1)
    if (os.cpu_count() or 1) <= 2:
        assert threads.threads == 1


def test_a_session_sets_the_count_before_every_forward_pass():
    """The count the governor sets is torch's when each forward pass runs (a forward hook reads it)."""
    model = tiny_model("llama")
    machine = Machine()
    counts = []
    hook = model.register_forward_pre_hook(lambda module, args: counts.append(torch.get_num_threads()))

    class Busy(CpuThreads):
        def adjust(self):
            machine.run(1.0)  # each step, a second of a machine whose other core is taken
            return super().adjust()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads = Busy(ceiling=2, cpus=2, interval_s=0.5, sample=machine.sample, clock=lambda: machine.now)
        machine.others = 1.0
        la = LookaheadConfig(window=2, ngram=3, candidates=1)
        done = list(generate(Session(model, la, threads=threads), [1, 5, 9, 12, 7, 3],
                             SamplingConfig(max_new_tokens=12), frozenset()))[-1]
    finally:
        hook.remove()
        torch.set_num_threads(before)
    assert isinstance(done, Done)
    assert counts == [1] * (done.stats.steps + 1)  # the prompt's prefill, then every step, on one thread


def test_packed_and_int4_steps_give_the_same_bits_on_any_thread_count():
    """What lets the governor change the count mid-answer: a step's logits do not depend on it for
    packed (oneDNN) weights; MKL's dense fp32 products may, so a dense model keeps torch's count."""
    from ladechat.engine.model import packing
    from ladechat.engine.runner import DynamicRunner
    from ladechat.engine.step_cost import chain, prefill_random

    model = tiny_model("llama")
    if not packing.supported(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN packing runs on x86-64 only; elsewhere models keep torch's count (next test)")
    packing.pack(model)
    before = torch.get_num_threads()
    logits = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            runner = DynamicRunner(model)
            prefill_random(runner, 40)
            logits[count] = []
            for size in (1, 6):  # a plain step and a lookahead step's worth of rows
                logits[count].append(runner.step(chain(size), 40).clone())
                runner.truncate(40)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(logits[1], logits[2]))


def test_only_models_whose_steps_do_not_depend_on_the_count_get_a_governor():
    from ladechat.engine.model.loading import LoadSpec, load

    dense = load(LoadSpec(dtype="float32", device="cpu", weights="dense"))
    assert dense.threads is None
    default = load(LoadSpec(dtype="float32", device="cpu"))
    assert isinstance(default.threads, CpuThreads) and "dense" not in default.weights


def test_the_step_cost_curves_are_kept_for_the_full_thread_count(tmp_path, monkeypatch):
    """The curves are kept per thread count: a busy spell's count must not make a chat measure
    them again (minutes) under another key; measured in a busy spell, they run at its count."""
    from ladechat.engine import step_cost
    from ladechat.engine.model.loading import LoadedModel

    model = tiny_model("llama")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    counts = []
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: counts.append(torch.get_num_threads()) or {1: 1.0, 2: 1.5})
    before = torch.get_num_threads()
    try:
        machine = Machine()
        busy = LoadedModel(model, None, "tiny", torch.device("cpu"), torch.float32, frozenset(), 512,
                           threads=CpuThreads(ceiling=2, cpus=2, sample=machine.sample, clock=lambda: machine.now))
        machine.others = 1.0
        machine.run(5.0)  # loading, while another process keeps a core busy
        first = busy.cost_model()
        assert counts == [1, 1]  # both cache lengths measured, at the count the load allows
        quiet_machine = Machine()
        quiet = LoadedModel(model, None, "tiny", torch.device("cpu"), torch.float32, frozenset(), 512,
                            threads=CpuThreads(ceiling=2, cpus=2, sample=quiet_machine.sample,
                                               clock=lambda: quiet_machine.now))
        again = quiet.cost_model()
    finally:
        torch.set_num_threads(before)
    assert counts == [1, 1]  # read back under the full count's key: not measured again
    assert first.measured == again.measured


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: torch runs no OpenMP team to hand over")
def test_a_server_frees_the_openmp_team_of_the_thread_that_loaded_the_model():
    """serve's Worker (the model thread's owner) frees its constructing thread's OpenMP team: with
    two teams alive on a 2-core machine libgomp sleeps at every barrier and the model thread's steps
    take twice as long (engine/threads.py: release_openmp_team; BENCHMARKS.md). In a fresh process:
    a parallel op gives the main thread its team; the Worker lets its threads go; the model thread
    then runs parallel ops on a team of its own."""
    script = (
        "import os, torch\n"
        "from ladechat.serve.worker import Worker\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "torch.set_num_threads(2)\n"
        "x = torch.randn(1 << 20)\n"
        "for _ in range(20): (x * 2).sum()\n"
        "loaded = threads()\n"
        "worker = Worker(backend=None, max_queue=1)\n"
        "released = threads()\n"
        "on_model_thread = worker.executor.submit(lambda: [float((x * 2).sum()) for _ in range(20)]).result()\n"
        "print(loaded, released, threads(), len(on_model_thread))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    loaded, released, serving, ran = map(int, done.stdout.split())
    # the main thread's team (one thread besides it) is gone; the model thread brings its own and itself
    assert released == loaded - 1 and serving == released + 2 and ran == 20
