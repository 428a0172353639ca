"""python -m ladechat.engine.load.build_kernels: compile ladechat's C++ kernels into the user cache now.

The Makefile's install step runs this, so a first chat does not wait for the compiler. Anyone who
installs the package otherwise (pip) gets the same libraries compiled at the first load instead:
the kernels are built against the torch found at run time, which a wheel built in advance could
not know (native.py says more). One line per library on stdout; exit status 1 if one could not be
built (the chat then runs torch's kernels, and says why)."""

from __future__ import annotations

import sys


def main() -> int:
    from ladechat.engine.kernels import native, q4, step_ops
    from ladechat.paths import cache_root

    folder = cache_root() / "kernels"
    failed = False
    for source in (q4.SOURCE, step_ops.SOURCE):
        try:
            print(f"{source.name}: {native.load(source, folder)}", flush=True)
        except native.BuildError as exc:
            print(f"{source.name}: not built: {exc}", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
