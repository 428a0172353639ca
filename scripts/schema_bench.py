"""Answers under a JSON schema, plain decoding against lookahead, as the chat gives them (local.Bot):
tok/s, tokens a step, and whether every lookahead answer is plain decoding's, token for token.

    python scripts/schema_bench.py [--model FILE] [--limit N] [--max-new-tokens N] [--json] [--peer NAME=URL]

Items: scripts/schema_turns.jsonl (a question and the schema its answer must follow; written for
this, never tuned on). --peer: an OpenAI-compatible server (llama-server) answering the same items
with the schema as its response_format, timed the same way (question to answer's end, its usage's
tokens); `BENCH=schema scripts/peer_bench.sh --model FILE` runs llama.cpp's two servers beside.
A measuring tool, not a test."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

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
    parser.add_argument("--peer", action="append", default=[], help="NAME=URL of an OpenAI-compatible server")
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
    for peer in args.peer:
        name, _, url = peer.partition("=")
        result[name] = peer_run(url, items, args.max_new_tokens)
        result[f"lookahead_vs_{name}"] = round(result["lookahead"]["tokens_per_s"] / result[name]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2) if args.json else
          f"{loaded.name}: plain {result['plain']['tokens_per_s']} tok/s, lookahead "
          f"{result['lookahead']['tokens_per_s']} ({result['lookahead']['tokens_per_step']} tokens a step), "
          f"{result['lookahead_vs_plain']}x; identical {identical}/{len(items)}, whole documents {complete}/{len(items)}",
          file=sys.stdout)


def peer_run(url: str, items: list[dict], max_tokens: int) -> dict:
    """The items answered by the server at `url`, greedy, each held to its schema by response_format."""
    tokens, seconds, complete = 0, 0.0, 0
    with httpx.Client(timeout=600) as client:
        model = client.get(url + "/models").json()["data"][0]["id"]
        for item in items:
            body = {"model": model, "messages": [{"role": "user", "content": turn} for turn in item["turns"][:1]],
                    "temperature": 0, "max_tokens": max_tokens,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": item["schema"]}}}
            start = time.perf_counter()
            reply = client.post(url + "/chat/completions", json=body).json()
            seconds += time.perf_counter() - start
            tokens += reply["usage"]["completion_tokens"]
            complete += reply["choices"][0]["finish_reason"] == "stop"
    return {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "seconds": seconds, "complete_documents": complete}


if __name__ == "__main__":
    main()
