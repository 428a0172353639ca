"""Step cost of the embedded model on each weight layout ladechat can load on a CPU: dense (the
Linear weights as transformers loads them), packed for oneDNN (engine/load/packing.py) and the GGUF's
4-bit blocks as int4 (engine/kernels/int4.py, the rest packed). Behind the table in BENCHMARKS.md.

    python scripts/int4_step.py [--dtype float32] [--cached 192] [--rounds 15] [--sizes 1,2,4,8,16]
    python scripts/int4_step.py --profile int4 [--rows 1]   # where one step's time goes
    python scripts/int4_step.py --answers [--layouts packed,int4] [--max-new-tokens 128] [--rounds 3]
    python scripts/int4_step.py --memory [--layouts dense,packed,int4]   # peak RSS of a chat

Prints, per layout and rows, the median milliseconds of a step (building its inputs, the forward
pass, the rows' top-k back on the host, as a decoding step does) after --cached tokens, with the
10th and 90th percentiles: the noise of a machine others use too. Layouts and sizes take turns
step by step, so a busy spell hits all of them alike.

--answers: greedy answers to the prompts below (this script's own, not the bench's sets), as
`ladechat ask` gives them (a Bot with the CPU defaults, no store of past answers), plain and with
lookahead, on each layout: tokens/s (median over rounds, answers taking turns), how many
lookahead answers equal plain decoding's on the same layout, where the first one that differs
parts, and how far plain's logits were from a tie there.

--memory: the peak resident memory (the kernel's maxrss of the process) of `ladechat` chatting
with the embedded model, two questions piped in, once per layout (--weights), as a user runs it,
with the model loaded in that process (LADECHAT_KEEP_ALIVE=0: no warm server holds it).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.engine.runner import DynamicRunner
from ladechat.engine.step_cost import chain, prefill_random, time_step

LAYOUTS = ("dense", "packed", "int4")
PROMPTS = ["Write a haiku about autumn leaves.", "How do I reverse a list in Python?",
           "Explain what a prime number is to a child.", "List three uses of a paperclip.",
           "What causes the seasons on Earth?", "Give me a short recipe for pancakes.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Summarise the plot of Romeo and Juliet in three sentences.",
           "What are the differences between a list and a tuple in Python?",
           "Tell me a short story about a robot who learns to paint."]


def prefilled(model, cached: int) -> DynamicRunner:
    runner = DynamicRunner(model)
    prefill_random(runner, cached)
    return runner


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(args) -> None:
    models = {name: load(LoadSpec(dtype=args.dtype, device="cpu", weights=name, own_forward=False)).model for name in LAYOUTS}
    for name, model in models.items():
        print(f"{name}: {quantized.weight_layout(model)}", flush=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    layouts = {size: chain(size) for size in sizes}
    runners = {name: prefilled(model, args.cached) for name, model in models.items()}
    times: dict[tuple[str, int], list[float]] = {(name, size): [] for name in models for size in sizes}
    for round_ in range(args.rounds + 2):
        for size in sizes:
            for name, runner in runners.items():
                seconds = time_step(runner, layouts[size], args.cached)
                if round_ >= 2:  # two warm-up rounds
                    times[name, size].append(seconds)
    print(f"\nms per step after {args.cached} cached tokens, median (p10-p90) of {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, {args.dtype}\n")
    print("| layout | " + " | ".join(str(s) for s in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for name in models:
        cells = [f"{statistics.median(t) * 1e3:.1f} ({percentile(t, .1) * 1e3:.0f}-{percentile(t, .9) * 1e3:.0f})"
                 for t in (times[name, size] for size in sizes)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    model = load(LoadSpec(dtype=args.dtype, device="cpu", weights=args.profile, own_forward=False)).model
    runner = prefilled(model, args.cached)
    layout = chain(args.rows)
    for _ in range(5):
        time_step(runner, layout, args.cached)
    with run_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.rounds):
            time_step(runner, layout, args.cached)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def margin(lm, ids: list[int], ours: int, theirs: int) -> float:
    """How much plain decoding preferred its token over the one lookahead chose, by its logits."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return float(logits[ours] - logits[theirs])


