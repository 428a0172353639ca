"""The wire format of `ladechat serve`: requests (OpenAI's chat completions, plus the "ladechat"
extension), checked into a Conversation and Settings, with 400s in the client's own terms; the
text a stream sends (TextStream); errors as OpenAI error objects (ApiError); usage."""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from starlette.responses import JSONResponse

from ladechat.backends.events import Piece
from ladechat.conversation import Conversation
from ladechat.engine.config import ConfigError
from ladechat.settings import Settings, group, key

MAX_OBJECTS = 8192  # JSON objects in one request (messages, content parts, ...): pydantic holds the GIL
MAX_STOP = 16  # stop strings in one request
SURROGATE = re.compile("[\ud800-\udfff]")  # JSON can spell lone surrogates; no tokenizer takes them
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "interrupted": "stop"}
# OpenAI parameters this server cannot honour: refused rather than silently ignored.
UNSUPPORTED = ("functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "audio", "modalities", "prediction")
ZERO_PENALTIES = ("frequency_penalty", "presence_penalty")
UNSUPPORTED_TEXT = ("echo", "suffix")  # besides UNSUPPORTED, for /v1/completions
TEXT_MAX_TOKENS = 16  # /v1/completions' max_tokens when a request gives none, as OpenAI's API has it



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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI's API writes it


class CallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[CallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers
    name: str | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: Function


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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    ladechat: Extension | None = None


class CompletionRequest(BaseModel):
    """/v1/completions: a prompt continued as written (no chat template)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int = Field(TEXT_MAX_TOKENS, ge=1)
    max_completion_tokens: None = None  # the chat's name only: settings_of reads both
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: int = 1
    best_of: int | None = None
    ladechat: Extension | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_tokens(cls, value):
        return TEXT_MAX_TOKENS if value is None else value  # null: OpenAI's default, not the server's cap

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# The names a client gives: a pydantic error's location keeps these and drops the rest (the
# union member that was tried, e.g. "str" in stop.str).
FIELD_NAMES = frozenset().union(*(m.model_fields for m in (ChatRequest, Message, Part, StreamOptions, Extension,
                                                           CallIn, CalledFunction, Tool, Function, CompletionRequest)))
UNION_MESSAGES = {"stop": "must be a string or a list of strings",
                  "content": "must be a string, a list of content parts or null",
                  "prompt": "must be a string (or a list of one string)",
                  "tool_choice": "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}"}


class _TooManyObjects(Exception):
    pass


def parse_request(body: bytes, shape: type[BaseModel] = ChatRequest):
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
        req = shape.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.n != 1:
        raise ApiError(400, f"n must be 1 (this server gives one answer per request), got {req.n}", param="n")
    if isinstance(req, CompletionRequest) and req.best_of not in (None, 1):
        raise ApiError(400, f"best_of must be 1 (this server gives one answer per request), got {req.best_of}",
                       param="best_of")
    extra = req.model_extra or {}
    for name in UNSUPPORTED + (UNSUPPORTED_TEXT if isinstance(req, CompletionRequest) else ()):
        if extra.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by ladechat serve", param=name)
    for name in ZERO_PENALTIES:
        if extra.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported by ladechat serve (repetition_penalty is)", param=name)
    if isinstance(req, CompletionRequest):
        if "response_format" in extra:
            raise ApiError(400, "response_format is for /v1/chat/completions", param="response_format")
        if SURROGATE.search(req.text):
            raise ApiError(400, "prompt: holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text", param="prompt")
        return req
    answer_format(req)  # its shape; whether the model can hold answers to it is the backend's to say
    return req


def answer_format(req: ChatRequest) -> str | None:
    """The request's response_format as a setting (Settings.format): None for text, "json" for
    json_object, a json_schema's schema as JSON text. ApiError 400 naming the field for any other shape."""
    fmt = (req.model_extra or {}).get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(400, "response_format: must be a JSON object with a type", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
                       param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema: must be a JSON object with a schema",
                       param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema: must be a JSON object (a JSON Schema)",
                       param="response_format.json_schema.schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ApiError(400, "response_format.json_schema.strict: must be true or false",
                       param="response_format.json_schema.strict")
    return json.dumps(schema)


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
    """System (or developer) messages first, then the turns, ending with the user's message or with
    tool results; an assistant's tool calls and a tool's results as chat templates read them."""
    system: list[str] = []
    turns: list[dict] = []
    called: dict[str, str] = {}  # call id -> function name
    for i, m in enumerate(messages):
        text = _text(m, i)
        if m.role in ("system", "developer"):
            if turns:
                raise ApiError(400, f"messages[{i}]: a {m.role} message must come before the conversation",
                               param=f"messages.{i}.role")
            system.append(text)
        elif m.role == "assistant" and m.tool_calls:
            turns.append({"role": "assistant", "content": text, "tool_calls": [_call_in(c, i, j, called)
                                                                                for j, c in enumerate(m.tool_calls)]})
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers",
                               param=f"messages.{i}.tool_call_id")
            name = m.name or called.get(m.tool_call_id, "")
            turns.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id, "name": name})
        else:
            turns.append({"role": m.role, "content": text})
    if not turns or turns[-1]["role"] not in ("user", "tool"):
        raise ApiError(400, "the last message must be the user's (or a tool's result)", param="messages")
    return Conversation(system="\n\n".join(system) or None, messages=turns)


def _call_in(call: CallIn, i: int, j: int, called: dict[str, str]) -> dict:
    """An assistant's call as templates take it: the arguments as an object, not JSON text."""
    where = f"messages.{i}.tool_calls.{j}.function.arguments"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):
        raise ApiError(400, f"{where}: must be JSON text of an object", param=where) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}: must be JSON text of an object", param=where)
    called[call.id] = call.function.name
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


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


def settings_of(base: Settings, req: ChatRequest | CompletionRequest) -> Settings:
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
    if "response_format" in (req.model_extra or {}):  # {"type": "text"} (None) turns a server's own format off
        values["format"] = answer_format(req)
    values["stop"] = list(base.stop) + [s for s in stop if s]
    try:
        return base.updated(values)
    except ConfigError as exc:
        names = {**REQUEST_NAMES, "format": "response_format",
                 "max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
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
        """The segments added since the last release, but those held back: the characters that
        could begin a stop string, and a whole one with what follows it (the step that completes a
        stop string can bring it in at once, with text after it)."""
        return self._release(min(len(self.text) - self.hold, self._stop_at()))

    def finish(self) -> list[tuple[str, bool]]:
        return self._release(self._stop_at(), final=True)

    def _stop_at(self) -> int:
        """Where the first stop string in the text begins (its length when there is none)."""
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(found, default=len(self.text))

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


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", code="server_shutting_down")


# -- responses --------------------------------------------------------------------------------
def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}
