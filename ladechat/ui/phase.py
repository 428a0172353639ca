"""A slow phase on stderr (loading, measuring step costs, compiling): a spinner, what is happening
and for how long, so a minute-long compile shows that it is moving. Nothing when stderr is not
a terminal: the phase leaves no line behind either way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def phases(console: Console) -> Callable[[str], AbstractContextManager]:
    """progress(message) as engine/load/loading.load and backends/opener.bot_for take it: a context
    that gives update(text), which changes the phase's line (a download's sizes, say)."""

    @contextmanager
    def phase(message: str) -> Iterator[None]:
        columns = (SpinnerColumn("dots"), TextColumn("{task.description}"), TimeElapsedColumn())
        # disable: off a terminal rich would still end the phase with an empty line
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as shown:
            task = shown.add_task(message, total=None)
            yield lambda text: shown.update(task, description=text)  # the phase's line, as it goes

    return phase
