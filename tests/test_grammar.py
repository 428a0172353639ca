"""Answers held to JSON and to JSON schemas (engine/grammar.py, Settings.format): the matcher's cheap
check agrees with its mask, greedy answers are the same tokens with lookahead on and off and are
documents of their schema, sampling stays inside the grammar, and what cannot be held to is one
line (ask) or a 400 naming the field (serve)."""

import json
import os
import random
import subprocess

import httpx
import openai
import pytest
from conftest import PATIENCE_S, ladechat_bin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import Server

from ladechat.backends.local import Bot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.engine.grammar import GrammarError, GrammarTokenizer, schema_of
from ladechat.engine.step_cost import CostModel
from ladechat.settings import Settings

MODEL = "SmolLM2-135M-Instruct"  # the embedded model, as a server names it
FLAT = CostModel({192: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.2}})  # steps of many rows
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}


def answer(loaded, text: str, **values) -> Done:
    bot = Bot(loaded, Settings(store=False, **values), step_cost=FLAT)
    conversation = Conversation(messages=[{"role": "user", "content": text}])
    return next(event for event in bot.reply(conversation) if isinstance(event, Done))


def conforms(value, schema: dict) -> bool:
    """Whether `value` is a document of `schema` (the keywords the schemas here use)."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        properties = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(properties))
                and all(conforms(value[k], properties[k]) for k in value if k in properties))
    if kind == "array":
        return isinstance(value, list) and all(conforms(v, schema["items"]) for v in value) \
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    return isinstance(value, bool)


def test_the_matchers_cheap_check_is_its_mask(embedded_fp32):
    """allows(token), which validates one token, says what the whole mask says, along random walks
    through a schema's documents (and at their end, where only EOS may follow)."""
    loaded = embedded_fp32
    vocab = loaded.model.config.vocab_size
    tokens = GrammarTokenizer.of(loaded.tokenizer, vocab, loaded.eos_ids)
    grammar = tokens.grammar(json.dumps(PERSON))
    rng = random.Random(3)
    for _ in range(3):
        matcher = tokens.matcher(grammar, loaded.eos_ids)
        for _ in range(60):
            allowed = matcher.allowed()
            ids = allowed.nonzero().flatten().tolist()
            assert ids, "a grammar state with no token allowed"
            for token in ids[:50] + rng.sample(range(vocab), 200) + sorted(loaded.eos_ids):
                assert matcher.allows(token) == bool(allowed[token]), token
            choice = rng.choice(ids)
            if choice in loaded.eos_ids:
                assert matcher.complete
                break
            matcher.consume([choice])


def test_greedy_documents_are_the_same_tokens_with_lookahead_on_and_off(embedded_fp32):
    question = "Describe a fictional programmer as JSON: name, age and the languages they use."
    for values in ({"format": "json"}, {"format": json.dumps(PERSON)}):
        off = answer(embedded_fp32, question, lookahead=False, max_new_tokens=96, **values)
        on = answer(embedded_fp32, question, lookahead=True, window=3, ngram=3, candidates=3, max_new_tokens=96,
                    **values)
        assert on.text_tokens == off.text_tokens and on.stats.finish_reason == off.stats.finish_reason == "eos"
        document = json.loads(on.text)
        assert conforms(document, schema_of(values["format"]))
        assert on.stats.steps < off.stats.steps  # lookahead took several tokens in some steps


def schemas():
    """Small JSON schemas of the kinds programs ask for: nested objects, enums, arrays of records."""
    # bounded strings and arrays: a small model can ramble inside an unbounded one past any budget
    leaf = st.sampled_from([{"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "boolean"},
                            {"type": "number"}, {"enum": ["red", "green", "blue"]}])
    names = st.sampled_from(["id", "title", "count", "done", "color", "score", "tags", "owner"])

    def objects(children):
        return st.dictionaries(names, children, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})

    return st.recursive(leaf, lambda children: objects(children) | st.builds(
        lambda items: {"type": "array", "items": items, "minItems": 1, "maxItems": 3}, children), max_leaves=5).filter(
        lambda s: s.get("type") == "object")


