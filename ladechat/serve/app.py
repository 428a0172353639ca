"""`ladechat serve`: one backend (a model loaded here) behind an OpenAI-compatible HTTP API.

    GET  /health                 {"status": "ok", "running": 0 or 1, "waiting": N} (no key needed)
    GET  /v1/models[/{id}]       the one model; "ladechat" holds its settings
    POST /v1/chat/completions    answers, whole or streamed as server-sent events

Requests run one at a time, in arrival order, on one model thread (worker.py; the KV cache is the
backend's: a conversation that extends the previous one prefills only its new tokens). At most
`max_queue` wait; more get 503 with Retry-After. A client that goes away stops its generation at
the next step. The server's max_new_tokens caps every answer. A request is refused (guard.py)
when a web page could have sent it (another site's Origin, a Host that is not this server's, a
body that is not JSON), and before it costs much when it cannot be answered (read_body: over
MAX_BODY; Api.check_size and Api.check_length: a prompt that cannot fit, judged by its size,
then by its first tokens). The request and response formats are wire.py's.
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
import functools
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anyio
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ladechat import __version__, templates
from ladechat.backends.events import Notice, Piece
from ladechat.conversation import Conversation, prompt_budget
from ladechat.engine.config import ConfigError
from ladechat.engine.events import Done, OutOfMemory
from ladechat.engine.grammar import GrammarError
from ladechat.serve.guard import ClientGone, Guard, read_body
from ladechat.serve.tooling import Tooling, schema_texts, tooling_of
from ladechat.serve.wire import (
    FINISH,
    ApiError,
    ChatRequest,
    CompletionRequest,
    TextStream,
    conversation_of,
    parse_request,
    settings_of,
    shutting_down,
    usage,
)
from ladechat.serve.worker import Job, Worker
from ladechat.settings import Settings
from ladechat.ui.stream import failure

COUNT_PIECE = 16384  # characters of a long prompt tokenized at a time to learn whether it fits
MERGE_SLACK = 4  # tokens two pieces of a text may take beyond the text whole


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # the name clients ask for
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait while one runs
    hosts: frozenset[str] | None = None  # Host header names taken (None: any); see allowed_hosts
    origins: frozenset[str] = frozenset()  # cross-site origins allowed besides the server's own ("*": any)
    drain_timeout: float = 5.0  # seconds answers in progress get to finish once the server is told to stop
    request_timeout: float = 30.0  # seconds a connection has to send a whole request (its head and body)


class Api:
    """The routes, around one backend (backends.base.Backend) that answers. tokenizer and context_length: its
    model's, with which prompts are judged before they reach it (config: ServeConfig; base: the
    settings requests start from)."""

    def __init__(self, backend, tokenizer, context_length: int, base: Settings, config: ServeConfig,
                 log=None, model_thread=None) -> None:
        """model_thread: the serve.worker.ModelThread the backend was loaded for, if any."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.base = base
        self.config = config
        self.log = log or (lambda line: None)
        self.worker = Worker(backend, config.max_queue, self.log, model_thread)
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
                  Route("/v1/models/{model:path}", self.model), Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        handlers = {HTTPException: self.http_error, ApiError: self.api_error, ClientGone: self.client_gone}
        middleware = [Middleware(Guard, hosts=self.config.hosts, origins=self.config.origins)]
        if self.config.origins:  # the allowed cross-site origins may read the answers (CORS)
            middleware.append(Middleware(CORSMiddleware, allow_origins=sorted(self.config.origins),
                                         allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def client_gone(self, request: Request, exc: Exception) -> Response:
        return Response(status_code=400)  # sent nowhere: the connection is closed

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return ApiError(404, f"no route {request.method} {request.url.path}", code="unknown_url").response()
        return ApiError(exc.status_code, f"{request.method} is not allowed on {request.url.path}").response()

    def check_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "").strip()
        scheme, _, given = header.partition(" ")
        if not header:
            why = "no API key given (Authorization: Bearer KEY)"
        elif scheme.lower() != "bearer" or not given.strip():
            why = "the Authorization header wants the Bearer scheme: Authorization: Bearer KEY"
        elif not hmac.compare_digest(given.strip().encode(), self.config.api_key.encode()):
            why = "wrong API key"
        else:
            return
        raise ApiError(401, why, code="invalid_api_key")

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
        return await self.respond(request, self.prepare, "chatcmpl", text=False)

    async def completions(self, request: Request):
        """/v1/completions: the prompt continued as written (no chat template: a base model's way)."""
        return await self.respond(request, self.prepare_text, "cmpl", text=True)

    async def respond(self, request: Request, prepare, prefix: str, text: bool):
        """A request's answer: prepare(body, base) checks it into (request, conversation, settings,
        tooling); `text`: a completion's answer, not a chat's."""
        self.check_key(request)
        if self.draining:
            raise shutting_down()
        body = await read_body(request, self.config.request_timeout)
        # Parsing and tokenizing a large request takes a while: in a thread, so the event loop
        # (other clients' streams, /health, refusals) goes on meanwhile.
        base = self.request_base(request)
        req, conversation, settings, tooling = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, prepare, body, base)
        if self.draining:
            raise shutting_down()
        job = self.worker.submit(conversation, settings)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # sse-starlette would cut the stream at shutdown: drain() ends it first, with an error event
            return EventSourceResponse(self.stream(job, rid, include_usage, tooling, text), sep="\n",
                                       shutdown_grace_period=self.config.drain_timeout + 5)
        return await self.whole(request, job, rid, tooling, text)

    def prepare_text(self, body: bytes, base: Settings) -> tuple[CompletionRequest, Conversation, Settings, None]:
        """A /v1/completions request, its prompt as a conversation rendered by the RAW template
        (the text as given), and its settings, checked as prepare() checks a chat's."""
        req = parse_request(body, CompletionRequest)
        self.known_model(req.model, "model")
        conversation = Conversation(messages=[{"role": "user", "content": req.text}])
        settings = settings_of(base, req).updated({"template": templates.RAW})
        if settings.format is not None:
            self.check_format(settings.format, "response_format")
        self.check_size(conversation, settings, "prompt")
        self.check_length(conversation, settings, "prompt")
        return req, conversation, settings, None

    def request_base(self, request: Request) -> Settings:
        """The settings this request starts from: the server's (a subclass may add what the request
        carries besides the API's fields)."""
        return self.base

    def prepare(self, body: bytes, base: Settings) -> tuple[ChatRequest, Conversation, Settings, Tooling | None]:
        """The request in `body`, its conversation, settings and tools, checked (ApiError): valid, for
        this model, and a prompt that fits (refused by size before any tokenizing where it cannot)."""
        req = parse_request(body)
        self.known_model(req.model, "model")
        conversation = conversation_of(req.messages)
        settings = settings_of(base, req)
        tooling = tooling_of(req, templates.text_of(self.tokenizer, settings.template, tools=bool(req.tools)),
                             self.tokenizer.get_added_vocab())
        asked_format = settings.format is not None and "response_format" in (req.model_extra or {})
        if tooling is not None and asked_format:
            raise ApiError(400, "response_format: an answer held to a format cannot call tools (tool_choice: "
                                "none to ask for the format)", param="response_format")
        if settings.format is not None and tooling is None:  # refused now, not after a stream has begun
            self.check_format(settings.format, "response_format")
        self.check_control_tokens(conversation, tooling)
        if tooling is not None:
            conversation.tools = tooling.tools
            if tooling.grammar is not None:  # the functions it may call compile alone first, to name the one that does not
                for field, schema in schema_texts(tooling):
                    self.check_format(schema, field)
                self.check_format(tooling.grammar, "tool_choice")
            # the grammar of forced calls, or none (a server's own format does not hold a tools answer); set
            # past Settings' check, which takes only the formats a user gives
            settings = settings.model_copy(update={"format": tooling.grammar})
        self.check_size(conversation, settings)
        self.check_length(conversation, settings)
        return req, conversation, settings, tooling

    def check_control_tokens(self, conversation: Conversation, tooling: Tooling | None) -> None:
        """ApiError 400 where text that a template renders outside a message's content (the tools,
        an assistant's calls, a tool result's id and name) spells one of the model's control tokens."""
        calls = [m["tool_calls"] for m in conversation.messages if "tool_calls" in m]
        results = [[m.get("tool_call_id"), m.get("name")] for m in conversation.messages if m["role"] == "tool"]
        for field, value in (("tools", tooling.tools if tooling else None), ("messages", [calls, results])):
            spelled = templates.spelled_special(self.tokenizer, json.dumps(value, ensure_ascii=False)) if value else None
            if spelled is not None:
                raise ApiError(400, f"{field}: spells the model's control token {spelled!r} outside a message's content",
                               param=field)

    def check_format(self, answer_format: str, field: str) -> None:
        """ApiError 400 naming `field` where the model cannot hold answers to the format."""
        try:
            self.backend.check_format(answer_format)
        except GrammarError as exc:
            raise ApiError(400, f"{field}: {exc}", param=field) from None

    def budget(self, settings: Settings) -> int:
        return prompt_budget(self.context_length, settings.max_new_tokens)

    def check_size(self, conversation: Conversation, settings: Settings, param: str = "messages") -> None:
        """Refuse, without tokenizing, a conversation of more characters than any prompt that fits."""
        chars = (len(conversation.system or "") + sum(len(m["content"]) for m in conversation.messages)
                 + len(json.dumps(conversation.tools or [])))
        budget = self.budget(settings)
        if chars > budget * self.max_token_chars:
            raise ApiError(413, f"the messages hold {chars} characters, more than a prompt of at most {budget} tokens "
                                f"(the model's context of {self.context_length}, after room for the answer) can",
                           param=param, code="context_length_exceeded")

    def check_length(self, conversation: Conversation, settings: Settings, param: str = "messages") -> None:
        """Refuse a prompt of more tokens than fit. A long one is first counted a piece at a time,
        stopping once it is known not to fit, so no request costs much more tokenizing (time,
        memory) than a prompt that fits."""
        budget = self.budget(settings)
        texts = ([conversation.system or ""] + [m["content"] for m in conversation.messages]
                 + [json.dumps([conversation.tools, [m.get("tool_calls") for m in conversation.messages]])])
        if sum(map(len, texts)) > COUNT_PIECE and (least := self.tokens_at_least(texts, budget)) > budget:
            raise self.too_long(f"at least {least}", budget, param)
        try:
            tokens = len(templates.encode(self.tokenizer, conversation.chat_messages(), settings.template,
                                          conversation.tools))
        except templates.TemplateError as exc:
            raise ApiError(400, str(exc), param=param) from None
        if tokens == 0:  # a completion's empty prompt, with no beginning-of-text token: nothing to go on from
            raise ApiError(400, f"{param}: the prompt is no tokens (empty)", param=param)
        if tokens > budget:
            raise self.too_long(str(tokens), budget, param)

    def too_long(self, tokens: str, budget: int, param: str = "messages") -> ApiError:
        return ApiError(413, f"the prompt is {tokens} tokens, more than the {budget} that fit in the model's context "
                             f"of {self.context_length} (after room for the answer)",
                        param=param, code="context_length_exceeded")

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

    def chunk(self, rid: str, delta: dict, finish: str | None = None, text: bool = False, **extra) -> dict:
        """A stream's chunk: a chat's (delta), or with `text` a completion's (its text)."""
        choice = {"index": 0, "text": delta.get("content", "")} if text else {"index": 0, "delta": delta}
        return {"id": rid, "object": "text_completion" if text else "chat.completion.chunk", "created": int(time.time()),
                "model": self.config.model_id, "system_fingerprint": f"ladechat-{__version__}",
                "choices": [{**choice, "logprobs": None, "finish_reason": finish}], **extra}

    async def stream(self, job: Job, rid: str, include_usage: bool, tooling: Tooling | None = None, text: bool = False):
        """The answer as server-sent events; `text`: a completion's chunks, not a chat's."""
        chunk = functools.partial(self.chunk, text=text)
        calls = Calls(tooling)
        if not text:
            yield {"data": _json(chunk(rid, {"role": "assistant", "content": ""}))}
        pieces = TextStream(job.settings.stop_strings())
        try:
            async for event in job.events():
                if isinstance(event, Piece):
                    pieces.add(event)
                    step = event.step
                    if step is None and self.backend.stats_reported:
                        continue  # the rest of its step's text comes with the step
                    segments = pieces.release()
                    ext = {"segments": segments}
                    if step is not None:
                        ext.update(tokens=step.tokens, guessed=step.guessed, source=step.source, fed=step.fed,
                                   seconds=round(step.seconds, 5))
                    content, new_calls = calls.add(segments, ext)
                    yield {"data": _json(chunk(rid, {"content": content}, ladechat=ext))}
                    for delta in new_calls:
                        yield {"data": _json(chunk(rid, {"tool_calls": [delta]}))}
                elif isinstance(event, Notice):
                    yield {"data": _json(chunk(rid, {}, ladechat={"notice": event.text}))}
                elif isinstance(event, Done):
                    segments = pieces.finish()
                    stats = event.stats
                    ext = {"segments": segments, "stats": stats.as_dict()}
                    content, new_calls = calls.add(segments, ext, final=True)
                    for delta in new_calls:
                        yield {"data": _json(chunk(rid, {"tool_calls": [delta]}))}
                    last = chunk(rid, {"content": content}, calls.finish_reason(stats), ladechat=ext)
                    if not include_usage:  # usage goes in the last chunk either way
                        last["usage"] = usage(stats)
                    yield {"data": _json(last)}
                    if include_usage:
                        yield {"data": _json({**chunk(rid, {}), "choices": [], "usage": usage(stats)})}
                    self.log_done(stats)
        except Exception as exc:  # noqa: BLE001 -- after the 200: an error event, as OpenAI's API sends one
            yield {"data": _json(self.failure(exc).body())}
        yield {"data": "[DONE]"}

    async def whole(self, request: Request, job: Job, rid: str, tooling: Tooling | None = None,
                    text: bool = False) -> JSONResponse:
        """The whole answer; `text`: a completion's (its text), not a chat's (a message)."""
        answer = await self.answer(request, job)
        if isinstance(answer, ApiError):
            raise answer
        done, whole = answer
        stats = done.stats
        calls = Calls(tooling)
        content, _ = calls.add([(whole, False)], {}, final=True)
        if text:
            choice = {"text": content}
        else:
            message = {"role": "assistant", "content": content if tooling is None else content or None}
            if calls.sent:
                message["tool_calls"] = [call.as_openai() for call in calls.sent]
            choice = {"message": message}
        return JSONResponse({
            "id": rid, "object": "text_completion" if text else "chat.completion", "created": int(time.time()),
            "model": self.config.model_id, "system_fingerprint": f"ladechat-{__version__}",
            "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": calls.finish_reason(stats)}],
            "usage": usage(stats), "ladechat": {"token_ids": list(done.text_tokens), "stats": stats.as_dict()}})

    async def answer(self, request: Request, job: Job):
        """(Done, the answer's text) once the job ends, or the ApiError it ended with."""
        async def watch() -> None:  # a client that leaves stops the job
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.stop.set()

        text = TextStream(job.settings.stop_strings())
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
            return failed or ApiError(500, "the generation ended without a result", kind="server_error")
        text.finish()
        self.log_done(done.stats)
        return done, text.text

    def failure(self, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, GrammarError):  # the model's tokenizer cannot hold answers to the schema
            return ApiError(400, f"response_format: {exc}", param="response_format")
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


