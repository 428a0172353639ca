"""`ladechat serve`: one loaded model behind an OpenAI-compatible HTTP API, decoding with lookahead.

    GET  /health                 {"status": "ok", "running": 0 or 1, "waiting": N} (no key needed)
    GET  /v1/models[/{id}]       the one model; "ladechat" holds its settings
    POST /v1/chat/completions    answers, whole or streamed as server-sent events

Requests run one at a time, in arrival order, on one model thread (the backend: a Bot and its KV
cache, where a conversation that extends the previous one prefills only its new tokens). At most `max_queue`
wait; more get 503 with Retry-After. A client that goes away stops its generation at the next step.
The server's max_new_tokens caps every answer. A request is refused (Guard) when a web page could
have sent it (another site's Origin, a Host that is not this server's, a body that is not JSON),
and before it costs much when it cannot be answered (read_body: over MAX_BODY; Api.check_size and
Api.check_length: a prompt that cannot fit, judged by its size, then by its first tokens).
SIGTERM or Ctrl-C drains (Api.drain): answers in progress get drain_timeout seconds to finish.

Extensions that standard clients ignore (request and response objects get a "ladechat" key):
    request:  {"ladechat": {"lookahead": false, "W": 4, "N": 3, "G": 2}} (also context_candidates,
              context_len, recycle)
              top-level "top_k", "min_p", "repetition_penalty" as vLLM takes them
    chunk:    {"ladechat": {"segments": [["text", true], ...], "tokens": [..], "guessed": [..],
                            "source": "pool", "fed": 12, "seconds": 0.031}}
              segments: the chunk's content in pieces, true where accepted in parallel
    last:     {"ladechat": {"stats": {... Stats.as_dict() ...}}}; non-streaming: also "token_ids"
Stop strings end the answer without being part of it, as in the OpenAI API (the chat keeps them).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ladechat import __version__, templates
from ladechat.conversation import Conversation, prompt_budget
from ladechat.engine.config import ConfigError
from ladechat.engine.events import Done, Notice, OutOfMemory, Piece
from ladechat.settings import Settings, group, key
from ladechat.ui.stream import failure

MAX_BODY = 8 * 1024 * 1024  # bytes of JSON in one request
MAX_OBJECTS = 8192  # JSON objects in one request (messages, content parts, ...): pydantic holds the GIL
MAX_STOP = 16  # stop strings in one request
COUNT_PIECE = 16384  # characters of a long prompt tokenized at a time to learn whether it fits
MERGE_SLACK = 4  # tokens two pieces of a text may take beyond the text whole
SURROGATE = re.compile("[\ud800-\udfff]")  # JSON can spell lone surrogates; no tokenizer takes them
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "interrupted": "stop"}
# OpenAI parameters this server cannot honour: refused rather than silently ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "audio", "modalities", "prediction")
ZERO_PENALTIES = ("frequency_penalty", "presence_penalty")


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # the name clients ask for
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait while one runs
    hosts: frozenset[str] | None = None  # Host header names taken (None: any); see allowed_hosts
    origins: frozenset[str] = frozenset()  # cross-site origins allowed besides the server's own ("*": any)
    drain_timeout: float = 5.0  # seconds answers in progress get to finish once the server is told to stop


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- requests ---------------------------------------------------------------------------------
class Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# The request's "ladechat" object: the lookahead settings by key (W, N, G, ...), each optional.
Extension = create_model("Extension", __config__=ConfigDict(extra="forbid", strict=True),
                         **{key(name): (Settings.model_fields[name].annotation | None, None)
                            for name in group("lookahead")})


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1: off, as vLLM spells it
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: int = 1
    ladechat: Extension | None = None


# The names a client gives: a pydantic error's location keeps these and drops the rest (the
# union member that was tried, e.g. "str" in stop.str).
FIELD_NAMES = frozenset().union(*(m.model_fields for m in (ChatRequest, Message, Part, StreamOptions, Extension)))
UNION_MESSAGES = {"stop": "must be a string or a list of strings",
                  "content": "must be a string, a list of content parts or null"}


class _TooManyObjects(Exception):
    pass


def parse_request(body: bytes) -> ChatRequest:
    """The request in `body` (ApiError 400 for what is wrong with it, in the client's terms).
    json.loads counts the objects as it goes, so a body of many small objects is refused before
    pydantic (which holds the GIL while it validates) builds them."""
    objects = 0

    def counted(pairs):
        nonlocal objects
        objects += 1
        if objects > MAX_OBJECTS:
            raise _TooManyObjects
        return dict(pairs)

    try:
        data = json.loads(body, object_pairs_hook=counted)
    except _TooManyObjects:
        raise ApiError(413, f"the request holds more than {MAX_OBJECTS} JSON objects (messages, content parts); "
                            "no conversation that long fits the context", param="messages",
                       code="context_length_exceeded") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
        raise ApiError(400, f"the request body must be a JSON object, got {kind.get(type(data), 'null')}")
    try:
        req = ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.n != 1:
        raise ApiError(400, f"n must be 1 (this server gives one answer per request), got {req.n}", param="n")
    extra = req.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by ladechat serve", param=name)
    for name in ZERO_PENALTIES:
        if extra.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported by ladechat serve (repetition_penalty is)", param=name)
    fmt = extra.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported by ladechat serve",
                       param="response_format")
    return req


def validation_error(exc: ValidationError) -> ApiError:
    """pydantic's first error as a 400 in the client's terms: the field path it sent (messages.0.role),
    "must be ..." rather than "Input should be ...", one message for a value that fits no member of
    a union (stop: 5), the member's own error for one that has the member's type but not its bounds
    (stop: 20 strings) and the deepest error for one that nearly fits a member (stop: ["a", 5])."""
    errors = exc.errors()

    def where(error) -> tuple:
        loc = error["loc"]
        if error["type"] == "extra_forbidden":  # the unknown key is the client's own
            return tuple(p for p in loc[:-1] if isinstance(p, int) or p in FIELD_NAMES) + loc[-1:]
        return tuple(p for p in loc if isinstance(p, int) or p in FIELD_NAMES)

    path = where(errors[0])
    same = [e for e in errors if where(e)[:len(path)] == path]
    deepest = max(same, key=lambda e: len(where(e)))
    path = where(deepest)
    here = [e for e in same if where(e) == path]
    first = next((e for e in here if not e["type"].endswith("_type")), here[0])  # a bound, not a type
    name = ".".join(str(p) for p in path)
    kind, given = first["type"], first.get("input")
    if isinstance(given, float) and not math.isfinite(given):
        text = "must be a finite number"
    elif len(here) > 1 and first["type"].endswith("_type") and path and path[-1] in UNION_MESSAGES:
        text = UNION_MESSAGES[path[-1]]
    elif kind == "missing":
        text = "required"
    elif kind == "extra_forbidden":
        text = "not a field this server knows"
    elif kind == "too_short" and (first.get("ctx") or {}).get("min_length") == 1:
        text = "must not be empty"
    elif kind == "too_long" and path == ("stop",):
        text = f"at most {MAX_STOP} stop strings"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        text = "must be a JSON object"
    else:
        text = re.sub(r"^Input should be\b", "must be", first["msg"])
    return ApiError(400, f"{name}: {text}" if name else text, param=name or None)


def conversation_of(messages: list[Message]) -> Conversation:
    """System (or developer) messages first, then user and assistant turns ending with the user's."""
    system: list[str] = []
    turns: list[dict] = []
    for i, m in enumerate(messages):
        text = _text(m, i)
        if m.role in ("system", "developer"):
            if turns:
                raise ApiError(400, f"messages[{i}]: a {m.role} message must come before the conversation",
                               param=f"messages.{i}.role")
            system.append(text)
        else:
            turns.append({"role": m.role, "content": text})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    return Conversation(system="\n\n".join(system) or None, messages=turns)


def _text(m: Message, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        text = m.content or ""
    else:
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{i}]: only text content is supported, got a {part.type!r} part",
                               param=f"messages.{i}.content")
        text = "".join(part.text for part in m.content)
    if SURROGATE.search(text):
        raise ApiError(400, f"messages[{i}]: the content holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not text", param=f"messages.{i}.content")
    return text