WHOLE: list[bool] = []  # per generated schema: whether its answer ended as a whole document


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(schema=schemas())
def test_every_answer_is_a_document_of_its_schema(embedded_fp32, schema):
    done = answer(embedded_fp32, "Fill in this form with made-up values.", format=json.dumps(schema),
                  max_new_tokens=200, lookahead=True, stop=["}"])  # a stop string in the document: not applied
    WHOLE.append(done.stats.finish_reason == "eos")
    if done.stats.finish_reason == "length":  # cut short: said so, and it is a prefix the grammar allowed
        return
    assert done.stats.finish_reason == "eos"
    assert conforms(json.loads(done.text), schema), done.text


def test_most_generated_schemas_got_a_whole_document():
    """The test above checks only documents that ended: most of its answers must have."""
    assert len(WHOLE) == 8 and sum(WHOLE) >= 6, WHOLE


def test_sampling_stays_inside_the_grammar(embedded_fp32):
    whole = 0
    for seed in (1, 2, 3):
        done = answer(embedded_fp32, "Describe a fictional programmer as JSON.", format=json.dumps(PERSON),
                      temperature=1.0, seed=seed, max_new_tokens=120, lookahead=True)
        if done.stats.finish_reason == "eos":
            assert conforms(json.loads(done.text), PERSON)
            whole += 1
    assert whole >= 2


def test_formats_that_cannot_be_held_to_are_one_line(embedded_fp32):
    with pytest.raises(Exception, match="answer format is neither 'json' nor a JSON schema"):
        Settings(format="yaml")
    with pytest.raises(GrammarError, match="JSON schema cannot be used"):
        Bot(embedded_fp32, Settings(format=json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})))
    bot = Bot(embedded_fp32, Settings(store=False))
    with pytest.raises(GrammarError, match="JSON schema cannot be used"):
        bot.configure(Settings(format=json.dumps({"type": "integer", "minimum": "ten"})))
    assert bot.settings.format is None  # refused: nothing changed


def ladechat(*args, stdin=None):
    return subprocess.run([ladechat_bin(), *args], input=stdin, capture_output=True, timeout=PATIENCE_S, text=True,
                          check=False, env={**os.environ, "NO_COLOR": "1"})


def test_ask_prints_one_document_and_says_when_it_was_cut(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    common = ("--keep-alive", "0", "--dtype", "float32", "--no-store")
    done = ladechat("ask", "Describe a fictional programmer.", "--json-schema", str(schema), "--max-new-tokens", "96",
                    *common)
    assert done.returncode == 0, done.stderr
    assert conforms(json.loads(done.stdout), PERSON)
    cut = ladechat("ask", "Describe a fictional programmer.", "--format", "json", "--max-new-tokens", "5", *common)
    assert cut.returncode == 1 and cut.stderr.strip().splitlines()[-1] == (
        "ladechat: error: the answer reached its 5 tokens (--max-new-tokens) before its JSON document was complete: "
        "what was printed is not a whole document")
    for flags, message in ((("--format", "yaml"), "--format must be json, got 'yaml'"),
                           (("--json-schema", str(tmp_path / "missing.json")), "--json-schema: no such file"),
                           (("--json-schema", "{nope"), "--json-schema: the schema is not valid JSON"),
                           (("--format", "json", "--json-schema", "{}"), "cannot go together"),
                           (("--json-schema", '{"type": "nonsense"}'), "the JSON schema cannot be used")):
        bad = ladechat("ask", "hi", *flags, *common)
        err = bad.stderr.strip()
        assert bad.returncode == 1 and message in err and "Traceback" not in err and "\n" not in err, (flags, err)


@pytest.mark.slow
def test_serve_takes_response_format_and_refuses_what_it_cannot_hold_to():
    server = Server("--dtype", "float32", "--no-store")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=96, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert reply.choices[0].finish_reason == "stop" and conforms(json.loads(reply.choices[0].message.content), PERSON)
        short = [{"role": "user", "content": 'Answer in JSON: {"capital": ...} for France.'}]
        streamed = client.chat.completions.create(model=MODEL, messages=short, max_tokens=64, temperature=0,
                                                  response_format={"type": "json_object"}, stream=True)
        chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
        assert chunks[-1].finish_reason == "stop"
        assert isinstance(json.loads("".join(chunk.delta.content or "" for chunk in chunks)), dict)
        cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                             response_format={"type": "json_object"})
        assert cut.choices[0].finish_reason == "length"
        for fmt, param in (({"type": "xml"}, "response_format.type"),
                           ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
                           ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                            "response_format")):
            for stream in (False, True):  # refused before a stream begins
                r = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": messages,
                                                                       "response_format": fmt, "stream": stream},
                               timeout=PATIENCE_S)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        server.stop()


