"""A reasoning model's <think>...</think> told apart from its answer as it streams: shown dim or
hidden, never kept in the conversation's text (ui/thinking.py, ui/stream.StreamPrinter)."""

import io

import pytest
from rich.console import Console

from ladechat.backends.events import Piece
from ladechat.ui.stream import StreamPrinter
from ladechat.ui.thinking import ThinkingSplitter, split

ANSWER = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nTwo plus two is **4**."


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cut", range(1, len(ANSWER)))
def test_a_tag_cut_anywhere_between_pieces_is_still_found(cut):
    splitter = ThinkingSplitter()
    out = [segment for piece in pieces_of(ANSWER, [cut]) for segment in splitter.feed(piece)] + splitter.flush()
    assert "".join(text for thought, text in out if thought) == "\nThe user wants 2+2. That is 4.\n"
    assert "".join(text for thought, text in out if not thought) == "Two plus two is **4**."
    assert splitter.answer == "Two plus two is **4**."


def test_text_without_tags_is_all_answer_even_when_it_ends_like_one():
    assert split("a < b and x <thin") == ("", "a < b and x <thin")
    assert split("plain answer") == ("", "plain answer")
    assert split("<think>cut short") == ("cut short", "")  # an answer stopped while thinking


def printed(hide: bool, pieces: list[str]) -> tuple[str, StreamPrinter]:
    screen = io.StringIO()
    printer = StreamPrinter(Console(file=screen, width=200), Console(file=io.StringIO()), hide_thinking=hide)
    for piece in pieces:
        printer.handle(Piece(piece, parallel=False))
    printer.finish()
    return screen.getvalue(), printer


def test_the_thinking_is_shown_or_hidden_and_never_kept_as_the_answer():
    pieces = pieces_of(ANSWER, [3, 9, 20, 40, 47, 52])
    shown, printer = printed(False, pieces)
    assert "That is 4." in shown and "Two plus two is **4**." in shown and "<think>" not in shown
    assert printer.text == "Two plus two is **4**." and printer.thinking.strip() == "The user wants 2+2. That is 4."
    hidden, printer = printed(True, pieces)
    assert "That is 4." not in hidden and hidden.strip() == "Two plus two is **4**."
    assert printer.text == "Two plus two is **4**."