# The request's names for the settings it sets (a message names what the client sent).
REQUEST_NAMES = {key(name): f"ladechat.{key(name)}" for name in group("lookahead")}


def settings_of(base: Settings, req: ChatRequest) -> Settings:
    """The server's settings with the request's own on top (ApiError 400 for a value out of range).
    The server's max_new_tokens is a cap: a request that asks for more gets that many."""
    ext = req.ladechat or Extension()
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    asked = req.max_completion_tokens or req.max_tokens
    values = {"max_new_tokens": None if asked is None else min(asked, base.max_new_tokens),
              "temperature": req.temperature, "top_p": req.top_p,
              "top_k": None if req.top_k is None else max(req.top_k, 0), "min_p": req.min_p,
              "repetition_penalty": req.repetition_penalty, "seed": req.seed, **ext.model_dump()}
    values = {k: v for k, v in values.items() if v is not None}
    values["stop"] = list(base.stop) + [s for s in stop if s]
    try:
        return base.updated(values)
    except ConfigError as exc:
        names = {**REQUEST_NAMES, "max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
        param = next((names.get(k, k) for k, v in values.items() if _refused(base, k, v)), None)
        raise ApiError(400, f"{param}: {exc}" if param else str(exc), param=param) from None


def _refused(base: Settings, key: str, value) -> bool:
    try:
        base.updated({key: value})
    except ConfigError:
        return True
    return False


# -- text for the wire ------------------------------------------------------------------------
class TextStream:
    """Pieces -> text segments (text, parallel) to send. With stop strings, the last characters
    that could begin one are held back until the answer ends, so the stop string itself is never
    sent."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.parallel: list[bool] = []  # per character of text
        self.sent = 0

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.parallel += [piece.parallel] * len(piece.text)

    def release(self) -> list[tuple[str, bool]]:
        """The segments added since the last release, but those held back."""
        return self._release(len(self.text) - self.hold)

    def finish(self) -> list[tuple[str, bool]]:
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return self._release(min(found, default=len(self.text)), final=True)

    def _release(self, end: int, final: bool = False) -> list[tuple[str, bool]]:
        if final:
            self.text, self.parallel = self.text[:end], self.parallel[:end]
        segments: list[tuple[str, bool]] = []
        for i in range(self.sent, max(end, self.sent)):
            if segments and segments[-1][1] == self.parallel[i]:
                segments[-1] = (segments[-1][0] + self.text[i], self.parallel[i])
            else:
                segments.append((self.text[i], self.parallel[i]))
        self.sent = max(end, self.sent)
        return segments


async def read_body(request: Request) -> bytes:
    """The request's body, refused (413) as soon as it is known to be over MAX_BODY: a Content-Length
    before any of it is read, a body without one (chunked) once that much has come."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise too_large(int(length))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise too_large(len(body), more=True)
    return bytes(body)


def too_large(size: int, more: bool = False) -> ApiError:
    """413 for a body over MAX_BODY; the connection is closed after it, so the rest of the body is
    not read either."""
    close = {"Connection": "close"}
    if more:  # a body without a Content-Length, cut where it passed the limit
        return ApiError(413, f"the request body is more than the {MAX_BODY} bytes this server takes", headers=close)
    return ApiError(413, f"the request body is {size} bytes, more than the {MAX_BODY} this server takes", headers=close)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", code="server_shutting_down")


# -- cross-site requests ----------------------------------------------------------------------
class Guard:
    """ASGI middleware that refuses what a web page in the user's browser could make of a server on
    this machine: a request from another site (an Origin that is not the server's own or one the
    operator allowed: 403), a DNS-rebinding page's (a Host that is not the server's, when it listens
    on loopback: 403) and a body that is not JSON (415: text/plain, a form or no type at all are
    what a page may POST anywhere without asking the server first)."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str]) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        refusal = None
        if self.hosts is not None and host_name(host) not in self.hosts:
            refusal = ApiError(403, f"the Host header {host!r} does not name this server "
                                    f"({' or '.join(sorted(self.hosts))}); refused as DNS rebinding would send it",
                               code="forbidden_host")
        elif (origin := headers.get("origin")) is not None and not self.origin_allowed(origin, host):
            refusal = ApiError(403, f"requests from the web page at {origin} are refused (start the server with "
                                    f"--allow-origin {origin} to allow them)", code="forbidden_origin")
        elif scope["method"] == "POST" and not is_json(headers.get("content-type")):
            given = headers.get("content-type")
            refusal = ApiError(415, "the request body must be JSON, sent with Content-Type: application/json"
                                    + (f" (not {given})" if given else ""), code="unsupported_media_type")
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        return "*" in self.origins or origin in self.origins or origin == f"http://{host}".lower()


def host_name(host: str) -> str:
    """The name in a Host header: "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host.rstrip(".")


def is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def allowed_hosts(host: str, bound: str) -> frozenset[str] | None:
    """The Host names a server listening on `host` (bound to address `bound`) takes: on loopback its
    address, the name it was given and localhost; elsewhere (which needs an API key) any."""
    if not is_loopback(bound):
        return None
    return frozenset({host_name(host), host_name(f"[{bound}]" if ":" in bound else bound), "localhost"})


def normal_origin(origin: str) -> str:
    """An --allow-origin value as browsers send it ("*", or scheme://host[:port]); ValueError if not one."""
    from urllib.parse import urlsplit

    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"an origin is scheme://host[:port] (e.g. http://localhost:3000) or *, got {origin!r}")
    return f"{parts.scheme}://{parts.netloc}".lower()


