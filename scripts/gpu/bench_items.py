"""`ladechat bench ARGS...` that appends one JSON line per item to $LADECHAT_GPU_RESULTS as each item
finishes (ladechat.bench.prompts.run's on_item), each with the fields of $LADECHAT_GPU_STAMP (call, step,
GPU), so a bench stopped at its limit keeps every item it finished. The summary still goes to
stdout at the end. Used by scripts/gpu/stage.py."""

import json
import os
import sys

from ladechat import cli
from ladechat.bench import prompts as bench


def main() -> None:
    path = os.environ["LADECHAT_GPU_RESULTS"]
    stamp = json.loads(os.environ.get("LADECHAT_GPU_STAMP") or "{}")

    def on_item(record: dict) -> None:
        from torch._dynamo.utils import counters  # compiled graphs run without CUDA graphs so far

        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({**stamp, **record, "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])})
                     + "\n")

    run = bench.run
    bench.run = lambda *args, **kwargs: run(*args, on_item=on_item, **kwargs)  # cli.bench calls prompts.run
    cli.main(["bench", *sys.argv[1:]])


if __name__ == "__main__":
    main()
