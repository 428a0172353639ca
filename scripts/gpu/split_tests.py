#!/usr/bin/env python3
"""The test suite in two halves of about equal duration, for two device calls (scripts/gpu/stage.py).

test-durations.json beside this file holds seconds per test file. Each file goes, longest first,
to the half with less time so far, so the heavy files land in different halves; a half runs its
files longest first (the heavy files drive the model through the CLI and the server, on CUDA there;
the light ones test logic that CI covers on a CPU). A file the table does not know counts DEFAULT_S.

    python3 scripts/gpu/split_tests.py a|b               the files of half a or b, one a line
    python3 scripts/gpu/split_tests.py --record FILE...  update the table from results.jsonl files of
                                                         the device calls (or of a local run with
                                                         `-p pytest_lines`), then print it
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).resolve().with_name("test-durations.json")
DEFAULT_S = 30.0
# the staging's own test: it downloads from the package index, which the device cannot reach
NOT_ON_DEVICE = {"tests/test_gpu_stage.py"}


def durations(table: Path = TABLE) -> dict[str, float]:
    return json.loads(table.read_text(encoding="utf-8"))["seconds"]


def suite_files(repo: Path) -> list[str]:
    files = (p.relative_to(repo).as_posix() for p in (repo / "tests").glob("test_*.py"))
    return sorted(f for f in files if f not in NOT_ON_DEVICE)


def halves(files: list[str], seconds: dict[str, float] | None = None) -> tuple[list[str], list[str]]:
    seconds = durations() if seconds is None else seconds
    cost = {f: float(seconds.get(f, DEFAULT_S)) for f in files}
    parts: tuple[list[str], list[str]] = ([], [])
    totals = [0.0, 0.0]
    for f in sorted(files, key=lambda f: (-cost[f], f)):
        i = 0 if totals[0] <= totals[1] else 1
        parts[i].append(f)
        totals[i] += cost[f]
    return parts


def record(results: list[Path], table: Path = TABLE) -> dict[str, float]:
    """Seconds per file from the per-test lines: a file whose every collected test reported replaces
    its entry; one cut short (a half stopped at its limit) raises it to at least what it took."""
    took: dict[str, float] = defaultdict(float)
    reported: dict[str, set] = defaultdict(set)
    collected: dict[str, set] = defaultdict(set)
    for path in results:
        for line in path.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            if "test" in item:
                file = item["test"].split("::")[0]
                took[file] += item["seconds"]
                reported[file].add(item["test"])
            for node in item.get("collected", []):
                collected[node.split("::")[0]].add(node)
    data = json.loads(table.read_text(encoding="utf-8"))
    seconds = data["seconds"]
    for file, total in took.items():
        complete = collected[file] <= reported[file]
        seconds[file] = round(total if complete else max(total, seconds.get(file, 0.0)), 1)
    data["source"] = f"recorded from {', '.join(p.name for p in results)}"
    table.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return seconds


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"] and argv[1:]:
        print(json.dumps(record([Path(p) for p in argv[1:]]), indent=1, sort_keys=True))
        return 0
    if argv in (["a"], ["b"]):
        repo = Path(__file__).resolve().parents[2]
        print("\n".join(halves(suite_files(repo))[0 if argv == ["a"] else 1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
