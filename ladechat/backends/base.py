"""What every backend is: the protocol the chat, `ask` and `serve` answer through, and the errors
a server backend fails with. Imported by front ends that run no model (`--api`, the keep-alive
client): no torch, transformers or httpx here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ladechat.backends.events import Notice, Piece
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.errors import UserError
from ladechat.settings import Settings


class Backend(Protocol):
    """Whatever answers the chat, `ask` and `serve`: a local.Bot (a model in this process), a
    pending.PendingBot (one still loading), a remote.RemoteBot (a model behind an OpenAI-compatible
    server) or a keepalive WarmBot (a model kept loaded by a local server). Data and answers only: how they are shown (the printer, the footer, the message of a
    failure) is the front end's choice. Every one streams the same events (engine/events.py)."""

    settings: Settings
    compiled: bool  # configure() then needs warm_up() (compiles)
    name: str  # the model, as /save records it
    stats_reported: bool  # Done carries real decoding statistics (steps, lookahead): /stats, /debug
    ready: bool  # it answers without waiting (a pending.PendingBot is False while its model loads)
    host: str | None  # the server that answers (host:port), None for a model in this process

    def describe(self) -> str: ...  # the model and where it runs, for the banner and /show
    def configure(self, settings: Settings) -> None: ...  # ConfigError for what it cannot do
    def warm_up(self) -> None: ...
    def clear_store(self) -> int: ...  # forget the model's past answers; how many
    def reply(self, conversation: Conversation) -> Iterator[Notice | Piece | Done]: ...  # may raise
    # OutOfMemory or a RemoteError midway. Ctrl-C, wherever it lands, ends the stream with a Done
    # whose finish_reason is "interrupted": see interrupt().


def interrupt(events: Iterator[Notice | Piece | Done]) -> Done | None:
    """Ctrl-C that a front end caught between a reply's events (printing one, say): thrown into the
    stream, it ends the answer as one that lands inside the backend does, with the Done that holds
    the answer's statistics. None when the stream cannot end so (it had not begun, or it had ended)."""
    try:
        event = events.throw(KeyboardInterrupt())
    except (KeyboardInterrupt, StopIteration):
        return None
    events.close()
    return event if isinstance(event, Done) else None


class RemoteError(UserError):
    """The server cannot be used or failed; the message is one line. retry: the same request may
    be answered later (the chat then keeps the question for /retry)."""

    retry = False


class ServerFailure(RemoteError):
    """The server is gone (unreachable, the connection broke) or failed the answer (an error event,
    a 5xx status, a stream that ended unfinished): asked again once it is back, it may answer."""

    retry = True