# -- the model thread -------------------------------------------------------------------------
END = object()


@dataclass
class Failed:
    error: BaseException


@dataclass(eq=False)
class Job:
    """One request's generation: events come back through `queue`; `stop` ends it at the next step."""

    conversation: Conversation
    settings: Settings
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    stopped_by: str = "client gone"  # what set `stop`, for the log

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down)
            self.stop.set()

    async def events(self):
        """The job's events, as they come; leaving early (a disconnect) stops the generation."""
        try:
            while (item := await self.queue.get()) is not END:
                if isinstance(item, Failed):
                    raise item.error
                yield item
        finally:
            self.stop.set()


class Worker:
    """One thread owns the model; jobs run in submission order (a one-thread executor's FIFO)."""

    def __init__(self, backend, max_queue: int, log=None) -> None:
        self.backend = backend
        self.log = log or (lambda line: None)
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladechat-model")
        self.lock = threading.Lock()
        self.unfinished = 0
        self.jobs: set[Job] = set()  # submitted, not yet run to the end
        self.durations: deque[float] = deque(maxlen=8)

    def submit(self, conversation: Conversation, settings: Settings) -> Job:
        job = Job(conversation, settings, asyncio.get_running_loop())
        with self.lock:
            if self.unfinished > self.max_queue:
                raise ApiError(503, f"the server is busy ({self.unfinished - 1} requests waiting); try again later",
                               kind="server_error", code="server_busy",
                               headers={"Retry-After": str(self.retry_after())})
            self.unfinished += 1
            self.jobs.add(job)
        self.executor.submit(self._run, job)
        return job

    def end_all(self, error: ApiError) -> None:
        """Every job not yet finished ends now with `error` (its client is told at once; the model
        thread stops it at its next step, or skips it)."""
        with self.lock:
            jobs = list(self.jobs)
        for job in jobs:
            job.stopped_by = "shutting down"
            job.stop.set()
            job.queue.put_nowait(Failed(error))

    def retry_after(self) -> int:
        mean = sum(self.durations) / len(self.durations) if self.durations else 1.0
        return max(1, round(mean * self.unfinished))

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        events = None
        try:
            if job.stop.is_set():  # its client left while it waited
                return
            self.backend.configure(job.settings)
            events = self.backend.reply(job.conversation)
            new = 0
            for event in events:
                job.put(event)
                new += len(event.step.tokens) if isinstance(event, Piece) and event.step is not None else 0
                if job.stop.is_set():
                    self.log(f"{job.stopped_by}: stopped after {new} new tokens")
                    break
        except Exception as exc:  # noqa: BLE001 -- whatever it is, the request's client is told
            job.put(Failed(exc))
        finally:
            if events is not None:
                events.close()  # between steps the session is consistent
            self.durations.append(time.perf_counter() - start)
            with self.lock:
                self.unfinished -= 1
                self.jobs.discard(job)
            job.put(END)


