"""`ladechat serve`: one loaded model behind an OpenAI-compatible HTTP API, decoding with lookahead.

    GET  /health                 {"status": "ok", "running": 0 or 1, "waiting": N} (no key needed)
    GET  /v1/models[/{id}]       the one model; "ladechat" holds its settings
    POST /v1/chat/completions    answers, whole or streamed as server-sent events

Requests run one at a time, in arrival order, on one model thread (the Bot and its KV cache: a
conversation that extends the previous one prefills only its new tokens). At most `max_queue`
wait; more get 503 with Retry-After. A client that goes away stops its generation at the next step.

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
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ladechat import __version__, templates
from ladechat.bot import Notice, prompt_budget
from ladechat.conversation import Conversation
from ladechat.detok import Detokenizer
from ladechat.engine.config import ConfigError
from ladechat.engine.events import Done, Step
from ladechat.settings import Settings

MAX_BODY = 8 * 1024 * 1024  # bytes of JSON in one request
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


class Extension(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lookahead: bool | None = None
    W: int | None = None
    N: int | None = None
    G: int | None = None
    context_candidates: int | None = None
    context_len: int | None = None
    recycle: int | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
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
    stop: str | list[str] | None = None
    n: int = 1
    ladechat: Extension | None = None


def parse_request(body: bytes) -> ChatRequest:
    if len(body) > MAX_BODY:
        raise ApiError(413, f"the request body is {len(body)} bytes, more than the {MAX_BODY} this server takes")
    try:
        req = ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "json_invalid":
            raise ApiError(400, "the request body is not valid JSON") from None
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None
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
        return m.content or ""
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{i}]: only text content is supported, got a {part.type!r} part",
                           param=f"messages.{i}.content")
    return "".join(part.text for part in m.content)


def settings_of(base: Settings, req: ChatRequest) -> Settings:
    """The server's settings with the request's own on top (ApiError 400 for a value out of range)."""
    ext = req.ladechat or Extension()
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    values = {"max_new_tokens": req.max_completion_tokens or req.max_tokens, "temperature": req.temperature,
              "top_p": req.top_p, "top_k": None if req.top_k is None else max(req.top_k, 0), "min_p": req.min_p,
              "repetition_penalty": req.repetition_penalty, "seed": req.seed,
              **ext.model_dump()}
    values = {k: v for k, v in values.items() if v is not None}
    values["stop"] = list(base.stop) + [s for s in stop if s]
    try:
        return base.updated(values)
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from None


# -- text for the wire ------------------------------------------------------------------------
class TextStream:
    """Steps -> text segments (text, parallel). With stop strings, the last characters that could
    begin one are held back until the answer ends, so the stop string itself is never sent."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.detok = Detokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.parallel: list[bool] = []  # per character of text
        self.sent = 0

    def add(self, step: Step) -> list[tuple[str, bool]]:
        n = sum(step.guessed)
        guessed = self.detok.add(step.tokens[:n]) if n else ""
        own = self.detok.add(step.tokens[n:])
        self.text += guessed + own
        self.parallel += [True] * len(guessed) + [False] * len(own)
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


# -- the model thread -------------------------------------------------------------------------
END = object()


@dataclass
class Failed:
    error: BaseException