def test_a_client_sends_the_format_as_openais_response_format():
    """--api (and ask through a warm server): the format setting goes out as response_format."""

    from ladechat.backends.remote import Endpoint, RemoteBot

    card = {"id": MODEL, "object": "model", "owned_by": "someone"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"object": "list", "data": [card]}))
    conversation = Conversation(messages=[{"role": "user", "content": "hi"}])
    for answer_format, sent in (("json", {"type": "json_object"}),
                                (json.dumps(PERSON), {"type": "json_schema", "json_schema": {
                                    "name": "answer", "schema": PERSON}})):
        remote = RemoteBot(Endpoint.of("http://127.0.0.1:9/v1", None), None, {"format": answer_format}, {"format"},
                           client=httpx.Client(transport=transport))
        assert remote.request_body(conversation)["response_format"] == sent
    plain = RemoteBot(Endpoint.of("http://127.0.0.1:9/v1", None), None, {}, set(), client=httpx.Client(transport=transport))
    assert "response_format" not in plain.request_body(conversation)
    plain.configure(plain.settings.updated({"format": "json"}))
    plain.configure(plain.settings.updated({"format": None}))  # /format off: the server's own format off too
    assert plain.request_body(conversation)["response_format"] == {"type": "text"}


def test_the_chat_formats_its_next_answers(embedded_fp32, tmp_path):
    import io

    from rich.console import Console

    from ladechat.ui.chat import ChatApp

    err = io.StringIO()
    app = ChatApp(Bot(embedded_fp32, Settings(store=False, max_new_tokens=96)), None, False, Console(file=io.StringIO()),
                  Console(file=err, width=300))
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    app.command(f"/format {schema}")
    app.ask("Describe a fictional programmer.")
    assert conforms(json.loads(app.conversation.messages[-1]["content"]), PERSON)
    app.command("/format json")
    assert app.bot.settings.format == "json"
    app.command(f"/format {tmp_path / 'missing.json'}")
    app.command("/format")
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "no such file" in errors[0] and "usage: /format json|off|SCHEMA.json" in errors[1]
    assert app.bot.settings.format == "json"  # refused: as it was
    app.command("/format off")
    assert app.bot.settings.format is None


def test_drafts_hold_to_the_grammar_and_propose_what_it_forces(embedded_fp32):
    """Under a schema every node fed is one the grammar allows (keep_valid), the keys and punctuation
    it forces are proposed as drafts of their own ("grammar") and accepted, and the answer is plain
    decoding's."""
    from ladechat.engine.draft.tree import Acceptance, DraftTree

    tree = DraftTree(Acceptance())
    tree.add_chain((5, 6, 7), "context", 3)
    tree.add_chain((5, 9), "context", 3)
    tree.add_chain((8,), "context", 3)
    tree.keep_valid(lambda path: len(path) if path[:2] != [5, 6] and path != [8] else (1 if path[0] == 5 else 0))
    assert [(n.token, n.parent) for n in tree.nodes] == [(5, -1), (9, 0)]
    question = "Describe a fictional programmer as JSON: name, age and the languages they use."
    on = answer(embedded_fp32, question, lookahead=True, max_new_tokens=96, format=json.dumps(PERSON))
    off = answer(embedded_fp32, question, lookahead=False, max_new_tokens=96, format=json.dumps(PERSON))
    assert on.text_tokens == off.text_tokens
    _, seen = on.stats.calibration["grammar"]
    assert seen >= 3  # '{"name":"', '","age":', ... taken as drafts


def test_a_request_sets_or_clears_the_servers_format():
    from ladechat.serve.wire import parse_request, settings_of

    def request(**extra):
        return parse_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}).encode())

    served = Settings(format="json")
    assert settings_of(served, request()).format == "json"  # the server's own
    assert settings_of(served, request(response_format={"type": "text"})).format is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wanted = request(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert json.loads(settings_of(Settings(), wanted).format) == schema
