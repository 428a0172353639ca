#!/usr/bin/env python3
"""--compile's start-up, phase by phase (issue #26: target <= 60 s from the command to the answer),
for the staged GPU run: what `ladechat ask --compile` does in one process, each phase timed:
the imports, the load (its own phases, through the progress callback the CLI passes), the compile
of the decoding steps, and the first answer. Prints one JSON object, with how many graphs torch
ran without CUDA graphs (cudagraph_skips; 0 is what --compile on a GPU is for).

    python3 scripts/gpu/startup.py [--device cuda] [--dtype bfloat16] [--max-new-tokens 64] [--model M]
                                   [--compile] PROMPT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

START = time.monotonic()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    phases: list[list] = []

    def since(mark: float) -> float:
        return round(time.monotonic() - mark, 2)

    @contextlib.contextmanager
    def progress(label: str):
        began = time.monotonic()
        yield
        phases.append([label, since(began)])

    began = time.monotonic()
    import torch  # noqa: F401  (timed: the import a command pays first)
    import transformers  # noqa: F401
    phases.append(["import torch, transformers", since(began)])
    from ladechat.cli import _bot, _load, _settings
    from ladechat.conversation import Conversation
    from ladechat.engine.events import Done

    began = time.monotonic()
    loaded = _load(args.model, args.dtype, args.device, "sdpa", False, False, None, progress, compile=args.compile)
    phases.append(["load, in all", since(began)])
    settings = _settings({"max_new_tokens": args.max_new_tokens}, loaded, compile=args.compile)
    bot = _bot(loaded, settings, args.compile, progress)
    conversation = Conversation(messages=[{"role": "user", "content": args.prompt}])
    began = time.monotonic()
    done = next(e for e in bot.reply(conversation) if isinstance(e, Done))
    phases.append(["the first answer", since(began)])
    stats = done.stats
    from torch._dynamo.utils import counters  # CUDA graphs torch gave up on ("skipping cudagraphs ...")

    skips = counters["inductor"]["cudagraph_skips"]
    print(json.dumps({"phases": phases, "to_answer_s": since(START), "compiled": args.compile,
                      "device": str(loaded.device), "dtype": str(loaded.dtype), "new_tokens": stats.new_tokens,
                      "steps": stats.steps, "decode_tok_s": round(stats.new_tokens / max(stats.decode_s, 1e-9), 1),
                      "window": stats.window, "ngram": stats.ngram, "candidates": stats.candidates,
                      "cudagraph_skips": skips}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
