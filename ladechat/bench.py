"""`ladechat bench`: methods side by side on a JSONL prompt set (schema: ../shared/data/README.md).

Every item runs each method back to back (so machine noise hits them alike); multi-turn items
run as conversations, each method answering with its own previous answers in the context.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ladechat import templates
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done
from ladechat.engine.runner import StaticRunner

# lookahead-full: every step carries the whole window and all candidates (no sizing from the
# step-cost curve), as on a GPU; its compression is what a GPU run would see, on any machine.
METHODS = ("hf", "hf-lookup", "plain", "lookahead", "lookahead-full")
DATASETS = {"mtbench": "mtbench-dev.jsonl", "humaneval": "humaneval-dev.jsonl", "gsm8k": "gsm8k-dev.jsonl"}


class BenchError(ValueError):
    pass


def find_dataset(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if name in DATASETS:
        for folder in (Path("shared/data"), Path("../shared/data")):
            if (folder / DATASETS[name]).is_file():
                return folder / DATASETS[name]
        raise BenchError(f"dataset {name!r}: {DATASETS[name]} not found in ./shared/data or ../shared/data")
    raise BenchError(f"dataset {name!r} is neither a file nor one of {', '.join(DATASETS)}")


def load_items(name: str, limit: int | None) -> list[dict]:
    items = []
    with open(find_dataset(name), encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                items.append(json.loads(line))
    return items[:limit] if limit else items


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    identical: int = 0
    items: int = 0
    per_item: list = field(default_factory=list)  # (tokens, seconds) per item

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _hf_answer(model, ids: list[int], sampling: SamplingConfig, eos: list[int], lookup: bool
               ) -> tuple[list[int], float]:
    extra: dict = {"prompt_lookup_num_tokens": 10} if lookup else {}
    if not sampling.greedy:
        extra.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                     min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty)
    else:
        extra.update(do_sample=False, repetition_penalty=sampling.repetition_penalty)
    start = time.perf_counter()
    with torch.inference_mode():
        ids_t = torch.tensor([ids], device=model.device)
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=sampling.max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **extra)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run_item(loaded, item: dict, method: str, la: LookaheadConfig, sampling: SamplingConfig,
             template: str | None, step_cost: dict[int, float] | None = None, runner=None):
    """Answer every turn of `item` with `method`. Returns (all answer ids, seconds, steps).
    runner: a fixed-shape runner to reuse (its compiled graphs) instead of the default one."""
    tok = loaded.tokenizer
    eos = sorted(loaded.eos_ids)
    messages: list[dict] = []
    answers: list[int] = []
    seconds = 0.0
    steps = 0
    session = Session(loaded.model, LookaheadConfig(**{**la.__dict__, "enabled": method.startswith("lookahead")}),
                      None if method == "lookahead-full" else step_cost, runner=runner)
    for turn in item["turns"]:
        messages.append({"role": "user", "content": turn})
        ids = templates.encode(tok, messages, template)
        if method in ("hf", "hf-lookup"):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            answer, took = _hf_answer(loaded.model, ids, sampling, eos, method == "hf-lookup")
            steps = None  # HF does not report its forward passes
        else:
            start = time.perf_counter()
            done = None
            for event in generate(session, ids, sampling, loaded.eos_ids):
                if isinstance(event, Done):
                    done = event
            took = time.perf_counter() - start
            answer = list(done.text_tokens)
            steps += done.stats.steps
        seconds += took
        answers += answer
        messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    return answers, seconds, steps


def run(loaded, datasets: list[str], methods: list[str], la: LookaheadConfig, sampling: SamplingConfig,
        limit: int | None, template: str | None = None, progress=None, compile: bool = False) -> dict:
    """Greedy runs also report whether each method's answers equal HF greedy's, token for token;
    sampled runs (temperature > 0) cannot, and report speed and compression only. compile: ladechat's
    methods run fixed-shape compiled steps (one runner per method, compiled once)."""
    for m in methods:
        if m not in METHODS:
            raise BenchError(f"unknown method {m!r} (choose from {', '.join(METHODS)})")
    results: dict = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."),
                     "device": str(loaded.device), "max_new_tokens": sampling.max_new_tokens,
                     "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                     "W": la.window, "N": la.ngram, "G": la.candidates, "datasets": {}}
    results["compiled"] = compile
    step_cost = loaded.cost_model()
    runners = {m: StaticRunner(loaded.model, la, loaded.context_length, compile=True) if compile else None
               for m in methods if m in ("plain", "lookahead", "lookahead-full")}
    # warm-up: first calls allocate and pick kernels (and compile)
    warm = {"turns": ["Hello"]}
    for m in methods:
        run_item(loaded, warm, m, la, SamplingConfig(max_new_tokens=8), template, step_cost, runners.get(m))
    for name in datasets:
        items = load_items(name, limit)
        tallies = {m: Tally() for m in methods}
        for i, item in enumerate(items):
            reference = None
            for m in methods:
                answer, seconds, steps = run_item(loaded, item, m, la, sampling, template, step_cost, runners.get(m))
                if m == "hf":
                    reference = answer
                t = tallies[m]
                t.tokens += len(answer)
                t.seconds += seconds
                t.steps += steps or 0
                t.items += 1
                t.identical += int(sampling.greedy and reference is not None and answer == reference)
                t.per_item.append((len(answer), seconds))
            if progress:
                progress(name, i + 1, len(items))
        results["datasets"][name] = {m: _summary(t, tallies.get("hf")) for m, t in tallies.items()}
    total = {m: Tally() for m in methods}
    for name in datasets:
        for m in methods:
            d = results["datasets"][name][m]
            total[m].tokens += d["tokens"]
            total[m].seconds += d["seconds"]
            total[m].steps += d["steps"]
            total[m].items += d["items"]
            total[m].identical += d["identical_items"]
    results["overall"] = {m: _summary(t, total.get("hf")) for m, t in total.items()}
    return results


def _summary(t: Tally, hf: Tally | None) -> dict:
    base = hf.tokens_per_s() if hf else 0.0
    return {"tokens": t.tokens, "seconds": round(t.seconds, 3), "steps": t.steps, "items": t.items,
            "tokens_per_s": round(t.tokens_per_s(), 2),
            "speedup_vs_hf": round(t.tokens_per_s() / base, 3) if base else None,
            "compression": round(t.tokens / t.steps, 3) if t.steps else None,
            "identical_items": t.identical}
