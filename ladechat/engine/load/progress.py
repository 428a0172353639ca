"""A slow phase's line as it goes: the progress(message) contexts the loaders take give
update(text) (ui/phase.py's spinner, and a warm server's phases, which pass it on to the command),
`titled` puts a part's text after the phase's title on that line, and `sized` turns bytes done and
in all into it, a few times a second at most."""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY = 0.25  # seconds between two updates of the line

Report = Callable[[int, int], None]  # (bytes done, bytes in all)


def titled(update: Callable[[str], None] | None, title: str) -> Callable[[str], None] | None:
    """show(text) that puts "title: text" on the phase's line through update (None: nothing to show)."""
    if update is None:
        return None
    return lambda text: update(f"{title}: {text}")


def sized(update: Callable[[str], None] | None, title: str) -> Report | None:
    """report(done, total) that shows "title: 1.20 / 4.10 GB" (under a gigabyte: "88 / 105 MB")
    through update (None: nothing to show)."""
    show = titled(update, title)
    if show is None:
        return None
    last = [float("-inf")]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < EVERY:
            return
        last[0] = now
        show(f"{done / 1e9:.2f} / {total / 1e9:.2f} GB" if total >= 1e9 else f"{done / 1e6:.0f} / {total / 1e6:.0f} MB")

    return report
