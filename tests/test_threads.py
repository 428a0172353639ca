"""The CPU steps' thread count follows the machine's other load (engine/threads.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from tiny_models import tiny_model

from ladechat.engine import cost_envelope
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
        def adjust(self, rows=None):
            machine.run(1.0)  # each step, a second of a machine whose other core is taken
            return super().adjust(rows)

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


def test_the_counts_probed_are_powers_of_two_and_the_ceiling():
    from ladechat.engine.thread_probe import candidate_counts

    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [1, 2]
    assert candidate_counts(6) == [1, 2, 4, 6]
    assert candidate_counts(16) == [1, 2, 4, 8, 16]


def _outputs(*rows):
    return [torch.tensor(row) for row in rows]


@pytest.mark.parametrize("cpu, outputs, agreeing", [
    # the AMD AVX-512 class with packed fp32: one thread sums in another order than two
    ("2 cores, 1 differs", {1: _outputs([1.0, 2.0000002]), 2: _outputs([1.0, 2.0])}, (2,)),
    # the Intel Xeon and AVX2 classes with packed fp32, and the 4-bit kernels on each class seen
    ("2 cores, all agree", {1: _outputs([1.0, 2.0]), 2: _outputs([1.0, 2.0])}, (1, 2)),
    ("8 cores, 2 and 4 differ", {1: _outputs([3.0]), 2: _outputs([3.5]), 4: _outputs([2.5]), 8: _outputs([3.0])},
     (1, 8)),
    ("a NaN where the full count has one too", {1: _outputs([float("nan"), 1.0]), 2: _outputs([float("nan"), 1.0])},
     (1, 2)),
    ("a NaN where the full count has a number", {1: _outputs([float("nan"), 1.0]), 2: _outputs([0.0, 1.0])}, (2,)),
    ("another shape", {1: _outputs([1.0]), 2: _outputs([1.0, 0.0])}, (2,)),
])
def test_only_counts_that_give_the_full_counts_bits_are_allowed(cpu, outputs, agreeing):
    """The decision from given facts, as each CPU class gives them: a count is allowed when every
    step's logits equal the full count's bit for bit."""
    from ladechat.engine.thread_probe import agreeing_counts

    assert agreeing_counts(outputs, max(outputs)) == agreeing


def test_the_governor_sets_only_allowed_counts():
    machine = Machine()
    machine.cpus = 8
    threads, calls = governor(machine, ceiling=8)
    threads.restrict((1, 8))
    assert [threads.wanted(o) for o in (0.0, 1.0, 4.0, 7.5)] == [8, 1, 1, 1]  # 7 or 4 free: no allowed count fits
    threads.restrict((1, 4, 8))
    assert [threads.wanted(o) for o in (0.0, 1.0, 4.0, 7.5)] == [8, 4, 4, 1]
    with pytest.raises(ValueError, match="must include the ceiling"):
        threads.restrict((1, 2))


def test_a_step_wider_than_the_probes_widest_runs_on_the_ceiling():
    """The probe checks steps up to its widest (thread_probe.py): a wider step gets the full count,
    whatever the load, and the next narrow one the governed count again."""
    machine = Machine()
    threads, calls = governor(machine)
    threads.restrict((1, 2), widest=12)
    machine.others = 1.0
    machine.run(1.0)
    assert threads.adjust(8) == 1 and calls == [1]
    assert threads.adjust(16) == 2 and calls == [1, 2]
    assert threads.adjust(12) == 1 and calls == [1, 2, 1]
    assert threads.adjust() == 1 and calls == [1, 2, 1]  # a prefill: as governed


def test_a_model_gets_a_governor_only_where_the_probe_allows_fewer_threads():
    """load()'s decision from the probe's verdict, whatever this CPU's: none when only the full
    count agrees, one restricted to the agreeing counts otherwise; none for dense weights (unprobed),
    for one thread, or without a probe."""
    from ladechat.engine import thread_probe
    from ladechat.engine.load import packing
    from ladechat.engine.load.governor import governed as governor_of

    model = tiny_model("llama")
    packing.pack(model)
    asked = []
    for verdict, governed in ((thread_probe.Verdict((2,), 64), False), (thread_probe.Verdict((1, 2), 12), True)):
        def probe(*a, v=verdict):
            return asked.append(a) or v

        threads = governor_of(CpuThreads(ceiling=2, cpus=2), model, "tiny", "tiny", None, None, probe)
        assert (threads is not None) == governed and (not governed or (threads.counts, threads.widest) == ((1, 2), 12))
    assert [a[1:] for a in asked] == [(None, 2, None)] * 2  # no files to name: probed each time, not kept
    assert governor_of(CpuThreads(ceiling=2, cpus=2), tiny_model("llama"), "tiny", "tiny", None, None, probe) is None
    assert governor_of(CpuThreads(ceiling=1, cpus=1), model, "tiny", "tiny", None, None, probe) is None
    assert governor_of(CpuThreads(ceiling=2, cpus=2), model, "tiny", "tiny", None, None, None) is None  # no probe
    assert len(asked) == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: there is no other thread count to probe")
def test_the_real_probe_on_this_machine_matches_the_steps_it_allows():
    """On whatever CPU runs the suite: the probe's verdict for packed fp32 weights is what the steps
    do (a count it allows gives the full count's logits on every step size; one it refuses gives
    other logits on some), and asking again gives the same verdict."""
    from ladechat.engine import thread_probe
    from ladechat.engine.load import packing

    model = tiny_model("llama")
    if not packing.supported(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN packing runs on x86-64 only; elsewhere models keep torch's count")
    packing.pack(model)
    steps = thread_probe.model_steps(model)
    ceiling = torch.get_num_threads()
    verdict = thread_probe.probe(steps, ceiling)
    assert thread_probe.probe(steps, ceiling).counts == verdict.counts and ceiling in verdict.counts
    sizes = thread_probe.STEP_SIZES  # every size, the widest too
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(ceiling)
        ran, full = steps(sizes)
        torch.set_num_threads(1)
        one = steps(sizes)[1]
    finally:
        torch.set_num_threads(before)
    agree = [torch.equal(a, b) for a, b in zip(one, full)]
    assert ran == sizes and (1 in verdict.counts) == all(agree[: sizes.index(verdict.widest) + 1])


@pytest.fixture(scope="module")
def embedded_default():
    from ladechat.engine import thread_probe
    from ladechat.engine.load.loading import LoadSpec, load

    return load(LoadSpec(dtype="float32", device="cpu"), probe=thread_probe.cached_verdict)


def test_a_loaded_model_gets_the_governor_its_probe_allows(embedded_default):
    """Dense weights never get one; the default load's (kept per model and CPU) is what its probe says."""
    from ladechat.engine import thread_probe
    from ladechat.engine.load.loading import LoadSpec, load

    dense = load(LoadSpec(dtype="float32", device="cpu", weights="dense"), probe=thread_probe.cached_verdict)
    assert dense.threads is None
    assert "dense" not in embedded_default.weights
    if len(os.sched_getaffinity(0)) < 2:
        assert embedded_default.threads is None
        return
    ceiling = torch.get_num_threads()
    verdict = thread_probe.probe(thread_probe.model_steps(embedded_default.model), ceiling)
    assert (embedded_default.threads.counts if embedded_default.threads else (ceiling,)) == verdict.counts


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: there is no other thread count to probe")
def test_a_lookahead_answer_under_a_changing_count_is_plain_decodings(embedded_default):
    """The product property on this CPU, with the default load: where the load gave the model a
    governor, a greedy lookahead answer whose thread count changes at every step (among the counts
    it allows) is plain decoding's on the full count, token for token."""
    from ladechat import templates
    from ladechat.engine import thread_probe

    loaded = embedded_default
    if loaded.threads is None:  # this CPU's probe allowed the full count alone: nothing changes the count
        assert thread_probe.probe(thread_probe.model_steps(loaded.model), torch.get_num_threads()).counts == (
            torch.get_num_threads(),)
        return
    counts = loaded.threads.counts
    assert len(counts) > 1 and counts[-1] == loaded.threads.ceiling

    class EveryStep(CpuThreads):
        """Another allowed count at each step, as a machine whose load comes and goes would give."""

        def adjust(self, rows=None):
            if rows is not None and rows > loaded.threads.widest:  # as CpuThreads: wider steps on the ceiling
                torch.set_num_threads(self.ceiling)
                return self.ceiling
            self.threads = counts[(counts.index(self.threads) + 1) % len(counts)]
            torch.set_num_threads(self.threads)
            return self.threads

    prompt = templates.encode(loaded.tokenizer, [{"role": "user", "content": "Name three colours and a fruit."}], None)
    sampling = SamplingConfig(max_new_tokens=48)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(loaded.threads.ceiling)
        plain = list(generate(Session(loaded.model, LookaheadConfig(enabled=False)), prompt, sampling,
                              loaded.eos_ids))[-1]
        changing = EveryStep(ceiling=loaded.threads.ceiling, cpus=2, counts=counts)
        ahead = list(generate(Session(loaded.model, LookaheadConfig(), threads=changing), prompt, sampling,
                              loaded.eos_ids))[-1]
    finally:
        torch.set_num_threads(before)
    assert ahead.text_tokens == plain.text_tokens and len(plain.text_tokens) > 10


def test_the_step_cost_curves_are_kept_for_the_full_thread_count(tmp_path, monkeypatch):
    """The curves are kept per thread count: a busy spell's count must not make a chat measure
    them again (minutes) under another key; measured in a busy spell, they run at its count."""
    from ladechat.engine import step_cost
    from ladechat.engine.load.loading import LoadedModel

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
        first = cost_envelope.cost_model(busy)
        assert counts == [1, 1]  # both cache lengths measured, at the count the load allows
        quiet_machine = Machine()
        quiet = LoadedModel(model, None, "tiny", torch.device("cpu"), torch.float32, frozenset(), 512,
                            threads=CpuThreads(ceiling=2, cpus=2, sample=quiet_machine.sample,
                                               clock=lambda: quiet_machine.now))
        again = cost_envelope.cost_model(quiet)
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
