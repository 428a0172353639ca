"""--keep-alive durations: every one `ladechat` takes, `ladechat ps` can print."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladechat.keepalive.client import Entry, table
from ladechat.keepalive.runtime import FOREVER, LONGEST, Paths, format_duration, parse_duration


@pytest.mark.parametrize("text,seconds", [("5m", 300.0), ("1h30m", 5400.0), ("0", 0.0), ("-1", FOREVER),
                                          ("3650d", 3650 * 86400.0), ("3651d", FOREVER),
                                          ("99999999999999999999d", FOREVER), ("9" * 400, FOREVER)])
def test_durations_past_ten_years_are_forever(text, seconds):
    assert parse_duration(text) == seconds


@given(st.integers(0, 10**30), st.sampled_from(["", "s", "m", "h", "d"]))
def test_every_accepted_duration_prints_in_ps(amount, unit):
    seconds = parse_duration(f"{amount}{unit}")
    assert seconds == FOREVER or 0 <= seconds <= LONGEST
    now = 1_800_000_000.0
    info = {"model": "m", "device": "cpu", "memory": 1, "pid": 1, "options_text": "",
            "idle_until": None if seconds == FOREVER else now + seconds}
    rows = table([Entry(Paths(None, "k"), {}, info)], now=now)
    assert len(rows) == 2 and ("forever" in rows[1] or format_duration(round(seconds)) in rows[1])


def test_ps_prints_a_server_whose_end_no_clock_can_say():
    info = {"model": "m", "device": "cpu", "memory": 1, "pid": 1, "options_text": "", "idle_until": 1e300}
    assert "forever" in table([Entry(Paths(None, "k"), {}, info)], now=0.0)[1]


def test_a_warm_server_that_fails_while_loading_again_keeps_the_question(monkeypatch):
    """The warm server gone before an answer began, and failing as it is started again (stopped or
    killed while loading): the chat hears a ServerFailure, which keeps the question for /retry,
    not a plain error that drops it (after which /retry would answer the question before it)."""
    import pytest as _pytest

    from ladechat.backends.base import ServerFailure
    from ladechat.backends.remote import RemoteBot
    from ladechat.keepalive import client
    from ladechat.keepalive.runtime import WarmError

    def gone(self, conversation):
        raise ServerFailure("the connection to the warm server broke")
        yield  # a generator, as RemoteBot.reply is

    def fails(*args, **kwargs):
        raise WarmError("the warm server for the embedded model ended while loading it (killed by SIGKILL)")

    monkeypatch.setattr(RemoteBot, "reply", gone)
    monkeypatch.setattr(client, "ensure", fails)
    bot = object.__new__(client.WarmBot)
    paths = type("P", (), {"root": None})()
    bot.notices, bot.keep_alive, bot.progress, bot.client = [], 300.0, None, None
    bot.warm = type("W", (), {"spec": None, "paths": paths})()
    with _pytest.raises(ServerFailure, match="ended while loading it") as raised:
        list(bot._reply(None))
    assert raised.value.retry
