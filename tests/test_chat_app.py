"""The chat's conversation handling in-process: context overflow, corrupt /load files."""

import io
import json
from dataclasses import replace

import pytest
from rich.console import Console
from tiny_models import tiny_loaded

from ladechat.backends.local import Bot
from ladechat.conversation import Conversation, ConversationError
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp


def chat_app(loaded, system=None, max_new_tokens=24):
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=max_new_tokens)
    err = io.StringIO()
    return ChatApp(Bot(loaded, settings), system, False, Console(file=io.StringIO()), Console(file=err, width=300)), err


def test_overflowing_conversation_drops_oldest_turns_with_a_notice(embedded_fp32):
    small = replace(embedded_fp32, context_length=160)  # the same model, told its context is 160 tokens
    app, err = chat_app(small, system="You are a helpful assistant.")
    questions = [f"Question {i}: name a fruit that is {colour}." for i, colour in
                 enumerate(["red", "yellow", "green", "orange", "purple"])]
    for q in questions:
        app.ask(q)
    screen = err.getvalue()
    assert "notice: the conversation no longer fits the model's context: dropped the oldest 2 messages" in screen
    messages = app.conversation.messages
    assert app.conversation.system == "You are a helpful assistant."  # never dropped
    assert messages[-2]["content"] == questions[-1] and messages[-1]["role"] == "assistant"
    assert messages[0]["content"] != questions[0]  # the oldest exchange is gone
    assert len(messages) < 2 * len(questions)


def test_corrupt_or_foreign_load_keeps_the_current_conversation(embedded_fp32, tmp_path):
    app, err = chat_app(embedded_fp32)
    app.ask("What is the capital of France?")
    before = [dict(m) for m in app.conversation.messages]
    bad = {
        "corrupt.json": '{"format": "ladechat-conversation", "messages": [',
        "foreign.json": json.dumps({"hello": "world"}),
        "malformed.json": json.dumps({"format": "ladechat-conversation", "messages": [{"role": "wizard"}]}),
        "badsettings.json": json.dumps({"format": "ladechat-conversation", "messages": [], "settings": {"N": 0}}),
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        assert app.command(f"/load {tmp_path / name}") is True
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    app.command(f"/load {tmp_path / 'binary.json'}")
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert len(lines) == 5, lines
    assert "cannot read" in lines[0] and "is not a ladechat conversation file" in lines[1]
    assert "malformed message list" in lines[2] and "bad settings" in lines[3] and "cannot read" in lines[4]
    assert app.conversation.messages == before
    assert app.bot.settings.ngram == 3


def tiny_chat(context_length=1024, max_new_tokens=8, **sampling):
    """A chat on a tiny random Llama (fast: no embedded model)."""
    loaded = tiny_loaded(context_length)
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=max_new_tokens, **sampling)
    err = io.StringIO()
    return ChatApp(Bot(loaded, settings), None, False, Console(file=io.StringIO()), Console(file=err, width=300)), err


def error_lines(err) -> list[str]:
    return [line for line in err.getvalue().splitlines() if line.startswith("error:")]


def conversation_file(path, messages, settings):
    path.write_text(json.dumps({"format": "ladechat-conversation", "version": 1, "model": "tiny", "system": None,
                                "messages": messages, "settings": settings}))
    return path


@pytest.mark.parametrize("settings,message", [
    ({"W": 2.5}, "W (window) must be a whole number, got 2.5"),
    ({"seed": "x"}, "seed must be a whole number, got 'x'"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"lookahead": "yes"}, "lookahead must be true or false, got 'yes'"),
    ({"stop": "x"}, "stop must be a list of strings, got 'x'"),
    ({"template": "nope"}, "unknown template 'nope'"),
])
def test_load_refuses_settings_of_the_wrong_type(tmp_path, settings, message):
    app, err = tiny_chat()
    app.ask("hi")
    before = [dict(m) for m in app.conversation.messages]
    path = conversation_file(tmp_path / "c.json", [{"role": "user", "content": "other"}], settings)
    assert app.command(f"/load {path}") is True
    assert len(error_lines(err)) == 1 and message in error_lines(err)[0]
    assert app.conversation.messages == before and app.bot.settings.window == 2
    app.ask("and now?")  # the chat goes on with its own settings
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2