@dataclass
class Job:
    """One request's generation: events come back through `queue`; `stop` ends it at the next step."""

    conversation: Conversation
    settings: Settings
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)

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

    def __init__(self, bot, max_queue: int, log=None) -> None:
        self.bot = bot
        self.log = log or (lambda line: None)
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladechat-model")
        self.lock = threading.Lock()
        self.unfinished = 0
        self.durations: deque[float] = deque(maxlen=8)

    def submit(self, conversation: Conversation, settings: Settings) -> Job:
        with self.lock:
            if self.unfinished > self.max_queue:
                raise ApiError(503, f"the server is busy ({self.unfinished - 1} requests waiting); try again later",
                               kind="server_error", code="server_busy",
                               headers={"Retry-After": str(self.retry_after())})
            self.unfinished += 1
        job = Job(conversation, settings, asyncio.get_running_loop())
        self.executor.submit(self._run, job)
        return job

    def retry_after(self) -> int:
        mean = sum(self.durations) / len(self.durations) if self.durations else 1.0
        return max(1, round(mean * self.unfinished))

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        events = None
        try:
            if job.stop.is_set():  # its client left while it waited
                return
            self.bot.configure(job.settings)
            events = self.bot.reply(job.conversation)
            new = 0
            for event in events:
                job.put(event)
                new += len(event.tokens) if isinstance(event, Step) else 0
                if job.stop.is_set():
                    self.log(f"client gone: stopped after {new} new tokens")
                    break
        except Exception as exc:  # noqa: BLE001 -- whatever it is, the request's client is told
            job.put(Failed(exc))
        finally:
            if events is not None:
                events.close()  # between steps the session is consistent
            self.durations.append(time.perf_counter() - start)
            with self.lock:
                self.unfinished -= 1
            job.put(END)


# -- responses --------------------------------------------------------------------------------
def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


class Api:
    """The routes, around one Bot (config: ServeConfig; base: the settings requests start from)."""

    def __init__(self, bot, base: Settings, config: ServeConfig, log=None) -> None:
        self.bot = bot
        self.tokenizer = bot.loaded.tokenizer
        self.context_length = bot.loaded.context_length
        self.base = base
        self.config = config
        self.log = log or (lambda line: None)
        self.worker = Worker(bot, config.max_queue, self.log)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model:path}", self.model), Route("/v1/chat/completions", self.chat, methods=["POST"])]
        handlers = {HTTPException: self.http_error, ApiError: self.api_error}
        return Starlette(routes=routes, exception_handlers=handlers)

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
        return JSONResponse({"status": "ok", "running": min(unfinished, 1), "waiting": max(unfinished - 1, 0)})

    def model_card(self) -> dict:
        return {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "ladechat",
                "ladechat": {"version": __version__, "model": self.bot.describe(),
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
        req = parse_request(await request.body())
        self.known_model(req.model, "model")
        conversation = conversation_of(req.messages)
        settings = settings_of(self.base, req)
        self.check_length(conversation, settings)
        job = self.worker.submit(conversation, settings)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(self.stream(job, rid, include_usage), sep="\n")
        return await self.whole(request, job, rid)

    def check_length(self, conversation: Conversation, settings: Settings) -> None:
        try:
            ids = templates.encode(self.tokenizer, conversation.chat_messages(), settings.template)
        except templates.TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        budget = prompt_budget(self.context_length, settings.max_new_tokens)
        if len(ids) > budget:
            raise ApiError(413, f"the prompt is {len(ids)} tokens, more than the {budget} that fit in the model's "
                                f"context of {self.context_length} (after room for the answer)",
                           param="messages", code="context_length_exceeded")

    def chunk(self, rid: str, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.config.model_id, "system_fingerprint": f"ladechat-{__version__}",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    async def stream(self, job: Job, rid: str, include_usage: bool):
        text = TextStream(self.tokenizer, job.settings.stop)
        yield {"data": _json(self.chunk(rid, {"role": "assistant", "content": ""}))}
        try:
            async for event in job.events():
                if isinstance(event, Step):
                    segments = text.add(event)
                    yield {"data": _json(self.chunk(rid, {"content": "".join(s for s, _ in segments)}, ladechat={
                        "segments": segments, "tokens": event.tokens, "guessed": event.guessed,
                        "source": event.source, "fed": event.fed, "seconds": round(event.seconds, 5)}))}
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

        text = TextStream(self.tokenizer, job.settings.stop)
        done = failed = None
        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            try:
                async for event in job.events():
                    if isinstance(event, Step):
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
        message = self.bot.failure(exc)
        if message is not None:
            return ApiError(503, message, kind="server_error", code="out_of_memory")
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


def run(app: Starlette, sock) -> None:
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
