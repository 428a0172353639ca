"""`ladechat serve` as a real process on a free loopback port, spoken to by the official openai
client, by plain HTTP and by `ladechat --api` (ask and the chat in a pty)."""

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pexpect
import pytest
from conftest import PATIENCE_S, ladechat_bin
from serve_process import Server

KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
LONG = "Write a very long story about a dragon who learns to bake bread."
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    # --no-store: the serving benchmark compares it with an in-process bot that has no past answers
    s = Server("--dtype", "float32", "--api-key", KEY, "--max-queue", "1", "--no-store")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


def ladechat(*args, stdin=None, env=None):
    return subprocess.run([ladechat_bin(), *args], input=stdin, capture_output=True, timeout=PATIENCE_S, text=True, check=False,
                          env={**os.environ, "NO_COLOR": "1", **(env or {})})


def wait_health(server, **want):
    """Poll /health until its fields have the wanted values (the server's own account of its queue)."""
    for _ in range(600):
        health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
        if all(health[k] == v for k, v in want.items()):
            return health
        time.sleep(0.05)
    raise AssertionError(f"/health never became {want}: {health}")


@pytest.fixture(scope="module")
def local_answer():
    """`ladechat ask` in its own process: greedy, fp32, the reference every server answer must equal."""
    r = ladechat("ask", "--json", "--dtype", "float32", "--max-new-tokens", "24", QUESTION)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_models_and_health(server, client):
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json()["status"] == "ok"  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "ladechat"
    assert client.models.retrieve(MODEL).model_extra["ladechat"]["settings"]["lookahead"] is True


def test_answers_are_token_identical_to_ask(server, client, local_answer):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == local_answer["text"]
    assert whole.model_extra["ladechat"]["token_ids"] == local_answer["token_ids"]
    assert whole.usage.completion_tokens == len(local_answer["token_ids"])
    assert whole.usage.prompt_tokens == local_answer["stats"]["prompt_tokens"]
    for lookahead in (True, False):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ladechat": {"lookahead": lookahead}}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t for c in chunks for t in (c.model_extra.get("ladechat") or {}).get("tokens", [])]
        assert text == local_answer["text"] and tokens == local_answer["token_ids"]
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1 and finish[0].model_extra["ladechat"]["stats"]["lookahead"] is lookahead
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
        segments = [s for c in chunks for s in (c.model_extra.get("ladechat") or {}).get("segments", [])]
        assert "".join(s for s, _ in segments) == text
        if not lookahead:
            assert not any(parallel for _, parallel in segments)
    # the client side: `ladechat ask --api` gives the same tokens
    r = ladechat("ask", "--api", server.url, "--json", "--max-new-tokens", "24", QUESTION, env={"LADECHAT_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == local_answer["token_ids"]
    assert json.loads(r.stdout)["text"] == local_answer["text"]


def test_stop_strings_end_the_answer_without_being_sent(client, local_answer):
    stop = local_answer["text"].split()[3]  # a word in the middle of the reference answer
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=24, temperature=0, stop=[stop])
    before = local_answer["text"][:local_answer["text"].index(stop)]
    assert whole.choices[0].message.content == before
    assert whole.choices[0].finish_reason == "stop"
    for lookahead in (True, False):  # streamed: no character of the stop string is ever sent
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0, stop=[stop],
            stream=True, extra_body={"ladechat": {"lookahead": lookahead}}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == before
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_two_concurrent_clients_are_answered_in_order(server, client, local_answer):
    order, answers = [], {}

    def ask(name, question, max_tokens):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, temperature=0, stream=True)
        parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                order.append(name)
                parts.append(chunk.choices[0].delta.content)
        answers[name] = "".join(parts)

    first = threading.Thread(target=ask, args=("first", LONG, 40))
    first.start()
    wait_health(server, running=1)
    second = threading.Thread(target=ask, args=("second", QUESTION, 24))
    second.start()
    first.join()
    second.join()
    assert answers["second"] == local_answer["text"]
    assert len(answers["first"]) > 50
    assert order == sorted(order, key=["first", "second"].index)  # every chunk of the first before the second's


def test_a_client_that_disconnects_frees_the_server(server, client, local_answer):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}],
                                            max_tokens=1000, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_health(server, running=0, waiting=0)
    stopped = [line for line in server.lines if line.startswith("client gone: stopped after")]
    assert stopped and int(stopped[-1].split()[4]) < 1000
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == local_answer["text"]


