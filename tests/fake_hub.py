"""A local HTTP server playing the Hugging Face hub for huggingface_hub (HF_ENDPOINT): a repo's file
list with sizes and sha256 (list_repo_tree), and its files by /resolve/ with ranges (a download
resumed), plus what a test asks for: a gated repo, a file whose bytes do not match its sha256, a
download cut after some bytes, or a hub that is down."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.lying: set[tuple[str, str]] = set()  # (repo, path): the listed sha256 is not the bytes'
        self.cut_after: dict[tuple[str, str], int] = {}  # the next GET of it ends after this many bytes
        self.ranges: list[str] = []  # Range headers of the GETs received
        self.hold_after: dict[tuple[str, str], int] = {}  # a GET of it stops after this many bytes until released
        self.released = threading.Event()
        self.no_ranges = False  # every GET answered with the whole file (a server that ignores Range)
        self.requests: list[str] = []  # every request's path
        self.down = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

            def do_GET(self) -> None:
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = files

    def sha256(self, repo: str, path: str) -> str:
        digest = hashlib.sha256(self.repos[repo][path]).hexdigest()
        return "f" * 64 if (repo, path) in self.lying else digest

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        if self.down:
            handler.send_response(503)
            handler.end_headers()
            return
        self.requests.append(handler.path)
        parts = unquote(urlparse(handler.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"] and "tree" in parts:
            at = parts.index("tree")
            return self.tree(handler, "/".join(parts[2:at]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(handler, "/".join(parts[:2]), "/".join(parts[4:]), head)
        self.error(handler, 404, "EntryNotFound")

    def error(self, handler, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def refused(self, handler, repo: str) -> bool:
        if repo in self.gated:
            self.error(handler, 403, "GatedRepo")
            return True
        if repo not in self.repos:
            self.error(handler, 404, "RepoNotFound")
            return True
        return False

    def tree(self, handler, repo: str) -> None:
        if self.refused(handler, repo):
            return
        listing = [{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                    "lfs": {"oid": self.sha256(repo, path), "size": len(data), "pointerSize": 134}}
                   for path, data in self.repos[repo].items()]
        body = json.dumps(listing).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def resolve(self, handler, repo: str, path: str, head: bool) -> None:
        if self.refused(handler, repo):
            return
        data = self.repos[repo].get(path)
        if data is None:
            return self.error(handler, 404, "EntryNotFound")
        start = 0
        asked = handler.headers.get("Range")
        if not head:
            self.ranges.append(asked or "")
        if asked and asked.startswith("bytes=") and not self.no_ranges:
            start = int(asked[len("bytes="):].split("-")[0] or 0)
        if start >= len(data) > 0:
            handler.send_response(416)
            handler.send_header("Content-Range", f"bytes */{len(data)}")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{self.sha256(repo, path)}"')
        handler.send_header("X-Linked-Etag", f'"{self.sha256(repo, path)}"')
        handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("Accept-Ranges", "bytes")
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.send_header("Content-Length", str(len(data) - start))
        handler.end_headers()
        if head:
            return
        cut = self.cut_after.pop((repo, path), None)
        body = data[start:] if cut is None else data[start:start + cut]
        hold = self.hold_after.pop((repo, path), None)
        try:
            if hold is not None:  # the first bytes, then nothing until the test releases it
                handler.wfile.write(body[:hold])
                handler.wfile.flush()
                self.released.wait(120)
                body = body[hold:]
            handler.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client went away (a test stopped it)
            return
        if cut is not None:
            handler.wfile.flush()
            handler.close_connection = True


def split_gguf(source, first, second) -> None:
    """`source` (a GGUF file) as two parts the way llama.cpp's gguf-split writes them: the first
    with the metadata and the first half of the tensors, the second with the rest, each marked
    split.no / split.count / split.tensors.count."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[reader.fields["general.architecture"].data[0]]).decode()
    half = len(reader.tensors) // 2
    for index, (path, tensors) in enumerate(((first, reader.tensors[:half]), (second, reader.tensors[half:]))):
        writer = GGUFWriter(None, arch)
        if index == 0:
            for name, field in reader.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                kind = field.types[0]
                if kind == GGUFValueType.ARRAY:
                    writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
                else:
                    writer.add_key_value(name, field.contents(), kind)
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", 2)
        writer.add_int32("split.tensors.count", len(reader.tensors))
        for tensor in tensors:
            writer.add_tensor(tensor.name, np.asarray(tensor.data),
                              raw_dtype=tensor.tensor_type)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