def test_save_and_load_keep_stop_and_template(tmp_path):
    app, _ = tiny_chat(stop=("\n\n", "END"))
    app.command("/set w=3 seed=5")
    app.command("/set template=chatml")
    app.ask("hi")
    app.command(f"/save {tmp_path / 'c.json'}")
    saved = json.loads((tmp_path / "c.json").read_text())["settings"]
    assert saved["stop"] == ["\n\n", "END"] and saved["template"] == "chatml"
    fresh, fresh_err = tiny_chat()
    fresh.command(f"/load {tmp_path / 'c.json'}")
    assert error_lines(fresh_err) == []
    assert fresh.bot.settings == app.bot.settings
    assert fresh.conversation.chat_messages() == app.conversation.chat_messages()


@pytest.mark.parametrize("messages,undone,info", [
    ([{"role": "assistant", "content": "Hello!"}], [], "dropped the last answer"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "dropped the last answer"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [],
     "dropped the last question and its answer"),
    ([{"role": "user", "content": "a"}], [], "dropped the last question"),
])
def test_undo_and_retry_after_loading_an_unusual_conversation(tmp_path, messages, undone, info):
    """A loaded file need not alternate user/assistant; /undo and /retry must not crash on it."""
    app, err = tiny_chat()
    path = conversation_file(tmp_path / "c.json", messages, {})
    app.command(f"/load {path}")
    assert app.command("/undo") is True
    assert error_lines(err) == [] and err.getvalue().splitlines()[-1] == info
    assert app.conversation.chat_messages() == undone


def test_retry_without_a_question_is_refused(tmp_path):
    app, err = tiny_chat()
    app.command(f"/load {conversation_file(tmp_path / 'c.json', [{'role': 'assistant', 'content': 'Hi!'}], {})}")
    assert app.command("/retry") is True
    assert error_lines(err) == ["error: nothing to retry: there is no question to answer again"]
    assert app.conversation.chat_messages() == [{"role": "assistant", "content": "Hi!"}]
    app.command("/undo")
    assert app.command("/undo") is True and error_lines(err)[-1] == "error: nothing to undo"


def test_question_longer_than_the_context_keeps_the_earlier_conversation():
    app, err = tiny_chat(context_length=200)  # one token per character: room for 192 prompt tokens
    app.ask("hi")
    app.ask("and?")
    before = [dict(m) for m in app.conversation.messages]
    app.ask("x" * 300)
    message = "the prompt is 317 tokens, more than the 192 that fit in the model's context (after room for the answer)"
    assert error_lines(err) == [f"error: {message}"]
    assert app.conversation.messages == before  # only the too-long question is gone
    app.ask("ok")  # and the chat goes on with the earlier turns
    assert app.conversation.messages[:4] == before and len(app.conversation.messages) == 6


def test_encode_changes_nothing_when_the_last_message_alone_does_not_fit():
    loaded = tiny_loaded()
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c" * 100}]
    conversation = Conversation(system="s", messages=[dict(m) for m in messages])
    with pytest.raises(ConversationError, match="more than the 50 that fit"):
        conversation.encode(loaded.tokenizer, None, 50)
    assert conversation.messages == messages
    ids, dropped = conversation.encode(loaded.tokenizer, None, 130)  # fits once the first exchange is gone
    assert dropped == 2 and conversation.messages == messages[2:] and len(ids) <= 130


def fewest_dropped(conversation: Conversation, tokenizer, budget: int):
    """What encode must return: the first start, exchange by exchange from the oldest, whose prompt fits."""
    from ladechat import templates
    from ladechat.conversation import oldest_exchange

    start = 0
    while True:
        ids = templates.encode(tokenizer, conversation._chat_messages(start), None)
        if len(ids) <= budget:
            return ids, start
        if len(conversation.messages) - start <= 1:
            return None, None
        start += oldest_exchange(conversation.messages[start:])


