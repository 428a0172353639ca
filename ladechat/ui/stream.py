"""Show a backend's answer: its text as it arrives, parallel tokens highlighted, notices, the
--debug lines and panel, the footer, and the message of a failure that ends it midway."""

from __future__ import annotations

import math
import re

from rich.cells import cell_len
from rich.console import Console
from rich.control import Control
from rich.markup import escape
from rich.segment import ControlType
from rich.text import Text

from ladechat.backends.base import RemoteError
from ladechat.backends.events import Notice, Piece
from ladechat.engine.events import OutOfMemory, Stats, Step
from ladechat.ui.thinking import ThinkingSplitter

GUESSED_STYLE = "bold cyan"
# Block-level Markdown worth rendering: code fences, headings, lists, tables, quotes.
MARKDOWN_BLOCKS = re.compile(r"^\s*(```|#{1,6} |[-*+] \S|\d+[.)] \S|\|.*\|\s*$|> )", re.MULTILINE)


class StreamPrinter:
    """Consumes a backend's Piece and Notice events. Content goes to `out`, everything else to `err`."""

    def __init__(self, out: Console, err: Console, debug: bool = False, markdown: bool = False,
                 hide_thinking: bool = False) -> None:
        self.out = out
        self.err = err
        self.debug = debug
        self.markdown = markdown
        self.hide_thinking = hide_thinking
        self.split = ThinkingSplitter()  # a reasoning model's <think>...</think>: shown dim, or not at all
        self.shown = ""  # exactly what went to the screen, to know how many rows it covers
        self.answer_shown = Text()  # the answer's part of it, styled as shown (for a redraw)

    @property
    def text(self) -> str:
        """The answer so far, its thinking left out (what a conversation keeps)."""
        return self.split.answer + (self.split.held if not self.split.inside else "")

    @property
    def thinking(self) -> str:
        return self.split.thinking

    def handle(self, event) -> None:
        if isinstance(event, Notice):
            self.err.print(f"[yellow]notice:[/] {escape(event.text)}", highlight=False)
        elif isinstance(event, Piece):
            for thought, text in self.split.feed(event.text):
                self._show(text, event.parallel, thought)
            if self.debug and event.step is not None:
                self._debug_line(event.step, event.spelled)

    def _show(self, piece: str, parallel: bool, thought: bool = False) -> None:
        if thought and self.hide_thinking:
            return
        style = "dim" if thought else ""
        text = Text(piece, style=f"{style} {GUESSED_STYLE}".strip() if parallel else style)
        self.out.print(text, end="", soft_wrap=True, highlight=False)
        self.shown += text.plain
        if not thought:
            self.answer_shown.append_text(text)

    def _debug_line(self, step: Step, spelled: tuple[str, ...]) -> None:
        """The step's summary, and each token as the model's tokenizer spells it (a star: a
        verified guess) where the backend decoded them one by one."""
        tokens = f": {' '.join(repr(s) + ('*' if g else '') for s, g in zip(spelled, step.guessed))}" if spelled else ""
        self.err.print(f"[dim]  step: +{len(step.tokens)} from {step.source}, fed {step.fed}, "
                       f"{step.seconds * 1000:.0f} ms{escape(tokens)}[/]", highlight=False)

    def finish(self, complete: bool = True) -> None:
        """End the answer's line; redraw a complete answer where that helps: its thinking folded
        to one line (/thinking shows it), and with block-level Markdown, rendered.

        The stream itself is plain text (re-rendering Markdown on every step would make it
        flicker and lose the highlighting), so a finished answer is erased and printed once more
        if it is still entirely on the screen. Not with --debug (stderr lines are interleaved)
        and only on a terminal.
        """
        for thought, text in self.split.flush():
            self._show(text, False, thought)
        rows = screen_rows(self.shown, self.out.size.width)
        on_screen = complete and not self.debug and self.out.is_terminal and rows < self.out.size.height
        thought = bool(self.thinking.strip()) and not self.hide_thinking
        render = self.markdown and MARKDOWN_BLOCKS.search(self.text) is not None
        if not (on_screen and (thought or render)):
            self.out.print()
            return
        codes = [(ControlType.CARRIAGE_RETURN,), (ControlType.ERASE_IN_LINE, 2)]
        codes += [(ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)] * (rows - 1)
        self.out.control(Control(*codes))
        if thought:
            self.out.print(Text(folded(self.thinking), style="dim"), highlight=False)
        if not render:
            self.out.print(self.answer_shown, highlight=False, soft_wrap=True)
            return
        from rich.markdown import Markdown  # markdown-it and pygments: only for an answer that has blocks

        self.out.print(Markdown(self.text.strip("\n")))


