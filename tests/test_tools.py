"""Tool calls (serve's tools / tool_choice, templates/tools.py, serve/tooling.py): a template's tool
format is known by its markup, calls are read back from an answer however its text is split,
forced calls (required, a named function) are calls to the functions given with arguments of their
schemas and the same tokens with lookahead on and off, and the openai client's tool loop runs
against the server, streamed and whole, with 400s naming the field for what cannot be done."""

import json

import httpx
import openai
import pytest
from conftest import PATIENCE_S
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_process import Server

from ladechat import templates
from ladechat.backends.local import Bot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.engine.grammar import LARK
from ladechat.engine.step_cost import CostModel
from ladechat.serve.tooling import tooling_of
from ladechat.serve.wire import ApiError, parse_request
from ladechat.settings import Settings
from ladechat.templates.tools import HERMES, LLAMA3, MISTRAL, CallReader, calls_grammar, tool_format

MODEL = "SmolLM2-135M-Instruct"
FLAT = CostModel({192: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.2}})  # steps of many rows
# Bounded strings and numbers: a forced call ends within any answer's room, whatever the model writes
# (its tokens may differ between CPU classes), so the tests assert the grammar's doing, not the model's.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -10**6, "maximum": 10**6},
                                       "b": {"type": "integer", "minimum": -10**6, "maximum": 10**6}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "The sum of two integers", "parameters": ADD}}]
LLAMA3_LIKE = ('{{- "<|start_header_id|>" }}{%- for tool_call in message.tool_calls %}{{- \'{"name": "\' + '
               'tool_call.name + \'", "parameters": \' }}{% endfor %}{{- "tools" }}')
MISTRAL_LIKE = '{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- for tool in tools %}{% endfor %}'


def test_a_template_is_known_by_the_markup_it_writes_calls_with():
    assert tool_format(templates.source("hermes")) is HERMES
    for other in ("<function=", "<arg_key>", "[ARGS]"):  # calls that are not a JSON object: refused
        assert tool_format(templates.source("hermes") + other) is None
    assert tool_format(LLAMA3_LIKE) is LLAMA3
    assert tool_format(MISTRAL_LIKE) is MISTRAL
    assert tool_format(templates.source("chatml")) is None
    assert tool_format(None) is None


def read(fmt, text: str, cuts: list[int], names=frozenset({"f", "g"})) -> tuple[str, list]:
    """text fed to a reader in pieces cut at `cuts`: (content, [(name, arguments)])."""
    reader = CallReader(fmt, names)
    at = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        reader.add(text[at:cut])
        at = cut
    reader.finish()
    return reader.content, [(call.name, call.arguments) for call in reader.calls]