class Calls:
    """An answer's text on its way to the client when it may hold tool calls (tooling: else it
    passes as it is): its content, and each call as a stream's tool_calls delta once whole."""

    def __init__(self, tooling: Tooling | None) -> None:
        self.tooling = tooling
        self.reader = tooling.reader() if tooling is not None else None
        self.sent: list = []  # the ToolCalls sent

    def add(self, segments: list[tuple[str, bool]], ext: dict, final: bool = False) -> tuple[str, list[dict]]:
        """(the content to send now, tool_calls deltas), from the segments TextStream released; the
        segments in `ext` become the content's own where some text was read as calls."""
        text = "".join(s for s, _ in segments)
        if self.reader is None:
            return text, []
        content, calls = self.reader.add(text)
        if final:
            more, last = self.reader.finish()
            content, calls = content + more, calls + last
        calls = self.tooling.taken(calls, len(self.sent))
        deltas = [call.as_openai(len(self.sent) + i) for i, call in enumerate(calls)]
        self.sent += calls
        if "segments" in ext and content != text:
            ext["segments"] = [[content, False]] if content else []
        return content, deltas

    def finish_reason(self, stats) -> str:
        if self.sent and stats.finish_reason in ("eos", "stop"):
            return "tool_calls"
        return FINISH[stats.finish_reason]


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def bind(host: str, port: int):
    """A bound socket (port 0: a free one); OSError when the address is taken or not ours. It listens
    from listen() on: while the model loads a client is refused at once, not left waiting."""
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


