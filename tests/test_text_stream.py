"""What a streamed answer sends when stop strings are set (serve's TextStream): never a character
of a stop string, whatever the steps' text boundaries."""

import pytest

from ladechat.backends.events import Piece
from ladechat.serve.wire import TextStream


def sent(stop: tuple[str, ...], pieces: list[str]) -> tuple[list[str], str]:
    """The text released after each piece, and the whole text sent once the answer ends."""
    stream, released = TextStream(stop), []
    for text in pieces:
        stream.add(Piece(text))
        released.append("".join(s for s, _ in stream.release()))
    whole = "".join(released) + "".join(s for s, _ in stream.finish())
    return released, whole


@pytest.mark.parametrize("pieces", [
    ["Paris is the capital", " END"],  # the stop string comes whole in the last step
    ["Paris is the capital E", "ND"],  # split across steps
    ["Paris is the capital ENDing more"],  # one lookahead step brings it with text after it
    ["Par", "is is the capital", " EN", "D."],
])
def test_no_character_of_a_stop_string_is_ever_sent(pieces):
    released, whole = sent(("END",), pieces)
    assert whole == "Paris is the capital "
    assert all("E" not in r and "N" not in r for r in released)


def test_without_a_stop_string_in_the_answer_everything_is_sent():
    released, whole = sent(("STOP", "\n\n"), ["One", " two", " three"])
    assert whole == "One two three"
    assert released == ["", "One ", "two th"]  # the last three characters held back: they could begin STOP


def test_the_first_of_several_stop_strings_wins():
    assert sent(("b", "XYZ"), ["aaXYZ then b"])[1] == "aa"