def answers(args) -> None:
    from ladechat.backends.local import Bot
    from ladechat.conversation import Conversation
    from ladechat.engine.defaults import default_lookahead
    from ladechat.engine.events import Done
    from ladechat.settings import Settings

    layouts = args.layouts.split(",")
    for layout in layouts:
        lm = load(LoadSpec(dtype=args.dtype, device="cpu", weights=layout))
        print(f"\n{layout}: {lm.weights or 'as loaded'}", flush=True)
        base = Settings.for_lookahead(default_lookahead("cpu"), temperature=0.0)
        bots = {mode: Bot(lm, base.updated({"lookahead": mode == "lookahead", "store": False,
                                            "max_new_tokens": args.max_new_tokens}))
                for mode in ("plain", "lookahead")}
        speeds: dict[str, list[list[float]]] = {mode: [[] for _ in PROMPTS] for mode in bots}
        tokens: dict[str, list[list[int]]] = {mode: [[] for _ in PROMPTS] for mode in bots}
        compression = []
        for _ in range(args.rounds):
            for i, text in enumerate(PROMPTS):
                for mode, bot in bots.items():
                    bot.session.reset()  # each answer on its own: no cache or pool from the last one
                    done = next(e for e in bot.reply(Conversation(messages=[{"role": "user", "content": text}]))
                            if isinstance(e, Done))
                    speeds[mode][i].append(done.stats.tokens_per_s)
                    tokens[mode][i] = list(done.text_tokens)
                    if mode == "lookahead":
                        compression.append(done.stats.compression)
        same, parts = 0, []
        for i, text in enumerate(PROMPTS):
            plain, ahead = tokens["plain"][i], tokens["lookahead"][i]
            if plain == ahead:
                same += 1
                continue
            at = next(k for k in range(min(len(plain), len(ahead))) if plain[k] != ahead[k])
            ids = bots["plain"].prompt_ids(Conversation(messages=[{"role": "user", "content": text}]))[0]
            parts.append(f"prompt {i} at token {at} (margin {margin(lm, ids + plain[:at], plain[at], ahead[at]):.3f})")
        medians = {mode: [statistics.median(s) for s in speeds[mode]] for mode in bots}
        total = {mode: statistics.mean(medians[mode]) for mode in bots}
        ratios = [a / p for a, p in zip(medians["lookahead"], medians["plain"])]
        geomean = statistics.geometric_mean(ratios)
        print(f"tok/s per prompt, median of {args.rounds} rounds: plain " + " ".join(f"{v:.1f}" for v in medians["plain"]))
        print("                                  lookahead " + " ".join(f"{v:.1f}" for v in medians["lookahead"]))
        print(f"mean tok/s: plain {total['plain']:.1f}, lookahead {total['lookahead']:.1f}; lookahead/plain per prompt "
              f"geomean {geomean:.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x); "
              f"tokens/step {statistics.mean(compression):.2f}")
        print(f"lookahead identical to plain: {same}/{len(PROMPTS)}" + ("; parted: " + "; ".join(parts) if parts else ""),
              flush=True)
        del bots, lm


def memory(args) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("ladechat")
    questions = "What is the capital of France?\nName three colours.\n"
    for layout in args.layouts.split(","):
        for round_ in range(args.rounds):
            child = subprocess.Popen([str(exe), "--weights", layout, "--max-new-tokens", "64", "--no-store"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "NO_COLOR": "1", "LADECHAT_KEEP_ALIVE": "0"})
            child.stdin.write(questions.encode())
            child.stdin.close()
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            print(f"{layout}: peak RSS {usage.ru_maxrss / 1024:.0f} MiB (exit {child.returncode}, round {round_ + 1})",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cached", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--profile", choices=LAYOUTS, help="profile one layout's steps instead")
    parser.add_argument("--rows", type=int, default=1, help="with --profile: rows per step")
    parser.add_argument("--answers", action="store_true", help="answers' tok/s and agreement instead")
    parser.add_argument("--memory", action="store_true", help="a chat's peak RSS per layout instead")
    parser.add_argument("--layouts", default="packed,int4", help="with --answers")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="with --answers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.answers or args.memory:
        args.rounds = args.rounds if args.rounds != 15 else (3 if args.answers else 1)
        answers(args) if args.answers else memory(args)
    else:
        profile(args) if args.profile else table(args)


if __name__ == "__main__":
    main()
