#!/usr/bin/env python3
"""A randomly initialised model of a real shape (Llama-2-7B on the GPU) decoding as ladechat and
transformers would, one phase per process, for the staged GPU run (issue #43). Prints one JSON
object: what the phase measured, with the seconds its compile took and how many compiled graphs
torch ran without CUDA graphs (cudagraph_skips; 0 means every step replays a CUDA graph).

    python3 scripts/gpu/shape_phases.py PHASE [--shape llama-2-7b] [--device cuda] [--dtype float16]
        [--compile] [--prompt-tokens 512] [--max-new-tokens 128] [--sizes 1,120,186] [--reps 10]

Phases:
  plain      ladechat's Session with lookahead off (one-row steps), after a random prompt: ms a token
  lookahead  the same with the shipped GPU lookahead settings (defaults.gpu_lookahead): ms a step,
             split by host timers into planning, the forward, top-k, verification, learning and the
             commit (the forward is followed by a device sync in this phase only, so that its time
             is the GPU's and not the top-k's wait); tokens a step are those of random weights
  steps      the fixed-shape step alone (bench.steps' timing) at each of --sizes rows; the shipped
             GPU step's size takes its own settings, other sizes a window of size/4 columns
  hf-static  transformers' generate on one static cache, compiled as transformers does it
             (bench/hf_static.py): ms a token, the prompt's forward subtracted

Random weights decode noise: their speed is real, their acceptance is not (lookahead's tokens a
step on a real model come from the embedded model's bench). All phases of one shape share the
cache length (the static cache's first length), so their compiled graphs are the same shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

PHASES = ("plain", "lookahead", "steps", "hf-static")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_state() -> dict:
    from torch._dynamo.utils import counters

    from ladechat.bench.hf_static import graphs_compiled

    return {"cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]), "graphs_compiled": graphs_compiled()}


def random_prompt(vocab: int, tokens: int) -> list[int]:
    return torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


class HostTimers:
    """Seconds spent in each part of Session.step, summed over the steps: the session's own
    methods and the decode module's functions wrapped with timers (this script's instrument only)."""

    PARTS = ("window", "plan", "forward", "top_k", "verify", "learn", "commit")
    # the forward's own split: its call returning (host: inputs, launches, replay) and the wait
    # for the device after it; and the device's time between events recorded around the call
    FORWARD = ("forward_call", "forward_wait", "forward_gpu")

    def __init__(self, session, device: torch.device) -> None:
        from ladechat.engine import decode
        from ladechat.engine.draft.window import JacobiWindow

        self.device = device
        self.reset()
        JacobiWindow.fill = self.timed("window", JacobiWindow.fill)  # the class's: a reset makes a new window
        session.plan = self.timed("plan", session.plan)
        session.runner.step = self.forward(session.runner.step)
        self.last_layout = None
        session._learn = self.timed("learn", session._learn)
        session._commit = self.timed("commit", session._commit)
        decode.top_k = self.timed("top_k", decode.top_k)
        decode.verify = self.timed("verify", decode.verify)

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - start
            return out

        return wrapper

    def forward(self, step):
        gpu = self.device.type == "cuda"

        def wrapper(layout, past):
            self.last_layout = layout
            if gpu:
                began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                began.record()
            start = time.perf_counter()
            out = step(layout, past)
            called = time.perf_counter()
            if gpu:
                ended.record()
            sync(self.device)
            waited = time.perf_counter()
            self.seconds["forward"] += waited - start
            self.seconds["forward_call"] += called - start
            self.seconds["forward_wait"] += waited - called
            if gpu:
                self.seconds["forward_gpu"] += began.elapsed_time(ended) / 1000
            return out

        return wrapper

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS + self.FORWARD, 0.0)


def decode_phase(model, args, lookahead: bool) -> dict:
    from ladechat.bench.prompts import method_config
    from ladechat.engine.config import SamplingConfig
    from ladechat.engine.decode import Session, generate
    from ladechat.engine.defaults import gpu_lookahead
    from ladechat.engine.events import Done
    from ladechat.engine.runner import CompiledForward, StaticRunner, max_step_size

    la = method_config("lookahead" if lookahead else "plain", gpu_lookahead(None))
    context = model.config.max_position_embeddings
    runner = StaticRunner(model, la, context, compiled=CompiledForward(model) if args.compile else None)
    session = Session(model, la, None, runner=runner)
    prompt = random_prompt(model.config.vocab_size, args.prompt_tokens)
    session.reserve(len(prompt) + args.max_new_tokens)
    start = time.perf_counter()
    session.warm_up()  # compiles the step's one shape, as the chat does before its first answer
    compile_s = time.perf_counter() - start
    timers = HostTimers(session, model.device) if lookahead else None

    def answer(new_tokens: int):
        session.reset()
        sampling = SamplingConfig(max_new_tokens=new_tokens)
        return next(e for e in generate(session, prompt, sampling, frozenset()) if isinstance(e, Done)).stats

    answer(16)  # the first replays of a captured graph, the eager prefill's kernels
    if timers:
        timers.reset()
    stats = answer(args.max_new_tokens)
    result = {"phase": "lookahead" if lookahead else "plain", "rows_a_step": runner.shape,
              "full_step_rows": max_step_size(la), "compile_s": round(compile_s, 2),
              "prompt_tokens": len(prompt), "new_tokens": stats.new_tokens, "steps": stats.steps,
              "prefill_ms": round(1000 * stats.prefill_s, 2),
              "ms_per_token": round(1000 * stats.decode_s / stats.new_tokens, 3),
              "ms_per_step": round(1000 * stats.decode_s / stats.steps, 3),
              "tokens_per_step_random_weights": round(stats.new_tokens / stats.steps, 3),
              "settings": {"window": la.window, "ngram": la.ngram, "candidates": la.candidates,
                           "context_candidates": la.context_candidates, "context_len": la.context_len,
                           "recycle": la.recycle, "enabled": la.enabled}}
    if timers:
        parts = {part: round(1000 * timers.seconds[part] / stats.steps, 3) for part in timers.PARTS}
        step_ms = 1000 * stats.decode_s / stats.steps
        parts["other"] = round(step_ms - sum(parts.values()), 3)
        result["ms_per_step_by_part"] = parts
        result["forward_split_ms"] = {part: round(1000 * timers.seconds[part] / stats.steps, 3)
                                      for part in timers.FORWARD}
        result["host_share"] = round(1 - parts["forward"] / step_ms, 3)
        # the answer's last layout again, alone, as bench.steps times a step (top-k included)
        from ladechat.engine.step_cost import time_step

        past = len(session.cached)
        alone = [time_step(runner, timers.last_layout, past) for _ in range(12)][2:]
        result["last_layout_alone_ms"] = round(1000 * statistics.median(alone), 3)
    return result


def steps_phase(model, args) -> dict:
    from ladechat.bench.steps import fixed_config
    from ladechat.engine.defaults import gpu_lookahead
    from ladechat.engine.layout import build_layout
    from ladechat.engine.runner import CompiledForward, StaticRunner, max_step_size
    from ladechat.engine.step_cost import prefill_random, time_step

    shipped = gpu_lookahead(None)
    configs = {size: shipped if size == max_step_size(shipped) else fixed_config(size) for size in args.sizes}
    for size, la in configs.items():
        if (max_step_size(la) if la.enabled else 1) != size:
            raise SystemExit(f"--sizes: no settings give a step of exactly {size} rows "
                             f"(1, multiples of 4, or the shipped GPU step's {max_step_size(shipped)})")
    context = model.config.max_position_embeddings
    runner = StaticRunner(model, configs[max(args.sizes)], context,
                          compiled=CompiledForward(model) if args.compile else None)
    prefill_random(runner, args.prompt_tokens)
    ms, compile_s = {}, {}
    for size in args.sizes:
        runner.configure(configs[size])
        layout = build_layout([[1 + row % (model.config.vocab_size - 1) for row in range(size)]], [])  # one chain
        start = time.perf_counter()
        warm = [time_step(runner, layout, args.prompt_tokens) for _ in range(3)]  # compile, capture, replay
        compile_s[str(size)] = round(time.perf_counter() - start - warm[-1], 2)
        times = [time_step(runner, layout, args.prompt_tokens) for _ in range(args.reps)]
        ms[str(size)] = round(1000 * statistics.median(times), 3)
    return {"phase": "steps", "context": args.prompt_tokens, "reps": args.reps, "ms_per_step": ms,
            "compile_s": compile_s, "cache_length": runner.length}


def hf_static_phase(model, args) -> dict:
    from ladechat.bench.hf_static import StaticGenerate, cache_length

    prompt = random_prompt(model.config.vocab_size, args.prompt_tokens)
    length = cache_length(len(prompt), 1, args.max_new_tokens, model.config.max_position_embeddings)
    generator = StaticGenerate(model, length, args.compile)
    fixed = {"do_sample": False, "min_new_tokens": args.max_new_tokens}  # random weights: no end of text
    start = time.perf_counter()
    generator.answer(prompt, {**fixed, "min_new_tokens": 8}, 8, [])  # compiles the decoding step
    compile_s = time.perf_counter() - start
    generator.answer(prompt, {**fixed, "min_new_tokens": 16}, 16, [])  # CUDA graphs record after a warm-up run
    totals = []
    for _ in range(3):
        answer, seconds = generator.answer(prompt, fixed, args.max_new_tokens, [])
        totals.append(seconds)
    ids = torch.tensor([prompt], device=model.device)
    prefills = []
    for _ in range(3):  # the prompt's forward, which generate runs eagerly before its decoding steps
        sync(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)
        sync(model.device)
        prefills.append(time.perf_counter() - start)
    total, prefill = statistics.median(totals), statistics.median(prefills)
    return {"phase": "hf-static", "new_tokens": len(answer), "compile_s": round(compile_s, 2),
            "seconds_median_of_3": round(total, 4), "prefill_ms": round(1000 * prefill, 2),
            "ms_per_token": round(1000 * (total - prefill) / len(answer), 3), **generator.report()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--shape", default="llama-2-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="1,120,186")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    from ladechat.bench.steps import random_model
    from ladechat.engine.load.placement import resolve_device, resolve_dtype

    began = time.perf_counter()
    device = resolve_device(args.device)
    # the model's own Linear modules: compiled steps and transformers' generate run on those
    model = random_model(args.shape, resolve_dtype(args.dtype, device), device, pack_weights=False)
    build_s = time.perf_counter() - began
    result = {"steps": steps_phase, "hf-static": hf_static_phase}.get(args.phase)
    measured = result(model, args) if result else decode_phase(model, args, args.phase == "lookahead")
    print(json.dumps({"shape": args.shape, "device": str(device), "dtype": args.dtype, "compiled": args.compile,
                      "build_s": round(build_s, 2), **measured, **compiled_state(),
                      "phase_s": round(time.perf_counter() - began, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
