"""`--api URL`: the chat and `ask` as clients of an OpenAI-compatible server.

RemoteBot answers like a local Bot (base.Backend), as the same event stream: the server's text
comes as Pieces (with ladechat serve: the parts accepted in parallel marked, and each step's
tokens), then one Done. Against ladechat serve its Stats are the server's; against any other
server (vLLM, TGI, llama.cpp, ollama, TensorRT-LLM, ...) they hold what that server reported
(usage) and what the client measured, and `stats_reported` is False.

No torch or transformers here: httpx speaks HTTP and reads the server-sent events itself.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from ladechat.backends.base import RemoteError, ServerFailure
from ladechat.backends.events import Notice, Piece, pieces
from ladechat.conversation import Conversation, ConversationError, dropped_notice
from ladechat.engine.config import ConfigError, LookaheadConfig
from ladechat.engine.events import Done, Stats, Step, Tally
from ladechat.settings import Settings, group, key, keys

# The settings sent with each request, by key: the lookahead ones in the "ladechat" extension (to
# ladechat serve only), the sampling ones as the API's own fields.
LOOKAHEAD_KEYS = tuple(key(name) for name in group("lookahead"))
SAMPLING_KEYS = tuple(key(name) for name in group("sampling"))


def response_format(answer_format: str | None) -> dict:
    """OpenAI's response_format for a format setting (None: text, "json", or a JSON schema's text)."""
    if answer_format is None:
        return {"type": "text"}
    if answer_format == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": json.loads(answer_format)}}


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API's base, e.g. http://gpu-box:8000/v1
    key: str | None = None

    @staticmethod
    def of(url: str, key: str | None) -> Endpoint:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RemoteError(f"--api wants an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
        path = parts.path.rstrip("/") or "/v1"  # a bare host means the usual /v1
        return Endpoint(f"{parts.scheme}://{parts.netloc}{path}", key or None)

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc


class RemoteBot:
    """A model behind an OpenAI-compatible API. `given`: the setting keys the user chose (flags);
    against other servers only those are sent, the rest is the server's to decide."""

    compiled = False
    ready = True

    def __init__(self, endpoint: Endpoint, model: str | None, settings: dict, given: set[str],
                 client: httpx.Client | None = None) -> None:
        self.endpoint = endpoint
        # no TLS context for plain http (loading the CA bundle alone slows start-up)
        self.client = client or httpx.Client(timeout=httpx.Timeout(30.0, read=None),
                                             verify=not endpoint.url.startswith("http://"))
        cards = self._get("/models").get("data") or []
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        if not ids:
            raise RemoteError(f"the server at {endpoint.url} lists no models")
        if model is not None and model not in ids:
            raise RemoteError(f"the server at {endpoint.url} has no model {model!r} (it has: {', '.join(map(str, ids))})")
        self.name = model if model is not None else ids[0]
        self.host = endpoint.host
        card = cards[ids.index(self.name)]
        info = card.get("ladechat") if isinstance(card.get("ladechat"), dict) else None
        self.stats_reported = info is not None  # ladechat serve
        self.info = info or {}  # ladechat serve's account of itself (model, settings, context_length)
        defaults = Settings.for_lookahead(LookaheadConfig(enabled=info is not None))
        try:
            if info is not None:
                served = info.get("settings") if isinstance(info.get("settings"), dict) else {}
                defaults = defaults.updated({k: v for k, v in served.items() if k in keys()})  # a newer server's extras: ignored
            elif given & set(LOOKAHEAD_KEYS):
                raise ConfigError(self._not_ladechat("lookahead, -W, -N, -G, --context-candidates, --context-len and --recycle"))
            self.settings = defaults.updated({k: v for k, v in settings.items() if k in given})
        except ConfigError as exc:
            raise RemoteError(str(exc)) from None
        self.given = set(given)
        self.usage: dict | None = None  # the usage the server reported with the last answer, if any

    # -- Backend ------------------------------------------------------------------------------
    def describe(self) -> str:
        return f"{self.name} at {self.endpoint.url}" + ("" if self.stats_reported else " (not ladechat serve)")

    def configure(self, settings: Settings) -> None:
        old, new = self.settings.as_dict(), settings.as_dict()
        changed = {k for k in new if new[k] != old[k]}
        if "template" in changed:
            raise ConfigError("the template is the server's (it renders the conversation)")
        if "store" in changed:
            raise ConfigError(self._store_is_the_servers())
        if not self.stats_reported and changed & set(LOOKAHEAD_KEYS):
            raise ConfigError(self._not_ladechat("/lookahead, W, N, G, context_candidates, context_len and recycle"))
        self.given |= changed
        self.settings = settings

    def warm_up(self) -> None:
        pass

    def clear_store(self) -> int:
        raise ConfigError(self._store_is_the_servers())

    def _store_is_the_servers(self) -> str:
        return ("the store of past answers is the server's (start it with --no-store, or run "
                "'ladechat store clear' there)")

    # -- answering ----------------------------------------------------------------------------
    def reply(self, conversation: Conversation) -> Iterator[Notice | Piece | Done]:
        """Stream the answer. A conversation the server's context cannot hold loses its oldest
        exchanges, as locally (with a Notice), once what is left fits; when even the last question
        alone does not, ConversationError leaves the conversation as it was."""
        trial = dataclasses.replace(conversation, messages=list(conversation.messages), dropped=[])
        while True:
            try:
                stream = self._open(trial)
                break
            except _TooLong as exc:
                if len(trial.messages) <= 1:
                    raise ConversationError(str(exc)) from None
                trial.drop_oldest_exchange()
        dropped = len(conversation.messages) - len(trial.messages)
        if dropped:
            conversation.forget_oldest(dropped)
            yield Notice(dropped_notice(dropped, "server's"))
        yield from self._events(stream)

    def request_body(self, conversation: Conversation) -> dict:
        values = self.settings.as_dict()
        sent = set(SAMPLING_KEYS) if self.stats_reported else self.given
        body: dict = {"model": self.name, "messages": conversation.chat_messages(), "stream": True,
                      "stream_options": {"include_usage": True}}
        names = {"max_new_tokens": "max_tokens"}
        for name in SAMPLING_KEYS:
            if name in sent and values[name] is not None and values[name] != []:
                body[names.get(name, name)] = values[name]
        if self.settings.format is not None or "format" in self.given:  # off: {"type": "text"}
            body["response_format"] = response_format(self.settings.format)
        if self.stats_reported:
            body["ladechat"] = {k: values[k] for k in LOOKAHEAD_KEYS}
        return body

    def _open(self, conversation: Conversation) -> httpx.Response:
        request = self.client.build_request("POST", self.endpoint.url + "/chat/completions",
                                            json=self.request_body(conversation), headers=self._headers())
        response = self._send(request, stream=True)
        if response.status_code != 200:
            response.read()
            response.close()
            message = _error_message(response)
            if response.status_code == 413 or (response.status_code == 400 and "context" in message.lower()):
                raise _TooLong(message)
            raise self._status_error(response, message)
        return response

    def _events(self, response: httpx.Response) -> Iterator[Piece | Done]:
        run = _Run(start=time.perf_counter())
        ended = False
        self.usage = None
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    ended = True
                    break
                yield from run.chunk(_parse(data, self.endpoint))
        except KeyboardInterrupt:
            run.finish = "interrupted"
        except httpx.HTTPError as exc:
            raise ServerFailure(f"the connection to {self.endpoint.host} broke mid-answer: {_reason(exc)}") from None
        finally:
            response.close()  # a server stops generating when its client goes
        if not ended and run.finish is None:  # neither [DONE] nor a finish_reason: cut off
            raise ServerFailure(f"the server at {self.endpoint.url} ended the stream before the answer was finished")
        self.usage = run.usage
        yield run.done(self.settings)

    # -- HTTP ---------------------------------------------------------------------------------
    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.endpoint.key}"} if self.endpoint.key else {}

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        try:
            return self.client.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise ServerFailure(f"cannot reach the server at {self.endpoint.url}: {_reason(exc)}") from None

    def _get(self, path: str) -> dict:
        response = self._send(self.client.build_request("GET", self.endpoint.url + path, headers=self._headers()))
        if response.status_code != 200:
            raise self._status_error(response, _error_message(response))
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.endpoint.url}{path} did not answer JSON: is it an OpenAI-compatible API?") from None

    def _status_error(self, response: httpx.Response, message: str) -> RemoteError:
        status, url = response.status_code, self.endpoint.url
        if status == 401:
            if not self.endpoint.key:
                return RemoteError(f"the server at {url} wants an API key: give --api-key or set LADECHAT_API_KEY")
            return RemoteError(f"the server at {url} refused the API key ({message})")
        if status == 404 and response.request.method == "GET":
            return RemoteError(f"no OpenAI-compatible API at {url} (GET {response.request.url.path}: 404); "
                               "the URL usually ends in /v1")
        if status == 503 and "retry-after" in response.headers:
            return ServerFailure(f"the server at {url} is busy: {message} (retry after {response.headers['retry-after']} s)")
        return (ServerFailure if status >= 500 else RemoteError)(f"the server at {url} answered {status}: {message}")

    def _not_ladechat(self, what: str) -> str:
        return f"{what} apply to ladechat serve only: the server at {self.endpoint.url} decodes its own way"


