"""An OpenAI-compatible server for the tests that speak to one which is not ladechat serve (as vLLM,
llama.cpp's llama-server or ollama): a stdlib HTTP server in the test's process on a free loopback
port. A test subclasses StubHandler with its own do_POST (what the server answers) and starts it
with serve()."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubHandler(BaseHTTPRequestHandler):
    """Quiet; GET /v1/models lists `model` (owned by `owned_by`), any other GET is a 404."""

    model = "stub"
    owned_by = "test"

    def log_message(self, *args) -> None:
        pass

    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                            **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                             "owned_by": self.owned_by}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def read_request(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_events(self, events: list) -> None:
        """A 200 event stream: each event (a dict as JSON, or a string as it is) as one `data:`
        line, flushed, as a server streams them; the caller ends it (`[DONE]` or not)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())
            self.wfile.flush()

    def send_answer(self, pieces: list[str]) -> None:
        """A streamed answer of these pieces of text: a chunk each, a chunk that ends it, [DONE]."""
        events = [self.chunk({"content": piece}) for piece in pieces]
        self.send_events([*events, self.chunk({}, "stop"), "[DONE]"])

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def serve(handler: type[StubHandler]) -> tuple[ThreadingHTTPServer, str]:
    """The server, answering on a thread of its own, and its base URL (http://127.0.0.1:PORT/v1)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"
