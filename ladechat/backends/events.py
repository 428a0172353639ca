"""What every front end consumes, the same whichever backend answers (a model in this process, one
still loading, one behind a server): Notices, Pieces (the answer's text, each engine Step on its
last piece), then one engine Done; or an OutOfMemory or a RemoteError midway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ladechat.engine.events import Step


@dataclass(frozen=True)
class Notice:
    """Something the user should see that is not part of the answer (e.g. turns dropped)."""

    text: str


@dataclass(frozen=True)
class Piece:
    """Answer text, decoded. parallel: it was accepted in parallel (shown highlighted). step: the
    Step whose text this piece ends, where the backend knows it (a model here, ladechat serve);
    spelled: that step's tokens each decoded alone (for --debug), where the backend can."""

    text: str
    parallel: bool = False
    step: Step | None = None
    spelled: tuple[str, ...] = ()


def pieces(segments: list[tuple[str, bool]], step: Step | None = None, spelled: tuple[str, ...] = ()
           ) -> Iterator[Piece]:
    """Text segments (text, parallel) as Pieces, empty ones left out, with the step (and its
    tokens' spellings) on the last; a step whose text is still held back (half a character)
    comes as one empty Piece."""
    segments = [(text, parallel) for text, parallel in segments if text] or ([("", False)] if step else [])
    for i, (text, parallel) in enumerate(segments):
        last = i == len(segments) - 1
        yield Piece(text, parallel, step if last else None, spelled if last else ())
