"""Property-based: no input a user can give ends in a traceback. Random sequences of messages and
slash commands against the chat (a tiny model, in-process), random /load files, random flag values
for chat, ask and bench (the real `main()`, in-process, stopped at the model load). The invariant:
a one-line error, and the conversation before the bad input intact."""

import contextlib
import io
import json
import string
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from rich.console import Console
from tiny_models import tiny_loaded

from ladechat import templates
from ladechat.backends.local import Bot
from ladechat.cli import main
from ladechat.engine import kv
from ladechat.settings import Settings, set_keys
from ladechat.ui.chat import ChatApp, chat_loop

FEW = hyp_settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOADED = tiny_loaded(context_length=96)  # one token per character: a 100-character question overflows
# (a small context also keeps every answer short: at most half of it)

# -- values a user might type ---------------------------------------------------------------------
numbers = st.one_of(st.integers(-5, 300), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["0", "-1", "1e-300", "1e308", "nan", "inf", "2.5", "0x10", "", "none"]))
junk = st.text(string.printable, max_size=12)
set_values = st.one_of(numbers.map(str), junk, st.sampled_from(["on", "off", "chatml", "nope", "none"]))
set_items = st.tuples(st.one_of(st.sampled_from(set_keys()), st.sampled_from(["stop", "colour", "W", ""])),
                      set_values).map(lambda kv_: f"{kv_[0]}={kv_[1]}")
messages = st.one_of(st.text(string.ascii_letters + " ?.,!", min_size=1, max_size=20),
                     st.just("x" * 100),  # longer than the context: refused, the earlier turns kept
                     st.text(max_size=30))  # any unicode, including control characters
commands = st.one_of(
    st.sampled_from(["/undo", "/retry", "/clear", "/show", "/stats", "/help", "/lookahead on", "/lookahead off",
                     "/lookahead maybe", "/debug on", "/debug off", "/markdown off", "/system Be brief.", "/system",
                     "/nope", "/save", "/load", "/set", "/load /no/such/file.json", "/save /no/such/dir/c.json"]),
    st.lists(set_items, min_size=1, max_size=3).map(lambda items: "/set " + " ".join(items)),
    st.text(max_size=20).map(lambda text: "/" + text),
)


# -- files /load might meet -------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=6)
saved_settings = st.dictionaries(st.one_of(st.sampled_from(["W", "N", "G", "lookahead", "context_candidates",
                                                            "context_len", "recycle", "max_new_tokens", "temperature",
                                                            "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                                            "stop", "template"]), st.text(max_size=5)),
                                 json_values, max_size=4)
saved_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3]),
                                                 "content": st.one_of(st.text(max_size=20), json_values)}),
                          max_size=4)


@st.composite
def conversation_files(draw) -> bytes:
    data = {"format": draw(st.sampled_from(["ladechat-conversation", "other", 1])), "version": 1,
            "model": "tiny", "system": draw(st.one_of(st.none(), st.text(max_size=10), json_values)),
            "messages": draw(saved_messages), "settings": draw(st.one_of(saved_settings, json_values))}
    text = json.dumps(data).encode()
    kind = draw(st.sampled_from(["whole", "truncated", "binary", "huge", "any json"]))
    if kind == "truncated":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if kind == "binary":
        return draw(st.binary(max_size=64))
    if kind == "huge":  # a 200 kB message: loads, and is dropped when the next question needs room
        return json.dumps({**data, "messages": [{"role": "user", "content": "y" * 200_000}]}).encode()
    if kind == "any json":
        return json.dumps(draw(json_values)).encode()
    return text


# -- the chat ---------------------------------------------------------------------------------------
def new_chat() -> tuple[ChatApp, io.StringIO]:
    err = io.StringIO()
    app = ChatApp(Bot(LOADED, Settings(window=2, ngram=3, candidates=1, max_new_tokens=6)), None, False,
                  Console(file=io.StringIO()), Console(file=err, width=10_000))
    return app, err


def send(app: ChatApp, line: str) -> None:
    """One line through the chat's own loop (as typed at its prompt), then end of input."""
    lines = iter([line])
    chat_loop(app, lambda prompt: next(lines, None))


def check_consistent(app: ChatApp) -> None:
    for m in app.conversation.messages:
        assert m["role"] in ("user", "assistant") and isinstance(m["content"], str)
    session = app.bot.session
    assert kv.cache_length(session.runner.cache) == len(session.cached) <= LOADED.context_length
    assert Settings.parse(app.bot.settings.as_dict()) == app.bot.settings  # still a valid, savable whole


def snapshot(app: ChatApp):
    return [dict(m) for m in app.conversation.messages], app.conversation.system, app.bot.settings


@FEW
@given(st.lists(st.one_of(messages, commands), min_size=1, max_size=8))
# values that once reached torch: logits / 1e-300 overflow, a seed beyond 64 bits, a float W
@example(["/set temperature=1e-300", "hi"])
@example(["/set temperature=1 repetition_penalty=1e-300", "hi", "/retry"])
@example(["/set temperature=1 seed=99999999999999999999999", "hi"])
@example(["/set w=2.0", "hi", "/undo", "/undo", "/retry"])
def test_random_messages_and_commands(inputs):
    app, err = new_chat()
    for line in inputs:
        before, seen = snapshot(app), len(err.getvalue())
        send(app, line)  # an exception escaping here is the traceback a user would see
        new = err.getvalue()[seen:].splitlines()
        errors = [text for text in new if text.startswith("error:")]
        assert len(errors) <= 1, new
        if errors and not line.lstrip().startswith("/retry"):
            assert snapshot(app) == before, (line, errors)  # a refused input changes nothing
        check_consistent(app)