def test_encode_drops_the_fewest_turns_without_encoding_the_whole_transcript(monkeypatch):
    """Random conversations (exchanges, questions without answers, long and short messages), many
    budgets: encode drops exactly the turns the exchange-by-exchange search drops, and never encodes
    more than a context's worth of messages at once, nor more than a few dozen times."""
    import random

    from ladechat import templates

    tokenizer = tiny_loaded().tokenizer
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "  padded  ", "<|im_end|>", "x" * 40]
    real_encode, calls = templates.encode, []
    monkeypatch.setattr(templates, "encode", lambda tok, messages, template, tools=None: calls.append(len(messages))
                        or real_encode(tok, messages, template, tools))
    for trial in range(60):
        messages = []
        for _ in range(rng.randint(1, 120)):
            role = "user" if not messages or messages[-1]["role"] == "assistant" or rng.random() < 0.1 else "assistant"
            messages.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": "and?"})
        budget = rng.choice([20, 60, 150, 400, 2000])
        want_ids, want_start = fewest_dropped(Conversation(system="s", messages=list(messages)), tokenizer, budget)
        conversation = Conversation(system="s", messages=list(messages))
        calls.clear()
        if want_ids is None:
            with pytest.raises(ConversationError, match="that fit in the model's context"):
                conversation.encode(tokenizer, None, budget)
            assert conversation.messages == messages
            continue
        ids, dropped = conversation.encode(tokenizer, None, budget)
        assert (ids, dropped) == (want_ids, want_start), trial
        assert conversation.messages == messages[want_start:] and conversation.dropped == messages[:want_start]
        assert len(calls) <= 2 * len(messages).bit_length() + 3, (trial, calls)
        # no call encodes much past what fits: the messages kept, and the few just before them
        assert max(calls) <= 2 * (len(messages) - want_start) + 12, (trial, calls, want_start)
    # a transcript of thousands of exchanges: a handful of encodings of about what fits
    long = [{"role": role, "content": f"message {i} " + "word " * (i % 7)}
            for i, role in zip(range(6001), ["user", "assistant"] * 3001)]
    conversation = Conversation(messages=list(long))
    calls.clear()
    ids, dropped = conversation.encode(tokenizer, None, 300)
    assert len(ids) <= 300 and conversation.messages == long[dropped:] and len(calls) <= 30
    assert max(calls) <= 2 * (len(long) - dropped) + 12


def test_store_command_toggles_and_clears_the_store(tmp_path):
    """/store off: answers are neither drafted from nor added to the store; /store on adds them
    (to the file under the store folder); /store clear forgets them, on disk too."""
    from ladechat.engine.draft.store import list_stores

    loaded = tiny_loaded()
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=8)
    err = io.StringIO()
    app = ChatApp(Bot(loaded, settings, store_root=tmp_path), None, False, Console(file=io.StringIO()),
                  Console(file=err, width=300))
    app.command("/store off")
    app.ask("hello")
    assert list_stores(tmp_path) == [] and not app.bot.settings.store
    app.command("/store on")
    app.ask("hello again")
    app.ask("and again")
    assert list_stores(tmp_path)[0].answers == 2
    app.command("/show")
    app.command("/store clear")
    assert list_stores(tmp_path) == []
    app.command("/store maybe")
    screen = err.getvalue()
    assert "store of past answers off from the next answer" in screen
    assert "store of past answers on" in screen and "store cleared: 2 past answers forgotten" in screen
    assert "error: usage: /store on|off|clear" in screen
    app.ask("after clearing")  # the store is usable again after clear
    assert list_stores(tmp_path)[0].answers == 1
    app.command("/set store=off")  # /set reaches it too
    app.ask("not stored")
    assert not app.bot.settings.store and list_stores(tmp_path)[0].answers == 1


