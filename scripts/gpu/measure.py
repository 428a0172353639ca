#!/usr/bin/env python3
"""One `ladechat ask --json` run measured as a user meets it: wall time from the command's start to its
answer (load, compile and decoding together), the process's peak resident memory, and the GPU's peak
memory in use while it ran (nvidia-smi, sampled every 0.2 s; none on a machine without it). Appends
one JSON line to RESULTS: the name, the command, these figures and the answer's own JSON (its
`stats` and `token_ids`), or the tail of its stderr where it failed.

    python3 scripts/gpu/measure.py RESULTS NAME -- ladechat ask --json ... "prompt"

Standard library only (the device image's python3 runs it before anything is installed)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=False).stdout
        return max(int(line) for line in out.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    results, name, command = argv[0], argv[1], argv[3:]
    sampling = shutil.which("nvidia-smi") is not None
    before = gpu_used_mib() if sampling else None
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            used = gpu_used_mib()
            if used is not None:
                peak[0] = max(peak[0] or 0, used)

    sampler = threading.Thread(target=sample, daemon=True)
    if sampling:
        sampler.start()
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    done.set()
    record: dict = {"name": name, "command": command, "rc": proc.returncode, "wall_s": round(wall, 1),
                    "max_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
                    "gpu_mib_before": before, "gpu_mib_peak": peak[0]}
    try:
        record["answer"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        record["stdout_tail"] = proc.stdout[-2000:]
    record["stderr_tail"] = proc.stderr[-3000:]
    with open(results, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    stats = (record.get("answer") or {}).get("stats", {})
    print(f"{name}: rc {proc.returncode}, {wall:.1f} s, peak RSS {record['max_rss_gib']} GiB, GPU peak "
          f"{peak[0]} MiB, {stats.get('new_tokens')} tokens, {stats.get('tokens_per_s')} tok/s, "
          f"{stats.get('steps')} steps", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr, flush=True)
    return proc.returncode


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