@FEW
@given(conversation_files())
def test_random_load_files(content):
    app, err = new_chat()
    send(app, "hello")
    before = snapshot(app)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.json"
        path.write_bytes(content)
        send(app, f"/load {path}")
    lines = err.getvalue().splitlines()
    if lines[-1].startswith("error:"):
        assert snapshot(app) == before and sum(line.startswith("error:") for line in lines) == 1
    else:
        assert lines[-1].startswith("loaded ")
        saved = json.loads(content)
        assert [m["content"] for m in app.conversation.messages] == [m["content"] for m in saved["messages"]]
    check_consistent(app)
    send(app, "and now?")  # the chat goes on either way
    check_consistent(app)


def test_a_question_longer_than_the_context_after_a_huge_load(tmp_path):
    app, err = new_chat()
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "ladechat-conversation", "messages": [
        {"role": "user", "content": "y" * 200_000}, {"role": "assistant", "content": "ok"}]}))
    send(app, f"/load {path}")
    send(app, "hi")  # the huge turn is dropped to make room, with a notice
    assert "dropped the oldest 2 messages" in err.getvalue()
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]


# -- the command line -------------------------------------------------------------------------------
def run_main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code, out.getvalue(), err.getvalue()


SETTING_FLAGS = ["-W", "-N", "-G", "--context-candidates", "--context-len", "--recycle", "--max-new-tokens", "-t",
                 "--top-p", "--top-k", "--seed", "--template"]  # the bench's
CHAT_FLAGS = SETTING_FLAGS + ["--stop", "--min-p", "--repetition-penalty", "--dtype", "--device", "--attn"]
flag_values = st.one_of(numbers.map(str), junk, st.sampled_from(["auto", "cpu", "cuda:7", "chatml", "sdpa"]))
NO_MODEL = ["--model", "/no/such/model/folder"]


def one_line_error(code: int, err: str) -> str:
    assert code in (1, 2), err
    assert err.count("\n") == 1 and err.startswith("ladechat: error: ") and "Traceback" not in err, err
    return err


def command_line(command: str, flags: list[tuple[str, str]], data: Path) -> list[str]:
    args = {"chat": [], "ask": ["ask", "hi"], "bench": ["bench", "--dataset", str(data), "--methods", "plain"]}[command]
    return args + NO_MODEL + [part for flag, value in flags for part in (flag, value)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "set.jsonl"
    path.write_text('{"turns": ["Hello"]}\n')
    return path


@hyp_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["chat", "ask", "bench"]), st.lists(st.tuples(st.sampled_from(CHAT_FLAGS), flag_values),
                                                           max_size=4))
def test_random_flag_values_are_one_line(dataset, command, flags):
    if command == "bench":
        flags = [(f, v) for f, v in flags if f in SETTING_FLAGS]
    code, out, err = run_main(command_line(command, flags, dataset))
    one_line_error(code, err)
    assert out == ""


valid_flags = st.lists(st.one_of(
    st.tuples(st.just("-W"), st.integers(1, 64)), st.tuples(st.just("-N"), st.integers(2, 16)),
    st.tuples(st.just("-G"), st.integers(0, 64)), st.tuples(st.just("--context-len"), st.integers(1, 64)),
    st.tuples(st.just("--recycle"), st.integers(0, 256)), st.tuples(st.just("--max-new-tokens"), st.integers(1, 10**6)),
    st.tuples(st.just("-t"), st.one_of(st.just(0.0), st.floats(0.01, 100))),
    st.tuples(st.just("--top-p"), st.floats(0.001, 1)), st.tuples(st.just("--seed"), st.integers(0, 2**63 - 1)),
    st.tuples(st.just("--template"), st.sampled_from(templates.names())),
    st.tuples(st.just("--stop"), st.text(string.ascii_letters, max_size=5))), max_size=5)


@hyp_settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["chat", "ask", "bench"]), valid_flags)
def test_valid_flag_values_reach_the_model_load(dataset, command, flags):
    """Values in range pass the settings check: the only error left is the missing model."""
    if command == "bench":
        flags = [(f, v) for f, v in flags if f in SETTING_FLAGS and f != "--stop"]
    code, _, err = run_main(command_line(command, [(f, str(v)) for f, v in flags], dataset))
    assert one_line_error(code, err) == "ladechat: error: model folder not found: /no/such/model/folder\n"


def test_parse_errors_and_help_in_process(dataset):
    code, _, err = run_main(["ask", "--top-k", "abc", "hi"])
    assert code == 2 and err.startswith("ladechat: error: Invalid value for '--top-k'") and err.count("\n") == 1
    code, out, _ = run_main(["ask", "--help"])
    assert code == 0 and "--context-len" in out and "--recycle" in out


def test_set_reaches_every_lookahead_key():
    app, err = new_chat()
    send(app, "/set w=3 n=4 g=2 context_candidates=1 context_len=5 recycle=7 lookahead=off template=chatml")
    s = app.bot.settings
    assert (s.window, s.ngram, s.candidates, s.context_candidates, s.context_len, s.recycle, s.lookahead,
            s.template) == (3, 4, 2, 1, 5, 7, False, "chatml")
    assert app.bot.session.lookahead == replace(s.lookahead_config())
    send(app, "/set template=nope")
    assert err.getvalue().splitlines()[-1].startswith("error: unknown template 'nope'")
    assert app.bot.settings == s
