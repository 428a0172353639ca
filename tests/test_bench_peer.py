"""`ladechat bench --peer NAME=URL`: another engine's OpenAI-compatible server as a method of the
bench. The peers here are real HTTP servers in this process (stdlib), streaming the way
llama.cpp's llama-server does (content chunks, a finish chunk, a usage chunk when asked, [DONE]);
each answer names the question it answers, so a conversation's requests show what the peer was sent."""

import dataclasses
import json
import os
import socket
import subprocess

import pytest
import stub_openai
from conftest import ladechat_bin
from stub_openai import StubHandler

from ladechat.bench import peers as peer_bench
from ladechat.bench import prompts
from ladechat.settings import Settings

USAGE = 11  # completion_tokens each answer of a server with usage reports (its text is shorter)
ITEMS = [{"turns": ["Hello there", "And then?"]}, {"turns": ["Count to three"]}]


def answer_text(messages: list[dict]) -> str:
    """The stub's answer: the last question, echoed."""
    return f"You said: {messages[-1]['content']}"


class Peer(StubHandler):
    model, owned_by = "stub.gguf", "llamacpp"
    usage = True  # report usage (when the request asks for it)
    requests: list

    def do_POST(self) -> None:
        body = self.read_request()
        self.requests.append(body)
        text = answer_text(body["messages"])
        events = [{"choices": [{"index": 0, "delta": {"content": text[i:i + 4]}, "finish_reason": None}]}
                  for i in range(0, len(text), 4)]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": USAGE, "total_tokens": 16}})
        self.send_events([*events, "[DONE]"])


def serve(usage: bool):
    handler = type("Handler", (Peer,), {"usage": usage, "requests": []})
    server, url = stub_openai.serve(handler)
    return server, handler.requests, url


@pytest.fixture()
def peers():
    """Two stub servers: one reports usage, one does not."""
    with_usage, without = serve(True), serve(False)
    yield {"with": with_usage, "without": without}
    for server, _, _ in (with_usage, without):
        server.shutdown()
        server.server_close()