class _TooLong(Exception):
    pass


@dataclass
class _Run:
    """One streamed answer as it arrives: its steps (ladechat serve) and what the server reported."""

    start: float
    ttft: float = 0.0
    chunks: int = 0
    steps: Tally = field(default_factory=Tally)
    stats: dict | None = None
    usage: dict | None = None
    finish: str | None = None
    seconds: float = 0.0  # the steps' own time, as the server measured it
    text: str = ""  # the answer's text so far

    def chunk(self, data: dict) -> Iterator[Piece]:
        ext = data.get("ladechat") if isinstance(data.get("ladechat"), dict) else {}
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        if isinstance(ext.get("stats"), dict):
            self.stats = ext["stats"]
        choices = data.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        step = None
        if "tokens" in ext:
            step = Step(tuple(ext["tokens"]), tuple(ext["guessed"]), ext.get("source", "none"), ext.get("fed", 0),
                        ext.get("seconds", 0.0))
            self.steps.add(step)
            self.seconds += step.seconds
        text = (choice.get("delta") or {}).get("content") or ""
        segments = [(s, bool(p)) for s, p in ext["segments"]] if "segments" in ext else [(text, False)]
        if not any(s for s, _ in segments) and step is None:
            return
        if not self.ttft:
            self.ttft = time.perf_counter() - self.start
        self.chunks += 1
        for piece in pieces(segments, step):
            self.text += piece.text
            yield piece

    def done(self, settings: Settings) -> Done:
        total = time.perf_counter() - self.start
        tokens = tuple(self.steps.tokens)
        if self.stats is not None and self.finish != "interrupted":
            return Done(tokens, Stats.from_dict(self.stats), self.text)
        if self.steps.steps:  # ladechat serve, cut short: the statistics of the steps that arrived
            return Done(tokens, self.steps.stats(
                prompt_tokens=0, prefill_tokens=0, prefill_s=0.0, ttft_s=self.ttft, decode_s=self.seconds,
                total_s=total, pool_size=0, lookahead=settings.lookahead, window=settings.window,
                ngram=settings.ngram, candidates=settings.candidates, finish_reason=self.finish or "interrupted"),
                self.text)
        usage = self.usage or {}
        new = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else self.chunks
        return Done((), Stats(
            new_tokens=new, steps=0, prompt_tokens=usage.get("prompt_tokens") or 0, prefill_tokens=0, prefill_s=0.0,
            ttft_s=self.ttft, decode_s=total - self.ttft, total_s=total, accepted_histogram={},
            accepted_by_position=(), source_counts={}, pool_size=0, mean_fed=0.0, lookahead=False, window=0,
            ngram=0, candidates=0, finish_reason=self.finish or "interrupted"), self.text)


def _parse(data: str, endpoint: Endpoint) -> dict:
    try:
        obj = json.loads(data)
    except ValueError:
        raise RemoteError(f"the server at {endpoint.url} sent an event that is not JSON: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise RemoteError(f"the server at {endpoint.url} sent an unexpected event: {data[:80]!r}")
    if "error" in obj:
        error = obj["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise ServerFailure(f"the server at {endpoint.url} failed mid-answer: {' '.join(str(message).split())[:300]}")
    return obj


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message or response.text or response.reason_phrase).split())[:300]


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0] if text else type(exc).__name__

