"""Keep-alive (issue #30) measured as a user meets it (needs the dev extras: pexpect).

    python scripts/keepalive_time.py [--runs N] [--cold-runs N]

In a runtime folder of its own (LADECHAT_RUNTIME_DIR; the user's warm servers are not touched),
with the embedded model, medians of:

  warm ask    `ladechat ask --json "Say hi." --max-new-tokens 8` against a warm server: its wall
              time, the server's time for the answer (stats.total_s) and the command's own time
              (wall minus the server's); alternately with the same through `--api` to a `ladechat
              serve` on a loopback port (the same client over TCP), whose own time is measured alike
  warm chat   the chat started against a warm server, in a pseudo-terminal: from Enter to the first
              word of the answer, and to its footer
  cold ask    the first `ask` of a cold machine, which starts a server, and `--keep-alive 0` (the
              model loaded in the command, as before keep-alive), alternately; the server is stopped
              before each run
  same        fp32 greedy answers through the warm server and in-process: token ids compared

Other work on the machine moves every figure: the load average is printed with them.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pexpect

LADECHAT = str(Path(sys.executable).with_name("ladechat"))
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in two sentences."]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def median(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} s ({', '.join(f'{x:.2f}' for x in xs)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--cold-runs", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="lc-bench-", dir="/tmp"))
    env = {**os.environ, "LADECHAT_RUNTIME_DIR": str(folder / "run"), "LADECHAT_KEEP_ALIVE": "10m", "NO_COLOR": "1"}

    def ladechat(*a: str) -> tuple[float, subprocess.CompletedProcess]:
        start = time.perf_counter()
        r = subprocess.run([LADECHAT, *a], capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise SystemExit(f"ladechat {' '.join(a)} failed: {r.stderr.strip()}")
        return time.perf_counter() - start, r

    try:
        print(f"load average at start: {load()}")
        ask = ["ask", "--json", "--max-new-tokens", "8", "Say hi."]
        ladechat(*ask)  # starts the server
        serve = subprocess.Popen([LADECHAT, "serve", "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
        url = None
        for line in serve.stderr:
            if (found := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)) is not None:
                url = found.group(1)
                break
        if url is None:
            raise SystemExit("ladechat serve did not start")
        ladechat(*ask, "--api", url)
        walls, own, api_own = [], [], []
        for _ in range(args.runs):
            wall, r = ladechat(*ask)
            walls.append(wall)
            own.append(wall - json.loads(r.stdout)["stats"]["total_s"])
            wall, r_api = ladechat(*ask, "--api", url)
            api_own.append(wall - json.loads(r_api.stdout)["stats"]["total_s"])
        serve.terminate()
        serve.wait()
        print(f"warm ask, wall: {median(walls)}")
        print(f"warm ask, own (wall - server): {median(own)}")
        print(f"ask --api to ladechat serve, own (wall - server): {median(api_own)}")
        first_word = json.loads(r.stdout)["text"].split()[0]

        to_first, to_footer = [], []
        chat_env = {**env, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "XDG_STATE_HOME": str(folder / "state")}
        for _ in range(args.runs):
            child = pexpect.spawn(LADECHAT, ["--max-new-tokens", "8", "--temperature", "0"], env=chat_env,
                                  encoding="utf-8", timeout=120, dimensions=(40, 200))
            child.expect(">>>")
            child.send("Say hi.")
            child.expect("Say hi.")
            start = time.perf_counter()
            child.send("\r")
            child.expect(first_word)
            to_first.append(time.perf_counter() - start)
            child.expect("tokens/step")
            to_footer.append(time.perf_counter() - start)
            child.expect(">>>")
            child.sendeof()
            child.expect(pexpect.EOF)
        print(f"warm chat, Enter to the answer's first word: {median(to_first)}")
        print(f"warm chat, Enter to the footer: {median(to_footer)}")

        same = 0
        for prompt in PROMPTS:
            a = ["ask", "--json", "--dtype", "float32", "--max-new-tokens", "64", prompt]
            warm = json.loads(ladechat(*a)[1].stdout)
            local = json.loads(ladechat(*a, "--keep-alive", "0")[1].stdout)
            same += warm["token_ids"] == local["token_ids"] and warm["text"] == local["text"]
        print(f"fp32 greedy, warm server vs in-process: {same}/{len(PROMPTS)} token-identical")

        cold, before = [], []
        for _ in range(args.cold_runs):
            ladechat("stop", "--all")
            cold.append(ladechat(*ask)[0])
            before.append(ladechat(*ask, "--keep-alive", "0")[0])
        print(f"cold ask, starting the server: {median(cold)}")
        print(f"cold ask, --keep-alive 0 (in the command): {median(before)}")
        print(f"cold ask, ratio of medians: {statistics.median(cold) / statistics.median(before):.3f}")
        print(f"load average at end: {load()}")
    finally:
        subprocess.run([LADECHAT, "stop", "--all"], env=env, capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
