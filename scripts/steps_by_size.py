"""Where lookahead's time goes: for each prompt, plain and lookahead tok/s (the steps' own time,
prefill excluded), then per step size (tokens fed) the steps, tokens committed per step, ms per
step and of it ms in the forward pass (the rest: drafting, planning, verifying), and per draft
source the accepted nodes predicted against seen.

    python scripts/steps_by_size.py -d mtbench -d gsm8k -d humaneval --limit 5 [--max-new-tokens 128]
        [--model FILE] [--all-turns]

The defaults of the chat (weights auto, dtype auto, W/N/G, the measured step costs), no store.
First turns only unless --all-turns: then each item is a conversation, each later turn after
the earlier answers (plain's, which lookahead's equal).
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from dataclasses import replace

from ladechat import templates
from ladechat.bench.prompts import load_items
from ladechat.engine import cost_envelope
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Step
from ladechat.engine.load.loading import LoadSpec, load
from ladechat.settings import Settings


def answer(lm, cost, la, ids, max_new, sizes=None):
    """(token ids, seconds of its steps, calibration) of one greedy answer; steps tallied into
    `sizes` (steps, tokens, seconds, seconds in the forward pass)."""
    session = Session(lm.model, la, step_cost=cost, threads=lm.threads)
    forward = [0.0]
    step_of = session.runner.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        logits = step_of(*args, **kwargs)
        logits[:1, :1].tolist()  # on a GPU: wait for the step
        forward[0] = time.perf_counter() - start
        return logits

    session.runner.step = timed_step
    tokens, seconds = [], 0.0
    for event in generate(session, ids, SamplingConfig(max_new_tokens=max_new), lm.eos_ids):
        if isinstance(event, Step):
            tokens += event.tokens
            seconds += event.seconds
            if sizes is not None:
                tally = sizes[event.fed]
                tally[0] += 1
                tally[1] += len(event.tokens)
                tally[2] += event.seconds
                tally[3] += forward[0]
    return tokens, seconds, session.acceptance.since(({}, {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-d", "--dataset", action="append", required=True)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-m", "--model", default=None, help="a .gguf or Hugging Face model (default: the embedded one)")
    parser.add_argument("--all-turns", action="store_true", help="every turn of each item, as a conversation")
    args = parser.parse_args()
    lm = load(LoadSpec(model=args.model, weights="auto") if args.model else LoadSpec(weights="auto"))
    cost = cost_envelope.cost_model(lm)
    lookahead = replace(Settings().lookahead_config(), store=False)
    plain = LookaheadConfig(enabled=False, store=False)
    sizes: dict[int, list] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    calibration: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    ratios = []
    for name in args.dataset:
        for item in load_items(name, args.limit):
            messages = []
            for question in item["turns"] if args.all_turns else item["turns"][:1]:
                messages.append({"role": "user", "content": question})
                ids = templates.encode(lm.tokenizer, messages)
                p_tokens, p_seconds, _ = answer(lm, cost, plain, ids, args.max_new_tokens)
                l_tokens, l_seconds, calib = answer(lm, cost, lookahead, ids, args.max_new_tokens, sizes)
                for source, (predicted, seen) in calib.items():
                    calibration[source][0] += predicted
                    calibration[source][1] += seen
                ratios.append((len(l_tokens) / l_seconds) / (len(p_tokens) / p_seconds))
                print(f"{question[:40]!r:44} plain {len(p_tokens) / p_seconds:5.1f}  lookahead "
                      f"{len(l_tokens) / l_seconds:5.1f}  ratio {ratios[-1]:.2f}"
                      f"{'' if l_tokens == p_tokens else '  (NOT the same tokens)'}", flush=True)
                messages.append({"role": "assistant", "content": lm.tokenizer.decode(p_tokens, skip_special_tokens=True)})
    print(f"per-{'turn' if args.all_turns else 'item'} geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
          f"{sum(r < 1 for r in ratios)} of {len(ratios)} slower")
    print("| tokens fed | steps | tokens/step | ms/step | of it, the forward pass |\n| --- | --- | --- | --- | --- |")
    for fed in sorted(sizes):
        steps, tokens, seconds, forward = sizes[fed]
        print(f"| {fed} | {steps} | {tokens / steps:.2f} | {seconds / steps * 1000:.1f} | {forward / steps * 1000:.1f} |")
    for source, (predicted, seen) in sorted(calibration.items()):
        print(f"{source}: accepted nodes predicted {predicted:.1f}, seen {seen:.0f}")


if __name__ == "__main__":
    main()