def listen(sock) -> None:
    """Take connections on `sock` from now on (before the banner: a client that connects once it
    is out waits for uvicorn, never refused)."""
    sock.listen(2048)


def run(api: Api, sock) -> None:
    """Serve `api` on `sock` until SIGTERM or Ctrl-C, then drain (Api.drain): uvicorn stops taking
    connections and waits for the open ones, which drain() ends in time (a second Ctrl-C: at once)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            api.drain()
            await super().shutdown(sockets)

    config = uvicorn.Config(api.app(), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=api.config.drain_timeout + 10,
                            http=deadline_protocol(api.config.request_timeout))
    try:
        Server(config).run(sockets=[sock])
    finally:
        api.tokenizing.shutdown(wait=False, cancel_futures=True)
        api.worker.executor.shutdown(wait=False, cancel_futures=True)


def deadline_protocol(seconds: float):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head: a connection that opens
    and sends nothing, or half a request line or headers, and one kept alive that starts a request
    and stalls, is closed `seconds` after it opened or its last response ended (uvicorn itself
    closes only idle kept-alive connections, and only once a response has been sent). The body has
    the same time (guard.read_body)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11(H11Protocol):
        _deadline = None
        _armed_for = None  # the request cycle the deadline was set after (None: the connection's first)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._armed_for = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is self._armed_for and not self.transport.is_closing():  # no request has begun since
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._armed_for:  # a request's head arrived: its body has read_body's deadline
                self._disarm()

        def on_response_complete(self) -> None:
            # armed for the cycle that just ended, before uvicorn starts a pipelined next one (its
            # handle_events then disarms: that request's head is whole)
            self._arm()
            super().on_response_complete()
            if self.transport.is_closing():
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return DeadlineH11
