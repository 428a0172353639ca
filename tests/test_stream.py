"""The stream printer: plain streaming, then a finished Markdown answer redrawn once, rendered.
It prints a backend's Pieces: here a local model's Steps as the local backend makes them Pieces."""

import ast
import io

import pytest
from rich.console import Console

from ladechat.backends.detok import StepText
from ladechat.engine.events import Step
from ladechat.ui.stream import StreamPrinter, screen_rows

CODE_ANSWER = "Here is the function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nCall add(1, 2)."
PROSE_ANSWER = "The capital of France is Paris. It lies on the Seine."
UP = "\x1b[1A"


@pytest.fixture(scope="module")
def tokenizer(embedded_fp32):
    return embedded_fp32.tokenizer


def stream(tokenizer, text, *, terminal=True, height=40, markdown=True, complete=True, debug=False):
    buf = io.StringIO()
    out = Console(file=buf, force_terminal=terminal, width=40, height=height, no_color=True)
    err = Console(file=io.StringIO(), width=40)
    printer = StreamPrinter(out, err, debug=debug, markdown=markdown)
    feed(printer, tokenizer, text)
    printer.finish(complete=complete)
    return printer, buf.getvalue()


def feed(printer, tokenizer, text):
    """`text` as a model would answer it, one token per step."""
    steps = StepText(tokenizer)
    for token in tokenizer.encode(text, add_special_tokens=False):
        for piece in steps.pieces(Step((token,), (False,), "plain", 1, 0.0)):
            printer.handle(piece)


def test_screen_rows_counts_wrapped_lines():
    assert screen_rows("", 40) == 1
    assert screen_rows("a" * 40, 40) == 1
    assert screen_rows("a" * 41, 40) == 2
    assert screen_rows("a\n\nb", 40) == 3
    assert screen_rows("a" * 100 + "\nb", 40) == 4


def test_finished_code_answer_is_erased_and_rendered_once(tokenizer):
    printer, screen = stream(tokenizer, CODE_ANSWER)
    assert printer.shown == CODE_ANSWER
    streamed, redraw = screen.split("\r", 1)  # the stream, then the erase + rendered answer
    assert "```python" in streamed
    rows = screen_rows(CODE_ANSWER, 40)
    assert redraw.count(UP) == rows - 1  # back to the answer's first row, erasing each row
    rendered = redraw.rsplit(UP, 1)[1]
    assert "```" not in rendered  # fences became a code block
    assert "def add(a, b):" in rendered and "Call add(1, 2)." in rendered


def test_prose_and_non_terminal_and_partial_answers_are_not_redrawn(tokenizer):
    for kwargs, text in [({}, PROSE_ANSWER), ({"terminal": False}, CODE_ANSWER), ({"markdown": False}, CODE_ANSWER),
                         ({"complete": False}, CODE_ANSWER), ({"debug": True}, CODE_ANSWER)]:
        _, screen = stream(tokenizer, text, **kwargs)
        assert UP not in screen and screen.endswith(text + "\n"), kwargs


def test_answer_taller_than_the_screen_is_left_as_streamed(tokenizer):
    _, screen = stream(tokenizer, CODE_ANSWER, height=5)
    assert UP not in screen and "```python" in screen


def test_text_that_looks_like_rich_markup_is_printed_verbatim(tokenizer):
    text = "Use list[int] and close with [/] or [bold]x[/bold]."
    buf, err = io.StringIO(), io.StringIO()
    printer = StreamPrinter(Console(file=buf, width=200), Console(file=err, width=200), debug=True)
    feed(printer, tokenizer, text)
    printer.finish()
    assert buf.getvalue() == text + "\n"
    pieces = [ast.literal_eval(line.split(" ms: ", 1)[1]) for line in err.getvalue().splitlines()]
    assert "".join(pieces) == text  # each step's token, shown as repr, markup-like brackets included