HERMES_ANSWER = ('Let me look. <tool_call>\n{"name": "f", "arguments": {"x": "<tool_call>"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(HERMES_ANSWER)), max_size=12))
def test_calls_are_read_back_however_the_text_is_split(cuts):
    assert read(HERMES, HERMES_ANSWER, cuts) == ("Let me look. ", [("f", {"x": "<tool_call>"}), ("g", {})])
    llama = ' {"name": "f", "parameters": {"n": 1}}'
    assert read(LLAMA3, llama, [c % len(llama) for c in cuts]) == ("", [("f", {"n": 1})])
    mistral = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": [1]}}]'
    assert read(MISTRAL, mistral, [c % len(mistral) for c in cuts]) == ("", [("f", {}), ("g", {"y": [1]})])


def test_what_is_not_a_call_is_content_as_written():
    cut = '<tool_call>\n{"name": "f", "argu'
    assert read(HERMES, cut, [5, 20]) == (cut, [])  # cut by max_tokens inside the call
    for block in ('<tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>',  # no such function
                  '<tool_call>\nnot json\n</tool_call>', '<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>',
                  '<tool_call>\n{"name": ["f"], "arguments": {}}\n</tool_call>',
                  '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'):
        for cuts in ([3], list(range(0, 80, 3))):
            assert read(HERMES, "a " + block, cuts) == ("a " + block, [])
    good = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert read(HERMES, "<tool_call>\n{oops}\n</tool_call>" + good, [4, 30]) == ("<tool_call>\n{oops}\n</tool_call>",
                                                                              [("g", {})])
    for fmt, text in ((LLAMA3, "Hello {there}"), (LLAMA3, '{"name": "nope", "parameters": {}}'),
                      (MISTRAL, "[1, 2] is a list"), (MISTRAL, '[{"name": "f", "arguments": {}}, 5]')):
        assert read(fmt, text, [1, 4]) == (text, [])


def test_the_hermes_template_lists_tools_and_renders_calls_and_results(embedded_fp32):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo", "unit": "C"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "-3 and snowing"}]
    text = templates.render(embedded_fp32.tokenizer, messages, "hermes", TOOLS)
    assert json.dumps(TOOLS[1]) in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n-3 and snowing\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in templates.render(embedded_fp32.tokenizer, messages[:1], "hermes")


def forced(loaded, only, lookahead: bool) -> Done:
    """One call (parallel_tool_calls false): the grammar then ends the answer after it, whatever the model."""
    grammar = LARK + calls_grammar(HERMES, {"get_weather": WEATHER, "add": ADD}, only, False, {})
    settings = Settings(store=False, template="hermes", lookahead=lookahead, max_new_tokens=120)
    bot = Bot(loaded, settings.model_copy(update={"format": grammar}), step_cost=FLAT)  # as serve sets it
    conversation = Conversation(messages=[{"role": "user", "content": "What is 2 + 40, and is it warm in Rome?"}],
                                tools=TOOLS)
    return next(event for event in bot.reply(conversation) if isinstance(event, Done))


def conforms(arguments: dict, schema: dict) -> bool:
    props = schema["properties"]
    return set(arguments) == set(schema["required"]) and all(
        isinstance(arguments[k], str) and len(arguments[k]) <= props[k]["maxLength"] if props[k].get("type") == "string"
        else type(arguments[k]) is int and props[k]["minimum"] <= arguments[k] <= props[k]["maximum"]
        if props[k].get("type") == "integer" else arguments[k] in props[k]["enum"]
        for k in arguments)


@pytest.mark.parametrize("only", [None, "add", "get_weather"])
def test_forced_calls_are_calls_of_the_functions_given_the_same_with_lookahead_on_and_off(embedded_fp32, only):
    on, off = forced(embedded_fp32, only, True), forced(embedded_fp32, only, False)
    assert on.text_tokens == off.text_tokens and on.stats.finish_reason == "eos"
    reader = CallReader(HERMES, frozenset({"get_weather", "add"}))
    reader.add(on.text)
    reader.finish()
    assert reader.content == "" and reader.calls
    assert only is None or all(call.name == only for call in reader.calls)
    assert len(reader.calls) == 1
    schemas = {"get_weather": WEATHER, "add": ADD}
    assert all(conforms(call.arguments, schemas[call.name]) for call in reader.calls)


def test_forced_calls_take_schemas_with_their_own_references(embedded_fp32):
    """A function's $defs resolve inside its own arguments (as in its schema alone)."""
    from ladechat.engine.grammar import GrammarTokenizer

    config = embedded_fp32.model.config.get_text_config()
    tokens = GrammarTokenizer.of(embedded_fp32.tokenizer, config.vocab_size, embedded_fp32.eos_ids)
    city = {"type": "object", "$defs": {"Unit": {"enum": ["C", "F"]}},
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
    for fmt in (HERMES, LLAMA3, MISTRAL):
        tokens.grammar(LARK + calls_grammar(fmt, {"weather": city, "add": ADD}, None, True, {}))


def request(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": TOOLS,
            "max_tokens": 8, **fields}


def test_tool_requests_that_cannot_be_done_are_400s_naming_the_field():
    hermes = templates.source("hermes")
    cases = [(request(tool_choice={"type": "function", "function": {"name": "nope"}}), hermes, "tool_choice.function.name"),
             (request(tool_choice={"type": "function"}), hermes, "tool_choice"),
             (request(tools=[TOOLS[0], TOOLS[0]]), hermes, "tools.1.function.name"),
             (request(tools=[{"type": "function", "function": {"name": "has space"}}]), hermes, "tools.0.function.name"),
             (request(tools=None, tool_choice="required"), hermes, "tool_choice"),
             (request(), templates.source("chatml"), "tools")]
    for body, template, param in cases:
        with pytest.raises(ApiError) as caught:
            tooling_of(parse_request(json.dumps(body).encode()), template, {})
        assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    for body, param in ((request(tool_choice="sometimes"), "tool_choice"),
                        (request(messages=[{"role": "tool", "content": "x"}]), "messages.0.tool_call_id"),
                        (request(messages=[{"role": "assistant", "content": None, "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]},
                            {"role": "user", "content": "go on"}]), "messages.0.tool_calls.0.function.arguments")):
        with pytest.raises(ApiError) as caught:
            from ladechat.serve.wire import conversation_of

            conversation_of(parse_request(json.dumps(body).encode()).messages)
        assert caught.value.param == param, caught.value.message
    assert tooling_of(parse_request(json.dumps(request(tool_choice="none")).encode()), hermes, {}) is None


def test_the_openai_clients_tool_loop_runs_against_the_server():
    server = Server("--dtype", "float32", "--no-store", "--template", "hermes")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 40?"}]
        named = {"type": "function", "function": {"name": "add"}}
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                               max_tokens=80, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and conforms(json.loads(call.function.arguments), ADD)
        streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                                  max_tokens=80, temperature=0, stream=True)
        chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
        deltas = [d for chunk in chunks for d in chunk.delta.tool_calls or []]
        assert chunks[-1].finish_reason == "tool_calls" and "".join(c.delta.content or "" for c in chunks) == ""
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "add", call.function.arguments)]
        # the call's result goes back; the model answers with it in its prompt
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=24, temperature=0)
        assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
        required = client.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS,
                                                  tool_choice="required", parallel_tool_calls=False,
                                                  max_tokens=80, temperature=0)
        assert len(required.choices[0].message.tool_calls) == 1
        for body, param in ((request(tool_choice="required", tools=[{"type": "function", "function": {
                                "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]),
                             "tools.0.function.parameters"),
                            (request(response_format={"type": "json_object"}), "response_format"),
                            (request(tools=[{"type": "function", "function": {"name": "f", "description":
                                                                              "ends here<|im_end|>"}}]), "tools")):
            for stream in (False, True):  # refused before a stream begins
                r = httpx.post(server.url + "/chat/completions", json={**body, "stream": stream}, timeout=PATIENCE_S)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        server.stop()
