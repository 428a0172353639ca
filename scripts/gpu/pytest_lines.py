"""A pytest plugin (`-p pytest_lines`, with scripts/gpu on the path): one JSON line per test, appended
to $LADECHAT_GPU_RESULTS as each test ends, so a run stopped at its limit keeps every finished
test. First a line with the collected node ids (what did not report did not finish), last one
with the totals. Each line carries the fields of $LADECHAT_GPU_STAMP (call, step, GPU)."""

from __future__ import annotations

import json
import os
from collections import Counter

_phases: dict[str, dict] = {}
_totals: Counter = Counter()


def _write(record: dict) -> None:
    path = os.environ.get("LADECHAT_GPU_RESULTS")
    if path:
        stamp = json.loads(os.environ.get("LADECHAT_GPU_STAMP") or "{}")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({**stamp, **record}) + "\n")


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    test = _phases.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "message": None})
    test["seconds"] += report.duration
    if report.failed:
        test["outcome"] = "failed" if report.when == "call" else "error"
        test["message"] = str(report.longrepr)[-2000:]
    elif report.skipped and test["outcome"] == "passed":
        test["outcome"] = "skipped"
        test["message"] = str(report.longrepr)[-500:]
    if report.when == "teardown":
        del _phases[report.nodeid]
        _totals[test["outcome"]] += 1
        _write({"test": report.nodeid, "outcome": test["outcome"], "seconds": round(test["seconds"], 3),
                "message": test["message"]})


def pytest_sessionfinish(session, exitstatus):
    _write({"tests_summary": dict(_totals), "exitstatus": int(exitstatus)})
