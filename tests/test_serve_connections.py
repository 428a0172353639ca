"""`ladechat serve` stays quiet and bounded at the connection level: a client that leaves mid-body
leaves no traceback (at most a line each), a connection that sends nothing, half a request head or
half a body is closed after --request-timeout, and the key can come from a file (not ps)."""

import os
import socket

import httpx
import pytest
from conftest import ladechat_bin
from serve_process import Server

pytestmark = pytest.mark.slow
BODY = b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "key"
    key.write_text("sekret\n")
    s = Server("--dtype", "float32", "--no-store", "--request-timeout", "1", "--api-key-file", str(key))
    yield s
    s.stop()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    return sock


def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (a recv of b"")."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def head(length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{{port}}\r\nAuthorization: Bearer sekret\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_clients_that_leave_mid_body_leave_no_traceback(server):
    before = len(server.lines)
    for i in range(30):
        sock = connect(server)
        sock.sendall(head(len(BODY)).replace(b"{port}", str(server.port).encode()) + BODY[: 5 + i])
        sock.close()
    # the server still answers, and said at most a line per client that left
    answer = httpx.post(server.url + "/chat/completions", content=BODY, timeout=120,
                        headers={"Authorization": "Bearer sekret", "Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    said = server.lines[before:]
    assert not any("Traceback" in line or "Exception" in line for line in said), said
    assert len(said) <= 30


def test_idle_and_half_sent_connections_are_closed(server):
    idle = connect(server)
    assert closed_by_server(idle) == b""  # sent nothing: closed, nothing said
    half_head = connect(server)
    half_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert closed_by_server(half_head) == b""
    half_body = connect(server)
    half_body.sendall(head(len(BODY)).replace(b"{port}", str(server.port).encode()) + BODY[:10])
    reply = closed_by_server(half_body)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not all arrive within 1 s" in reply
    # a kept-alive connection that starts its next request and stalls is closed too
    kept = connect(server)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.endswith(b"}"):  # the whole response (a JSON body)
        first += kept.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    assert closed_by_server(kept) == b""
    assert httpx.get(server.base + "/health").status_code == 200  # and the server goes on


def test_the_key_from_a_file(server):
    ok = {"Authorization": "Bearer sekret"}
    assert httpx.get(server.url + "/models", headers=ok).status_code == 200
    assert httpx.get(server.url + "/models").status_code == 401


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing", "--api-key-file: no such file: {path}"),
    (lambda d: (d / "empty").write_text("\n") and d / "empty", "--api-key-file: {path} holds no key on its first line"),
    (lambda d: d, "--api-key-file: {path} is a folder"),
])
def test_a_key_file_that_holds_no_key_is_one_line(tmp_path, make, message):
    import subprocess

    path = make(tmp_path)
    done = subprocess.run([ladechat_bin(), "serve", "--api-key-file", str(path)], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "LADECHAT_API_KEY"})
    assert done.returncode == 1 and done.stderr == f"ladechat: error: {message.format(path=path)}\n"
