"""The chat's model loading in a background thread (ladechat.backends.pending): the prompt does not wait for
it, whatever needs the model does, and a failed load ends the chat with its one-line reason."""

import io
import threading

import pytest
from rich.console import Console
from tiny_models import tiny_loaded

from ladechat.backends.local import Bot
from ladechat.backends.pending import LoadFailed, PendingBot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.errors import UserError
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp, chat_loop

SETTINGS = Settings(window=2, ngram=3, candidates=1, max_new_tokens=12)


def gated(result):
    """A load function that reports a phase and then waits for `release` before it returns (or
    raises) `result`; `release` and the phases it reported go with it."""
    release = threading.Event()
    phases = []

    def load(progress):
        with progress("reading the weights"):
            phases.append("reading the weights")
            release.wait(timeout=60)
        if isinstance(result, BaseException):
            raise result
        return result()

    return load, release, phases


def quiet() -> Console:
    return Console(file=io.StringIO())


def answer_tokens(backend) -> list[int]:
    conversation = Conversation(messages=[{"role": "user", "content": "hello there"}])
    done = [e for e in backend.reply(conversation) if isinstance(e, Done)]
    return list(done[0].text_tokens)


@pytest.mark.slow
def test_nothing_waits_for_the_load_until_the_model_is_needed():
    loaded = tiny_loaded()
    load, release, phases = gated(lambda: Bot(loaded, SETTINGS))
    pending = PendingBot(load, label="tiny", err=quiet())
    assert pending.describe() == "tiny (loading)"  # the banner: no wait
    assert not pending.ready and not pending.settled
    # Leaving the chat, /help, /stats and an empty line need no model: the loop ends with the load held.
    app = ChatApp(pending, None, False, quiet(), quiet())
    lines = iter(["", "/help", "/stats", "/exit"])
    chat_loop(app, lambda prompt: next(lines))
    assert not pending.settled
    release.set()
    assert answer_tokens(pending) == answer_tokens(Bot(loaded, SETTINGS))  # waited, then the same answer
    assert pending.ready and pending.describe() == "tiny on cpu (float32)" and phases == ["reading the weights"]
    assert pending.phase == "loading the model"  # the spinner does not name a phase that has ended
    assert pending.settings == SETTINGS and pending.name == "tiny"


def chat_while_loading(seconds: float):
    """(PendingBot, ChatApp) over a tiny model whose load ends `seconds` from now."""
    loaded = tiny_loaded()
    load, release, _ = gated(lambda: Bot(loaded, SETTINGS))
    pending = PendingBot(load, label="tiny", err=quiet())
    threading.Timer(seconds, release.set).start()
    return pending, ChatApp(pending, None, False, quiet(), quiet())


@pytest.mark.slow
def test_a_question_typed_during_the_load_is_answered_once_it_ends():
    _, app = chat_while_loading(0.5)
    app.ask("hello there")
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]
    assert not app.conversation.messages[1]["interrupted"] and app.conversation.messages[1]["content"]
    assert app.totals.by_mode["lookahead"]["turns"] == 1


def test_a_load_that_fails_for_the_user_ends_the_chat_with_its_message():
    load, release, _ = gated(UserError("model folder not found: /no/such/folder"))
    pending = PendingBot(load, label="/no/such/folder", err=quiet())
    app = ChatApp(pending, None, False, quiet(), quiet())
    release.set()
    lines = iter(["What is 2 + 2?", "/exit"])
    with pytest.raises(LoadFailed, match="^model folder not found: /no/such/folder$"):
        chat_loop(app, lambda prompt: next(lines))  # not caught as a failed answer: the chat ends
    assert pending.settled and not pending.ready
    assert pending.failure_message() == "model folder not found: /no/such/folder"


def test_a_load_that_fails_with_a_bug_raises_the_bug():
    load, release, _ = gated(RuntimeError("a bug"))
    pending = PendingBot(load, label="x", err=quiet())
    release.set()
    with pytest.raises(RuntimeError, match="a bug"):
        pending.bot()
    assert pending.failure_message() is None


def test_a_setting_changed_during_the_load_waits_for_the_model_and_reaches_it():
    pending, app = chat_while_loading(0.3)
    assert app.command("/set W=3 G=2") is True
    assert pending.bot().settings.window == 3 and pending.bot().session.lookahead.candidates == 2