@pytest.fixture()
def dataset(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return str(path)


def loaded_tiny():
    """A tiny random Llama with an EOS (</s>), as the bench's HF methods need one."""
    from tiny_models import tiny_loaded

    loaded = tiny_loaded()
    return dataclasses.replace(loaded, eos_ids=frozenset({loaded.tokenizer.eos_token_id}))


def test_peers_answer_every_turn_with_their_own_answers_in_the_conversation(peers, dataset):
    loaded = loaded_tiny()
    settings = Settings().updated({"max_new_tokens": 6, "seed": 0, "W": 2, "N": 3, "G": 1})
    (_, sent, url), (_, sent_plain, url_plain) = peers["with"], peers["without"]
    connected = peer_bench.connect([f"usage={url}", f"text={url_plain}"], set(prompts.METHODS), settings)
    items = []
    results = prompts.run(loaded, [dataset], ["plain"], settings, None, peers=connected, on_item=items.append)
    overall = results["overall"]
    assert list(overall) == ["hf", "plain", "usage", "text"]  # hf-packed only runs on packed weights
    # tokens: the server's usage where it reports one, else the answer's text tokenized here
    assert overall["usage"]["tokens"] == 3 * USAGE and overall["usage"]["items"] == 2
    texts = [answer_text([{"content": turn}]) for item in ITEMS for turn in item["turns"]]
    assert overall["text"]["tokens"] == sum(len(loaded.tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert results["peers"]["usage"] == {"url": url, "model": "stub.gguf", "tokens_from": "usage"}
    assert results["peers"]["text"]["tokens_from"] == "tokenizer"
    for name in ("usage", "text"):
        row = overall[name]
        assert row["identical_items"] is None and row["identical_to_hf_items"] is None  # another engine: n/a
        assert row["tokens_per_s"] > 0 and row["speedup_vs_hf"] > 0 and row["item_geomean_vs_hf"] > 0
        assert row["steps"] == 0 and row["compression"] is None
        assert all(item["methods"][name]["identical"] is None for item in items)
    assert overall["plain"]["identical_items"] == 2  # ladechat's own still compared
    # the requests: a short warm-up, then each turn with the run's settings, greedy, streamed with usage
    warm, *asked = sent
    assert warm["max_tokens"] == 8 and warm["messages"] == [{"role": "user", "content": "Hello"}]
    assert len(asked) == 3 and sent_plain[1:] == asked
    for body in asked:
        assert body["model"] == "stub.gguf" and body["max_tokens"] == 6 and body["temperature"] == 0.0
        assert body["seed"] == 0 and body["stream"] and body["stream_options"] == {"include_usage": True}
        assert "ladechat" not in body  # lookahead settings go to ladechat serve only
    first, second, other = (body["messages"] for body in asked)
    assert first == [{"role": "user", "content": "Hello there"}]
    assert second == [{"role": "user", "content": "Hello there"},
                      {"role": "assistant", "content": "You said: Hello there"},  # the peer's own answer
                      {"role": "user", "content": "And then?"}]
    assert other == [{"role": "user", "content": "Count to three"}]


def test_tables_show_peers_as_methods_without_identity(peers, dataset):
    from ladechat.ui.report import bench_tables

    loaded = loaded_tiny()
    settings = Settings().updated({"max_new_tokens": 4, "seed": 0})
    connected = peer_bench.connect([f"llama.cpp={peers['with'][2]}"], set(prompts.METHODS), settings)
    results = prompts.run(loaded, [dataset], ["plain"], settings, 1, peers=connected)
    table = bench_tables(results)[-1]
    cells = {column.header: list(column.cells) for column in table.columns}
    row = cells["method"].index("llama.cpp")
    assert cells["identical"][row] == "n/a" and cells["tokens"][row] == str(2 * USAGE)
    assert table.caption.endswith(f"llama.cpp = {peers['with'][2]} · tokens: the server's usage · "
                                  "identical: n/a (another engine)")


def ladechat(*args):
    return subprocess.run([ladechat_bin(), *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "NO_COLOR": "1"})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_peer_is_one_line_before_the_model_loads(dataset):
    """The peer is asked for its models first: with a model that does not exist, the error is the peer's."""
    port = closed_port()
    r = ladechat("bench", "-d", dataset, "--methods", "plain", "--model", "/no/such/model",
                 "--peer", f"llama.cpp=http://127.0.0.1:{port}/v1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"ladechat: error: peer llama.cpp: cannot reach the server at http://127.0.0.1:{port}/v1")


@pytest.mark.parametrize("specs,message", [
    (["llama.cpp"], "--peer wants NAME=URL (e.g. llama.cpp=http://127.0.0.1:8089/v1), got 'llama.cpp'"),
    (["=http://127.0.0.1:8089/v1"], "--peer wants NAME=URL"),
    (["llama.cpp="], "--peer wants NAME=URL"),
    (["a=ftp://127.0.0.1/v1"], "--peer a: the URL must be http(s), e.g. llama.cpp=http://127.0.0.1:8089/v1, got 'ftp://127.0.0.1/v1'"),
    (["plain={url}"], "--peer plain: that name is taken (a method of the bench or another peer); choose another"),
    (["a={url}", "a={url}"], "--peer a: that name is taken"),
    (["a={root}/nothing/v1"], "peer a: no OpenAI-compatible API at {root}/nothing/v1 (GET /nothing/v1/models: 404)"),
])
def test_bad_peers_are_one_line_errors(peers, dataset, specs, message):
    url = peers["with"][2]
    root = url.removesuffix("/v1")
    args = [arg for spec in specs for arg in ("--peer", spec.format(url=url, root=root))]
    r = ladechat("bench", "-d", dataset, "--methods", "plain", "--model", "/no/such/model", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert r.stderr.startswith("ladechat: error: " + message.format(url=url, root=root))


def test_the_command_runs_peers_and_prints_their_names_whole_in_a_pipe(peers, dataset, tmp_path):
    """`ladechat bench --peer` end to end: the peer's row, named in full though stdout is a pipe
    (rich would squeeze the table into 80 columns: two peers would both read 'llam…')."""
    from test_cli import tiny_model_folder
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    url = peers["with"][2]
    common = ("bench", "-d", dataset, "--methods", "plain", "--model", str(folder), "--dtype", "float32",
              "--max-new-tokens", "4", "--limit", "1", "--peer", f"llama.cpp-ngram={url}")
    r = ladechat(*common)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "llama.cpp-ngram " in line and "n/a" in line)
    assert f" {2 * USAGE} " in row
    results = json.loads(ladechat(*common, "--json").stdout)
    assert results["overall"]["llama.cpp-ngram"]["identical_items"] is None
    assert results["peers"]["llama.cpp-ngram"]["tokens_from"] == "usage"