def test_model_command_keeps_the_old_model_when_the_new_one_cannot_be_opened():
    from ladechat.errors import UserError

    app, err = tiny_chat()
    app.ask("hi")
    old = app.bot
    other = Bot(tiny_loaded(512), Settings(window=2, ngram=3, candidates=1, max_new_tokens=4))
    opened = {"missing": UserError("model folder not found: missing"), "huge": MemoryError()}

    def switch(name):
        if name in opened:
            raise opened[name]
        return other

    app.switch = switch
    app.command("/model missing")
    app.command("/model huge")
    assert error_lines(err) == [
        f"error: /model missing: model folder not found: missing; the chat goes on with {old.describe()}",
        f"error: /model huge: not enough memory to load it; the chat goes on with {old.describe()}"]
    assert app.bot is old
    app.command("/model other")
    assert app.bot is other and "now answering with" in err.getvalue().splitlines()[-1]
    app.ask("and now?")
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2
    app.switch = None
    app.command("/model x")
    assert error_lines(err)[-1] == "error: /model: this chat cannot open another model"


def test_every_command_is_one_entry_of_the_table_with_its_help_and_completion(tmp_path):
    """The table is the one place a command is named: /help has a line per entry, Tab offers
    every name (aliases too) and a file's path after a command that takes one, an unknown name is
    refused, and each name runs its own handler (/quit leaves as /exit does)."""
    from prompt_toolkit.completion import CompleteEvent, WordCompleter
    from prompt_toolkit.document import Document

    from ladechat.ui.chat import COMMANDS, _chat_completer

    app, err = tiny_chat()
    app.command("/help")
    shown = err.getvalue().splitlines()
    for entry in COMMANDS.entries:
        assert any(line.startswith(f"{entry.name} {entry.args}".rstrip() + " ") for line in shown), entry.name
    assert len({e.name for e in COMMANDS.entries}) == len(COMMANDS.entries)
    assert shown[-1] == "Tab completes the commands, and a file's path after /format, /model, /read, /save, /load."
    assert app.command("/QUIT") is False and app.command("/exit") is False
    app.command("/frobnicate now")
    assert error_lines(err)[-1] == "error: unknown command /frobnicate (try /help)"

    (tmp_path / "notes.txt").write_text("x")
    completer = _chat_completer(WordCompleter(COMMANDS.names(), sentence=True, match_middle=False))

    def offered(text):
        return {c.text for c in completer.get_completions(Document(text, len(text)), CompleteEvent())}

    assert offered("/qu") == {"/quit"} and offered("/s") == {"/store", "/set", "/show", "/stats", "/system", "/save"}
    for name in ("/read", "/model", "/save", "/load"):
        assert offered(f"{name} {tmp_path}/no") == {"tes.txt"}, name
    assert offered(f"/system {tmp_path}/no") == set()


def test_a_new_conversation_answers_as_a_fresh_bot_and_the_bench_answers_as_the_chat(embedded_fp32):
    """Bot.new_conversation forgets what earlier answers taught the drafts (the same steps as a new
    Bot, with the step costs fixed), and the bench's answer to an item is the chat's, step for step."""
    from ladechat.bench.prompts import answer_item
    from ladechat.engine.events import Done
    from ladechat.engine.step_cost import CostModel

    flat = CostModel({192: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08}})
    settings = Settings(store=False, max_new_tokens=40)
    first, second = {"turns": ["Write a Python function that adds two numbers."]}, \
        {"turns": ["Write a Python function that multiplies two numbers.", "Now add a docstring."]}

    def fresh():
        return Bot(embedded_fp32, settings, step_cost=flat)

    used = fresh()
    answer_item(used, first)
    again = answer_item(used, second)
    alone = answer_item(fresh(), second)
    assert again[0] == alone[0] and again[2] == alone[2] and again[3] == alone[3]  # ids, steps, accepted by depth
    # the chat: the same conversation through Bot.reply, turn by turn
    bot, conversation, ids, steps = fresh(), Conversation(), [], 0
    for turn in second["turns"]:
        conversation.messages.append({"role": "user", "content": turn})
        done = next(e for e in bot.reply(conversation) if isinstance(e, Done))
        ids, steps = ids + list(done.text_tokens), steps + done.stats.steps
        conversation.messages.append({"role": "assistant", "content": done.text})
    assert (ids, steps) == (alone[0], alone[2])
