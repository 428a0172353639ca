"""Lookahead over plain decoding as a function of what an extra row of a step costs, modelled: the
cost-sized planner (CPU defaults) is run against a made-up step-cost curve, a one-row step costing
1 and each extra row c of it, and a run's time is the sum of its steps' costs (planning itself is
free here). In fp32 the answers are the same tokens whatever the steps, so the figures are exact
for the planner and the drafts, whatever the machine's speed. Behind BENCHMARKS.md's table "How
cheap a row must be" (the embedded model, 8 two-turn conversations written for the run).

    python scripts/row_cost_frontier.py ITEMS.jsonl [--first-turns] [--costs 0.15,0.1,0.05,0.02]
        [--model FILE] [--limit N] [--max-new-tokens N]

ITEMS.jsonl: one {"turns": [...]} a line, as `ladechat bench -d FILE` takes. Prints per c: tokens
a step, rows a step, and per-item lookahead / plain (geometric mean and the slowest item).
"""

from __future__ import annotations

import argparse
import json
import math

from ladechat import templates
from ladechat.bench.prompts import method_config
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done, Step
from ladechat.engine.load.loading import LoadSpec, load


class LinearCost:
    """A step of `size` rows costs 1 + c (size - 1), whatever the cache holds."""

    def __init__(self, c: float) -> None:
        self.c = c

    def cost(self, size: int, cached: int) -> float:
        return 1.0 + self.c * (size - 1)


def item_ratio(loaded, item: dict, la: LookaheadConfig, c: float, first_turns: bool, new_tokens: int):
    """(lookahead / plain modelled, tokens, steps, rows fed) for one item's turns."""
    session = Session(loaded.model, la, LinearCost(c), threads=loaded.threads)
    messages, modelled, tokens, steps, fed = [], 0.0, 0, 0, 0
    for turn in item["turns"][:1] if first_turns else item["turns"]:
        messages.append({"role": "user", "content": turn})
        answer: list[int] = []
        for event in generate(session, templates.encode(loaded.tokenizer, messages), SamplingConfig(new_tokens),
                              loaded.eos_ids):
            if isinstance(event, Step):
                modelled += 1.0 + c * (event.fed - 1)
                steps, fed = steps + 1, fed + event.fed
            elif isinstance(event, Done):
                answer = list(event.text_tokens)
        tokens += len(answer)  # plain decoding: one step of cost 1 a token
        messages.append({"role": "assistant", "content": loaded.tokenizer.decode(answer, skip_special_tokens=True)})
    return tokens / modelled, tokens, steps, fed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items")
    parser.add_argument("--first-turns", action="store_true", help="only each item's first turn, 128 tokens")
    parser.add_argument("--costs", default="0.15,0.1,0.07,0.05,0.03,0.02,0.01", help="values of c, comma-separated")
    parser.add_argument("--model", help="a GGUF file or checkpoint (default: the embedded model, fp32)")
    parser.add_argument("--limit", type=int, help="the first N items")
    parser.add_argument("--max-new-tokens", type=int, help="default: 128 with --first-turns, else 256")
    args = parser.parse_args()
    with open(args.items) as fh:
        items = [json.loads(line) for line in fh if line.strip()][: args.limit]
    loaded = load(LoadSpec(model=args.model, dtype="float32", device="cpu"))
    la = method_config("lookahead", LookaheadConfig())
    new_tokens = args.max_new_tokens or (128 if args.first_turns else 256)
    for c in (float(value) for value in args.costs.split(",")):
        results = [item_ratio(loaded, item, la, c, args.first_turns, new_tokens) for item in items]
        ratios = [r[0] for r in results]
        tokens, steps, fed = (sum(r[i] for r in results) for i in (1, 2, 3))
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"c={c:.3f}: {tokens / steps:.2f} tokens a step, {fed / steps:.1f} rows a step, "
              f"lookahead / plain geomean {geomean:.3f}, slowest {min(ratios):.2f}", flush=True)


if __name__ == "__main__":
    main()