# -- responses --------------------------------------------------------------------------------
def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


class Api:
    """The routes, around one backend (backends.base.Backend) that answers. tokenizer and context_length: its
    model's, with which prompts are judged before they reach it (config: ServeConfig; base: the
    settings requests start from)."""

    def __init__(self, backend, tokenizer, context_length: int, base: Settings, config: ServeConfig,
                 log=None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.base = base
        self.config = config
        self.log = log or (lambda line: None)
        self.worker = Worker(backend, config.max_queue, self.log)
        self.created = int(time.time())
        self.draining = False
        # Prompts are tokenized off the event loop (the tokenizer lets go of the GIL), one at a time.
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladechat-tokenize")
        # No token covers more characters than the longest in the vocabulary (as the tokenizer spells
        # it: one character per byte, or more), so a prompt of more characters than the budget times
        # that (twice, for normalizers that drop characters) cannot fit: refused without tokenizing.
        self.max_token_chars = 2 * max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        try:  # a tokenizer's first call may change its own settings (truncation): not while serving
            templates.encode(self.tokenizer, [{"role": "user", "content": "hi"}], base.template)
        except templates.TemplateError:
            pass

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model:path}", self.model), Route("/v1/chat/completions", self.chat, methods=["POST"])]
        handlers = {HTTPException: self.http_error, ApiError: self.api_error}
        middleware = [Middleware(Guard, hosts=self.config.hosts, origins=self.config.origins)]
        if self.config.origins:  # the allowed cross-site origins may read the answers (CORS)
            middleware.append(Middleware(CORSMiddleware, allow_origins=sorted(self.config.origins),
                                         allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return ApiError(404, f"no route {request.method} {request.url.path}", code="unknown_url").response()
        return ApiError(exc.status_code, f"{request.method} is not allowed on {request.url.path}").response()

    def check_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "no API key given (Authorization: Bearer KEY)" if not given else "wrong API key",
                           code="invalid_api_key")

    async def health(self, request: Request) -> JSONResponse:
        unfinished = self.worker.unfinished
        return JSONResponse({"status": "draining" if self.draining else "ok", "running": min(unfinished, 1),
                             "waiting": max(unfinished - 1, 0)})

    def model_card(self) -> dict:
        return {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "ladechat",
                "ladechat": {"version": __version__, "model": self.backend.describe(),
                             "context_length": self.context_length, "settings": self.base.as_dict()}}

    async def models(self, request: Request) -> JSONResponse:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        self.check_key(request)
        self.known_model(request.path_params["model"], "model")
        return JSONResponse(self.model_card())

    def known_model(self, name: str, param: str) -> None:
        if name != self.config.model_id:
            raise ApiError(404, f"model {name!r} does not exist here (this server has {self.config.model_id!r})",
                           param=param, code="model_not_found")

    async def chat(self, request: Request):
        self.check_key(request)
        if self.draining:
            raise shutting_down()
        body = await read_body(request)
        # Parsing and tokenizing a large request takes a while: in a thread, so the event loop
        # (other clients' streams, /health, refusals) goes on meanwhile.
        base = self.request_base(request)
        req, conversation, settings = await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.prepare,
                                                                                       body, base)
        if self.draining:
            raise shutting_down()
        job = self.worker.submit(conversation, settings)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # sse-starlette would cut the stream at shutdown: drain() ends it first, with an error event
            return EventSourceResponse(self.stream(job, rid, include_usage), sep="\n",
                                       shutdown_grace_period=self.config.drain_timeout + 5)
        return await self.whole(request, job, rid)

    def request_base(self, request: Request) -> Settings:
        """The settings this request starts from: the server's (a subclass may add what the request
        carries besides the API's fields)."""
        return self.base

    def prepare(self, body: bytes, base: Settings) -> tuple[ChatRequest, Conversation, Settings]:
        """The request in `body`, its conversation and settings, checked (ApiError): valid, for this
        model, and a prompt that fits (refused by size before any tokenizing where it cannot)."""
        req = parse_request(body)
        self.known_model(req.model, "model")
        conversation = conversation_of(req.messages)
        settings = settings_of(base, req)
        self.check_size(conversation, settings)
        self.check_length(conversation, settings)
        return req, conversation, settings

    def budget(self, settings: Settings) -> int:
        return prompt_budget(self.context_length, settings.max_new_tokens)

    def check_size(self, conversation: Conversation, settings: Settings) -> None:
        """Refuse, without tokenizing, a conversation of more characters than any prompt that fits."""
        chars = len(conversation.system or "") + sum(len(m["content"]) for m in conversation.messages)
        budget = self.budget(settings)
        if chars > budget * self.max_token_chars:
            raise ApiError(413, f"the messages hold {chars} characters, more than a prompt of at most {budget} tokens "
                                f"(the model's context of {self.context_length}, after room for the answer) can",
                           param="messages", code="context_length_exceeded")

    def check_length(self, conversation: Conversation, settings: Settings) -> None:
        """Refuse a prompt of more tokens than fit. A long one is first counted a piece at a time,
        stopping once it is known not to fit, so no request costs much more tokenizing (time,
        memory) than a prompt that fits."""
        budget = self.budget(settings)
        texts = [conversation.system or ""] + [m["content"] for m in conversation.messages]
        if sum(map(len, texts)) > COUNT_PIECE and (least := self.tokens_at_least(texts, budget)) > budget:
            raise self.too_long(f"at least {least}", budget)
        try:
            tokens = len(templates.encode(self.tokenizer, conversation.chat_messages(), settings.template))
        except templates.TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if tokens > budget:
            raise self.too_long(str(tokens), budget)

    def too_long(self, tokens: str, budget: int) -> ApiError:
        return ApiError(413, f"the prompt is {tokens} tokens, more than the {budget} that fit in the model's context "
                             f"of {self.context_length} (after room for the answer)",
                        param="messages", code="context_length_exceeded")

    def tokens_at_least(self, texts: list[str], budget: int) -> int:
        """A lower bound on the tokens of `texts` in a prompt, counted COUNT_PIECE characters at a
        time (split at whitespace where there is some), stopping once it passes `budget`. Two pieces
        of a text may tokenize into a few more tokens than the text whole (a token across the
        split): MERGE_SLACK tokens per split are taken off."""
        bound = 0
        for text in texts:
            at = 0
            while at < len(text):
                end = min(at + COUNT_PIECE, len(text))
                if end < len(text):
                    space = max(text.rfind(c, end - COUNT_PIECE // 8, end) for c in " \n\t")
                    end = space if space > at else end
                bound += len(self.tokenizer(text[at:end], add_special_tokens=False)["input_ids"])
                bound -= MERGE_SLACK if at else 0
                at = end
                if bound > budget:
                    return bound
        return bound

    def drain(self) -> None:
        """The server is told to stop (SIGTERM, Ctrl-C): new requests get 503; answers in progress
        (and those waiting) get drain_timeout seconds, then end with an error (event) each."""
        if self.draining:
            return
        self.draining = True
        self.log(f"shutting down: answers in progress get {self.config.drain_timeout:g} s to finish")
        asyncio.get_running_loop().call_later(self.config.drain_timeout, self.worker.end_all, shutting_down())

    def chunk(self, rid: str, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.config.model_id, "system_fingerprint": f"ladechat-{__version__}",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    async def stream(self, job: Job, rid: str, include_usage: bool):
        text = TextStream(job.settings.stop)
        yield {"data": _json(self.chunk(rid, {"role": "assistant", "content": ""}))}
        try:
            async for event in job.events():
                if isinstance(event, Piece):
                    text.add(event)
                    step = event.step
                    if step is None and self.backend.stats_reported:
                        continue  # the rest of its step's text comes with the step
                    segments = text.release()
                    ext = {"segments": segments}
                    if step is not None:
                        ext.update(tokens=step.tokens, guessed=step.guessed, source=step.source, fed=step.fed,
                                   seconds=round(step.seconds, 5))
                    yield {"data": _json(self.chunk(rid, {"content": "".join(s for s, _ in segments)}, ladechat=ext))}
                elif isinstance(event, Notice):
                    yield {"data": _json(self.chunk(rid, {}, ladechat={"notice": event.text}))}
                elif isinstance(event, Done):
                    segments = text.finish()
                    stats = event.stats
                    last = self.chunk(rid, {"content": "".join(s for s, _ in segments)}, FINISH[stats.finish_reason],
                                      ladechat={"segments": segments, "stats": stats.as_dict()})
                    if not include_usage:  # usage goes in the last chunk either way
                        last["usage"] = usage(stats)
                    yield {"data": _json(last)}
                    if include_usage:
                        yield {"data": _json({**self.chunk(rid, {}), "choices": [], "usage": usage(stats)})}
                    self.log_done(stats)
        except Exception as exc:  # noqa: BLE001 -- after the 200: an error event, as OpenAI's API sends one
            yield {"data": _json(self.failure(exc).body())}
        yield {"data": "[DONE]"}

    async def whole(self, request: Request, job: Job, rid: str) -> JSONResponse:
        async def watch() -> None:  # a client that leaves stops the job
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.stop.set()

        text = TextStream(job.settings.stop)
        done = failed = None
        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            try:
                async for event in job.events():
                    if isinstance(event, Piece):
                        text.add(event)
                    elif isinstance(event, Done):
                        done = event
            except Exception as exc:  # noqa: BLE001 -- answered as an error object
                failed = self.failure(exc)
            finally:
                group.cancel_scope.cancel()
        if failed is not None or done is None:
            raise failed or ApiError(500, "the generation ended without a result", kind="server_error")
        text.finish()
        stats = done.stats
        self.log_done(stats)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.config.model_id,
            "system_fingerprint": f"ladechat-{__version__}",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text.text}, "logprobs": None,
                         "finish_reason": FINISH[stats.finish_reason]}],
            "usage": usage(stats), "ladechat": {"token_ids": list(done.text_tokens), "stats": stats.as_dict()}})

    def failure(self, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, ConfigError):
            return ApiError(400, str(exc))
        if isinstance(exc, OutOfMemory):
            return ApiError(503, failure(exc), kind="server_error", code="out_of_memory")
        self.log(f"error: {type(exc).__name__}: {exc}")
        return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error")

    def log_done(self, stats) -> None:
        self.log(f"{stats.prompt_tokens} prompt tokens ({stats.prefill_tokens} prefilled), {stats.new_tokens} new, "
                 f"{stats.decode_tokens_per_s:.1f} tok/s, {stats.compression:.2f} tokens/step, "
                 f"{'lookahead' if stats.lookahead else 'plain'}, {stats.finish_reason}")


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int):
    """A bound socket (port 0: a free one); OSError when the address is taken or not ours."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run(api: Api, sock) -> None:
    """Serve `api` on `sock` until SIGTERM or Ctrl-C, then drain (Api.drain): uvicorn stops taking
    connections and waits for the open ones, which drain() ends in time (a second Ctrl-C: at once)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            api.drain()
            await super().shutdown(sockets)

    config = uvicorn.Config(api.app(), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=api.config.drain_timeout + 10)
    try:
        Server(config).run(sockets=[sock])
    finally:
        api.tokenizing.shutdown(wait=False, cancel_futures=True)
        api.worker.executor.shutdown(wait=False, cancel_futures=True)
