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


def on_a_terminal(pieces: list[str], markdown: bool = True, complete: bool = True, height: int = 40) -> str:
    screen = io.StringIO()
    out = Console(file=screen, width=80, height=height, force_terminal=True, color_system=None)
    printer = StreamPrinter(out, Console(file=io.StringIO()), markdown=markdown)
    for piece in pieces:
        printer.handle(Piece(piece, parallel=piece.startswith("Two")))
    printer.finish(complete=complete)
    return screen.getvalue()


ERASE_LINE = "\x1b[2K"


def test_a_finished_answers_thinking_folds_to_one_line():
    """Streamed dim, then erased with the answer and drawn again: the thinking as one line that says
    how to see it, the answer as it was shown (its parallel tokens' style kept) or as Markdown."""
    pieces = pieces_of(ANSWER, [3, 9, 20, 40, 47, 52])
    screen = on_a_terminal(pieces, markdown=False)
    streamed, _, redrawn = screen.rpartition(ERASE_LINE)
    assert "That is 4." in streamed and "That is 4." not in redrawn
    assert redrawn.splitlines()[0] == "[thought for 7 words: /thinking shows it]"
    assert "Two plus two is **4**." in redrawn  # not rendered: as streamed
    rendered = on_a_terminal(pieces_of(ANSWER.replace("Two plus", "- Two plus"), [20, 60]))
    assert rendered.rpartition(ERASE_LINE)[2].splitlines()[0] == "[thought for 7 words: /thinking shows it]"
    assert "**" not in rendered.rpartition(ERASE_LINE)[2]  # rendered as Markdown
    for kept in (on_a_terminal(pieces, complete=False), on_a_terminal(pieces, height=3)):
        assert ERASE_LINE not in kept and "That is 4." in kept  # interrupted, or scrolled off: left as it is
    assert ERASE_LINE not in on_a_terminal(["Two plus two is 4."])  # no thinking, no Markdown: nothing to redraw


def test_the_thinking_command_shows_the_last_answers_thinking():
    from tiny_models import tiny_loaded

    from ladechat.backends.local import Bot
    from ladechat.settings import Settings
    from ladechat.ui.chat import ChatApp

    class Reasoning(Bot):
        def reply(self, conversation):
            yield Piece("<think>Weighing it up.</think>", parallel=False)
            yield from super().reply(conversation)

    out, err = io.StringIO(), io.StringIO()
    app = ChatApp(Reasoning(tiny_loaded(), Settings(max_new_tokens=4)), None, False, Console(file=out),
                  Console(file=err, width=300))
    app.command("/thinking")
    assert err.getvalue().splitlines()[-1] == "error: the last answer had no thinking (<think>...</think>) to show"
    app.ask("hi")
    assert "Weighing it up." not in app.conversation.messages[-1]["content"]
    app.command("/thinking")
    assert out.getvalue().splitlines()[-1] == "Weighing it up."
    app.command("/clear")
    app.command("/thinking")
    assert err.getvalue().splitlines()[-1].startswith("error: the last answer had no thinking")