def error_of(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_every_error_status(server, client):
    url = server.url + "/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    # 401: no key, a wrong key (the openai client raises AuthenticationError)
    assert error_of(httpx.post(url, json=ok))["message"] == "no API key given (Authorization: Bearer KEY)"
    assert error_of(httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"}))["message"] == "wrong API key"
    for header in (KEY, f"Token {KEY}", "Bearer"):  # the key without its scheme is not "no key"
        refused = error_of(httpx.post(url, json=ok, headers={"Authorization": header}))
        assert refused == {**refused, "code": "invalid_api_key",
                           "message": "the Authorization header wants the Bearer scheme: Authorization: Bearer KEY"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    # 400: bad parameters
    for bad, param in [({"temperature": -1}, "temperature"), ({"n": 2}, "n"), ({"messages": []}, "messages"),
                       ({"max_tokens": "ten"}, "max_tokens"), ({"tools": [{"type": "function"}]}, "tools.0.function"),
                       ({"functions": [{"name": "f"}]}, "functions"),
                       ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
                       ({"ladechat": {"N": 1}}, "ladechat.N"), ({"stop": 5}, "stop")]:
        r = httpx.post(url, json={**ok, **bad}, headers=auth)
        assert r.status_code == 400, (bad, r.text)
        assert error_of(r)["param"] == param, bad
    r = httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=0)
    # 404: unknown model, unknown route
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert error_of(httpx.get(server.url + "/nope", headers=auth))["code"] == "unknown_url"
    # 413: a prompt longer than the context
    r = httpx.post(url, json={**ok, "messages": [{"role": "user", "content": "lookahead " * 10000}]}, headers=auth)
    assert r.status_code == 413 and error_of(r)["code"] == "context_length_exceeded"
    # 503: one answer running, one waiting (--max-queue 1): the third is turned away, with Retry-After
    long = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=1000,
                                          temperature=0, stream=True)
    next(iter(long))
    hi = [{"role": "user", "content": "hi"}]
    waiting = threading.Thread(target=lambda: client.chat.completions.create(model=MODEL, max_tokens=4, messages=hi))
    waiting.start()
    wait_health(server, running=1, waiting=1)
    r = httpx.post(url, json=ok, headers=auth)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1 and error_of(r)["code"] == "server_busy"
    long.close()
    waiting.join()
    wait_health(server, running=0, waiting=0)


def test_serve_refuses_bad_setups():
    r = ladechat("serve", "--host", "0.0.0.0")
    assert r.returncode == 1 and r.stderr.strip() == (
        "ladechat: error: --host 0.0.0.0 can be reached from other machines: set LADECHAT_API_KEY or give "
        "--api-key-file (or --api-key)")
    r = ladechat("serve", "--max-queue", "-1")
    assert r.returncode == 1 and r.stderr.strip() == "ladechat: error: --max-queue must be >= 0, got -1"
    r = ladechat("serve", "--allow-origin", "localhost:3000")
    assert r.returncode == 1 and r.stderr.strip() == (
        "ladechat: error: --allow-origin: an origin is scheme://host[:port] (e.g. http://localhost:3000) or *, "
        "got 'localhost:3000'")
    r = ladechat("serve", "--drain-timeout", "nan")
    assert r.returncode == 1 and r.stderr.strip() == (
        "ladechat: error: --drain-timeout must be a finite number of seconds >= 0, got nan")


def test_api_client_one_line_errors(server):
    cases = [
        (["ask", "--api", "http://127.0.0.1:9/v1", "hi"], "cannot reach the server at http://127.0.0.1:9/v1"),
        (["ask", "--api", server.url, "hi"], "wants an API key: give --api-key or set LADECHAT_API_KEY"),
        (["ask", "--api", server.url, "--api-key", "wrong", "hi"], "refused the API key"),
        (["ask", "--api", server.url, "--api-key", KEY, "-m", "gpt-4", "hi"], f"has no model 'gpt-4' (it has: {MODEL})"),
        (["ask", "--api", server.url, "--api-key", KEY, "--dtype", "float32", "hi"], "--dtype is about loading a model"),
        (["ask", "--api", server.url, "--api-key", KEY, "-N", "1", "hi"], "N (n-gram size) must be >= 2, got 1"),
        (["ask", "--api", "ftp://x", "hi"], "--api wants an http(s) URL"),
        (["--api", server.url + "/nowhere", "--api-key", KEY], "no OpenAI-compatible API at"),
    ]
    for args, message in cases:
        r = ladechat(*args, env={"LADECHAT_API_KEY": "", "OPENAI_API_KEY": ""})
        err = r.stderr.strip()
        assert r.returncode == 1, (args, err)
        assert message in err and err.startswith("ladechat: error:") and "\n" not in err, (args, err)


CHECK_IMPORTS = """
import sys
from ladechat.cli import main
try:
    main()
finally:
    print("heavy:", sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


def test_serving_benchmark_answers_the_same_tokens_both_ways(server, tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": i, "turns": [q]}) + "\n" for i, q in enumerate([QUESTION, "Name a fruit."])))
    r = ladechat("bench", "serving", "--api", server.url, "--api-key", KEY, "-d", str(data), "--max-new-tokens", "12",
                 "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["identical"] == 2 and all(0 < i["tokens"] == i["served_tokens"] <= 12 for i in result["items"])
    assert result["settings"]["store"] is False
    assert result["served_vs_in_process"] == pytest.approx(result["served_tokens_per_s"] / result["in_process_tokens_per_s"],
                                                           rel=1e-3)


def test_serving_benchmark_refuses_a_server_with_a_store():
    """Its store remembers earlier runs of the same prompts: the comparison would flatter it."""
    card = {"id": MODEL, "object": "model", "owned_by": "ladechat",
            "ladechat": {"model": "SmolLM2-135M-Instruct (embedded, Q4_1) on cpu (float32)",
                         "settings": {"store": True}}}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"object": "list", "data": [card]}))
    from ladechat.backends.remote import Endpoint, RemoteBot
    from ladechat.bench import serving as serve_bench
    from ladechat.settings import Settings

    remote = RemoteBot(Endpoint.of("http://127.0.0.1:9/v1", None), None, {}, set(), client=httpx.Client(transport=transport))
    with pytest.raises(serve_bench.ServeBenchError, match="start it with --no-store"):
        serve_bench.run(None, Settings(), remote, ["hi"])


def test_api_clients_import_neither_torch_nor_transformers(server):
    env = {**os.environ, "NO_COLOR": "1", "OPENAI_API_KEY": KEY}
    for args, stdin in ((["ask", "--api", server.url, "--max-new-tokens", "4", "hi"], None),
                        (["--api", server.url, "--max-new-tokens", "4"], "hi\n/stats\n")):
        r = subprocess.run([sys.executable, "-c", CHECK_IMPORTS, *args], input=stdin, capture_output=True, text=True,
                           timeout=120, env=env, check=False)
        assert r.returncode == 0, r.stderr
        assert "heavy: []" in r.stderr and "tokens/step" in r.stderr


def test_chat_in_a_pty_against_the_server(server, tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "LADECHAT_API_KEY": KEY}
    env.pop("NO_COLOR", None)  # the highlighting is colour
    child = pexpect.spawn(ladechat_bin(), ["--api", server.url, "--max-new-tokens", "40"], env=env,
                          encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect(f"{MODEL} at {re.escape(server.url)}")
    child.expect(">>>")
    child.sendline("Repeat exactly: one two three four five six seven eight, one two three four five six seven eight")
    child.expect(r"tokens/step, lookahead W=\d+ N=\d+ G=\d+")
    assert "\x1b[1;36m" in child.before  # tokens accepted in parallel, in bold cyan
    child.expect(">>>")
    child.sendline("/lookahead off")
    child.expect("lookahead off from the next answer")
    child.expect(">>>")
    child.sendline("And now count to five.")
    child.expect(r"tokens/step, lookahead off")
    child.expect(">>>")
    child.sendline("/stats")
    child.expect(r"lookahead: 1 answers")
    child.expect(r"plain: 1 answers")
    child.expect(">>>")
    child.sendline("/exit")
    child.expect("bye")
    child.expect(pexpect.EOF)


def test_a_server_answers_on_the_thread_its_compiled_steps_were_warmed_up_on():
    """CUDA graphs belong to the thread that captured them: `ladechat serve` and the warm server warm
    a compiled bot up on the model thread (backends/opener.bot_for's on_model_thread) that then runs every request.
    The compiled forward is the model's own here: where it runs is the point, not the compiler."""
    from tiny_models import tiny_loaded

    from ladechat.backends.opener import bot_for
    from ladechat.serve.app import Api, ServeConfig
    from ladechat.serve.worker import ModelThread
    from ladechat.settings import Settings

    loaded = tiny_loaded()
    threads = []

    def forward(**inputs):
        threads.append(threading.get_ident())
        return loaded.model.forward(**inputs)

    from ladechat.engine.runner import COMPILED_SLOT

    loaded.model.__dict__[COMPILED_SLOT] = forward  # the model's compiled forward, as if compiled
    model_thread = ModelThread()
    try:
        bot = bot_for(loaded, Settings(store=False), True, lambda message: contextlib.nullcontext(), model_thread.run)
        api = Api(bot, loaded.tokenizer, loaded.context_length, Settings(store=False), ServeConfig(model_id="tiny"),
                  model_thread=model_thread)
        assert api.worker.executor is model_thread.executor
        warmed = set(threads)
        assert len(warmed) == 1 and threading.get_ident() not in warmed  # warmed up there, not here
        answering = model_thread.run(threading.get_ident)
        assert warmed == {answering}
    finally:
        model_thread.executor.shutdown()
