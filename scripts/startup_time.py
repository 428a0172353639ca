"""Warm start-up of the chat as a user meets it, in a pseudo-terminal (needs the dev extras: pexpect).

    python scripts/startup_time.py [COMMAND ...]     (default: ladechat)

Runs the chat 5 times with `--max-new-tokens 8 --no-store` and prints the medians of: the time to
its `>>>` prompt, and the time to the footer of the answer to a question typed the moment the
prompt appears. For `ladechat ask`, `/usr/bin/time ladechat ask "Say hello." --max-new-tokens 8`
says the same in one line."""

import os
import statistics
import sys
import time

import pexpect

RUNS = 5


def one_run(command: list[str]) -> tuple[float, float]:
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "NO_COLOR": "1", "TERM": "xterm"}
    start = time.perf_counter()
    child = pexpect.spawn(command[0], [*command[1:], "--max-new-tokens", "8", "--no-store"], env=env,
                          encoding="utf-8", timeout=300)
    child.expect(">>>")
    at_prompt = time.perf_counter() - start
    child.sendline("Say hello.")
    child.expect("tokens/step")
    answered = time.perf_counter() - start
    child.expect(">>>")
    child.sendeof()
    child.expect(pexpect.EOF)
    return at_prompt, answered


def main() -> None:
    command = sys.argv[1:] or ["ladechat"]
    runs = [one_run(command) for _ in range(RUNS)]
    for name, times in (("the chat at its prompt", [r[0] for r in runs]),
                        ("first answer, typed at once", [r[1] for r in runs])):
        print(f"{name}: median {statistics.median(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
