"""A chat backend whose model loads in a background thread, so the chat shows its prompt at once.

Importing torch and transformers and reading the model take several seconds on a CPU (BENCHMARKS.md,
start-up); the user can type the first question meanwhile. Whatever needs the model (an answer,
/set, /show, /save) waits for the load, with a spinner that names the phase it is in."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as NotYet
from contextlib import AbstractContextManager, contextmanager

from ladechat.errors import UserError

Progress = Callable[[str], AbstractContextManager]


class LoadFailed(BaseException):
    """The model could not be loaded; the chat ends with this one-line message. Not an Exception:
    the chat's handlers that keep it going after a bad command or a failed answer let it through."""


class PendingBot:
    """A Backend (base.py) that becomes `load(progress)`'s once that returns. `label` names the
    model until then; `err` shows the spinner while something waits for the load."""

    stats_reported = True  # it is a local Bot
    host = None

    def __init__(self, load: Callable[[Progress], object], label: str, err) -> None:
        self.label = label
        self.phase = "importing torch and transformers"
        self._err = err
        self._result: Future = Future()
        self._result.set_running_or_notify_cancel()  # nothing may cancel it: the thread sets it
        threading.Thread(target=self._load, args=(load,), name="ladechat-load", daemon=True).start()

    def _load(self, load: Callable[[Progress], object]) -> None:
        try:
            self._result.set_result(load(self._progress))
        except BaseException as exc:  # raised where the chat waits, in the main thread
            self._result.set_exception(exc)

    @contextmanager
    def _progress(self, message: str):
        self.phase = message
        try:
            yield lambda text: setattr(self, "phase", text)  # the phase's line, as it goes
        finally:
            self.phase = "loading the model"

    @property
    def settled(self) -> bool:
        """The load has ended, loaded or failed."""
        return self._result.done()

    @property
    def ready(self) -> bool:
        """Loaded: nothing waits."""
        return self._result.done() and self._result.exception() is None

    def failure_message(self) -> str | None:
        """The one-line reason the load failed (a UserError's), once it has; None otherwise."""
        exc = self._result.exception() if self._result.done() else None
        return str(exc) if isinstance(exc, UserError) else None

    def bot(self):
        """The loaded Backend, waiting for it if need be (Ctrl-C stops the wait). LoadFailed when
        the load failed for a reason the user can act on; anything else it raised is raised as is."""
        if not self._result.done():
            with self._err.status(self._waiting(), spinner="dots") as status:
                while True:
                    try:
                        self._result.exception(timeout=0.2)  # returns what the load raised, if anything
                        break
                    except NotYet:
                        status.update(self._waiting())
        message = self.failure_message()
        if message is not None:
            raise LoadFailed(message)
        return self._result.result()

    def _waiting(self) -> str:
        return f"loading {self.label}: {self.phase}"

    # -- Backend -------------------------------------------------------------------------------
    @property
    def settings(self):
        return self.bot().settings

    @property
    def compiled(self) -> bool:
        return self.bot().compiled

    @property
    def name(self) -> str:
        return self.bot().name

    def describe(self) -> str:
        return self.bot().describe() if self.ready else f"{self.label} (loading)"

    def configure(self, settings) -> None:
        self.bot().configure(settings)

    def warm_up(self) -> None:
        self.bot().warm_up()

    def clear_store(self) -> int:
        return self.bot().clear_store()

    def reply(self, conversation) -> Iterator:
        yield from self.bot().reply(conversation)