def folded(thinking: str) -> str:
    """The one line a finished answer's thinking folds to."""
    words = len(thinking.split())
    return f"[thought for {words} word{'s' if words != 1 else ''}: /thinking shows it]"


def screen_rows(text: str, width: int) -> int:
    """Rows that `text`, printed from column 0, covers on a terminal that wraps at `width` cells."""
    return sum(max(1, math.ceil(cell_len(line.expandtabs(8)) / width)) for line in text.split("\n"))


def footer(stats: Stats, backend) -> str:
    """The line under an answer: its decoding statistics, or, from a server that reports none
    (not ladechat serve), what it reported and the client measured."""
    extra = " (interrupted)" if stats.finish_reason == "interrupted" else ""
    if not backend.stats_reported:
        return (f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, first token after {stats.ttft_s:.2f} s, "
                f"as {backend.host} reported{extra}")
    mode = f"lookahead W={stats.window} N={stats.ngram} G={stats.candidates}" if stats.lookahead else "lookahead off"
    used = f", context {stats.context_used:,}/{stats.context_length:,}" if stats.context_length else ""
    return (f"{stats.new_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, "
            f"{stats.compression:.2f} tokens/step, {mode}{extra}{used}")


NEARLY_FULL = 0.8  # of the context: past it, the footer's line is followed by a warning


def context_line(stats: Stats | None) -> str:
    """/context: how much of the context the conversation holds, as of the last answer."""
    if stats is None:
        return "no answer yet in this conversation: its tokens are counted with each answer"
    if not stats.context_length:
        return "the server does not report its context size"
    used = stats.context_used
    return (f"context: {used:,} of {stats.context_length:,} tokens ({100 * used / stats.context_length:.0f}%) "
            f"after the last answer ({stats.prompt_tokens:,} in the conversation it answered, {stats.new_tokens:,} "
            "in the answer); when a question does not fit, the oldest exchanges are dropped")


def nearly_full(stats: Stats) -> str | None:
    """The warning after an answer that leaves the context nearly full, else None."""
    used = stats.context_used
    if not stats.context_length or used < NEARLY_FULL * stats.context_length:
        return None
    return (f"the conversation fills {100 * used / stats.context_length:.0f}% of the context ({used:,} of "
            f"{stats.context_length:,} tokens): the oldest exchange is dropped when the next question does not fit "
            "(/clear starts afresh)")


def failure(exc: Exception) -> str | None:
    """The one line for an error that ends an answer midway and is no bug: out of memory (with what
    makes room), a server gone or failing. None for anything else."""
    if isinstance(exc, OutOfMemory):
        return (f"{exc}; try a shorter conversation (/clear), a smaller max_new_tokens, fewer tokens per step "
                "(W, G) or --load-in-4bit")
    if isinstance(exc, RemoteError):
        return str(exc)
    return None


def debug_panel(stats: Stats):
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    hist = "  ".join(f"{k}:{v}" for k, v in sorted(stats.accepted_histogram.items()))
    positions = "  ".join(f"{i + 1}:{n}" for i, n in enumerate(stats.accepted_by_position) if n) or "-"
    rows = [
        ("compression", f"{stats.compression:.3f} tokens/step ({stats.new_tokens} tokens in {stats.steps} steps)"),
        ("tokens per step", hist or "-"),
        ("accepted by depth", positions),
        ("winning source", ", ".join(f"{k}:{v}" for k, v in sorted(stats.source_counts.items())) or "-"),
        ("calibration", "  ".join(f"{src}: expected {p:.1f} / accepted {o:.0f}"
                                  for src, (p, o) in sorted(stats.calibration.items())) or "-"),
        ("pool size", str(stats.pool_size)),
        ("tokens fed/step", f"{stats.mean_fed:.1f}"),
        ("step time", f"{stats.decode_s / max(stats.steps, 1) * 1000:.1f} ms mean"),
        ("prefill", f"{stats.prefill_tokens} tokens in {stats.prefill_s * 1000:.0f} ms"),
        ("time to first token", f"{stats.ttft_s * 1000:.0f} ms"),
        ("finish", stats.finish_reason),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return Panel(table, title="turn stats", expand=False)
