"""Answers under a JSON schema, plain decoding against lookahead, as the chat gives them (local.Bot):
tok/s, tokens a step, and whether every lookahead answer is plain decoding's, token for token.

    python scripts/schema_bench.py [--model FILE] [--limit N] [--max-new-tokens N] [--json]

Items: scripts/schema_turns.jsonl (a question and the schema its answer must follow; written for
this, never tuned on). A measuring tool, not a test."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ladechat.backends.local import Bot
from ladechat.backends.opener import load_model, settings_for
from ladechat.bench.prompts import answer_item
from ladechat.engine.load.spec import LoadSpec

ITEMS = Path(__file__).with_name("schema_turns.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    items = [json.loads(line) for line in ITEMS.read_text().splitlines() if line.strip()][: args.limit]
    loaded = load_model(LoadSpec(model=args.model), None)
    settings = settings_for({"max_new_tokens": args.max_new_tokens, "store": False}, loaded)
    bots = {method: Bot(loaded, settings.updated({"lookahead": method == "lookahead"})) for method in ("plain", "lookahead")}
    for bot in bots.values():  # first calls allocate and pick kernels
        answer_item(bot, {"turns": ["Hello"]})
    totals = {method: {"tokens": 0, "seconds": 0.0, "steps": 0} for method in bots}
    identical = complete = 0
    for item in items:
        answers = {}
        for method, bot in bots.items():
            bot.configure(bot.settings.updated({"format": json.dumps(item["schema"])}))
            ids, seconds, steps, _ = answer_item(bot, item)
            answers[method] = ids
            totals[method]["tokens"] += len(ids)
            totals[method]["seconds"] += seconds
            totals[method]["steps"] += steps
        identical += answers["plain"] == answers["lookahead"]
        complete += answers["plain"][-1:] and answers["plain"][-1] in loaded.eos_ids
    result = {"model": loaded.name, "items": len(items), "identical": identical, "complete_documents": complete,
              **{method: {"tokens_per_s": round(t["tokens"] / t["seconds"], 2),
                          "tokens_per_step": round(t["tokens"] / t["steps"], 3), **t} for method, t in totals.items()}}
    result["lookahead_vs_plain"] = round(result["lookahead"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2) if args.json else
          f"{loaded.name}: plain {result['plain']['tokens_per_s']} tok/s, lookahead "
          f"{result['lookahead']['tokens_per_s']} ({result['lookahead']['tokens_per_step']} tokens a step), "
          f"{result['lookahead_vs_plain']}x; identical {identical}/{len(items)}, whole documents {complete}/{len(items)}",
          file=sys.stdout)


if __name__ == "__main__":
    main()
