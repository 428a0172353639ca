"""`ladechat bench --peer NAME=URL`: another engine behind an OpenAI-compatible server (llama.cpp's
llama-server, vLLM, ladechat serve, ...) as one more method of the bench, named NAME.

A peer answers every turn of every item through the server's /chat/completions (streamed), with
the same messages as the other methods (a conversation holds the peer's own previous answers),
the run's max_new_tokens and sampling settings (every one sent: temperature 0 is greedy there
too). Its time is the wall time from the request to the last token, as this client sees it; its
tokens are the server's usage.completion_tokens, or, from a server that reports no usage, its
answer's text tokenized with the loaded tokenizer (`counted` says which). Another engine's answers
are never compared with hf's: their identity is not applicable (None).

No torch here: the peers are asked for their models (GET /v1/models) before the model loads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ladechat.backends.base import RemoteError
from ladechat.backends.remote import SAMPLING_KEYS, Endpoint, RemoteBot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.errors import UserError
from ladechat.settings import Settings

EXAMPLE = "llama.cpp=http://127.0.0.1:8089/v1"


class PeerError(UserError, ValueError):
    pass


@dataclass
class Peer:
    name: str
    bot: RemoteBot
    counted: set[str] = field(default_factory=set)  # where its token counts came from: usage, tokenizer

    def info(self) -> dict:
        """What the results record about the peer."""
        return {"url": self.bot.endpoint.url, "model": self.bot.name,
                "tokens_from": " and ".join(sorted(self.counted)) or None}


def parse(spec: str, taken: set[str]) -> tuple[str, Endpoint]:
    """NAME=URL -> (NAME, its endpoint); PeerError (one line) for anything else, or a NAME in `taken`."""
    name, sep, url = spec.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url:
        raise PeerError(f"--peer wants NAME=URL (e.g. {EXAMPLE}), got {spec!r}")
    if name in taken:
        raise PeerError(f"--peer {name}: that name is taken (a method of the bench or another peer); choose another")
    try:
        return name, Endpoint.of(url, None)
    except RemoteError:
        raise PeerError(f"--peer {name}: the URL must be http(s), e.g. {EXAMPLE}, got {url!r}") from None


def connect(specs: list[str], taken: set[str], settings: Settings) -> dict[str, Peer]:
    """Each --peer NAME=URL, its server asked for its models at once (PeerError, one line, if it
    cannot be reached or used), set to answer with `settings`' sampling (every key sent)."""
    peers: dict[str, Peer] = {}
    values = settings.as_dict()
    for spec in specs:
        name, endpoint = parse(spec, taken | set(peers))
        try:
            bot = RemoteBot(endpoint, None, {k: values[k] for k in SAMPLING_KEYS}, set(SAMPLING_KEYS))
        except RemoteError as exc:
            raise PeerError(f"peer {name}: {exc}") from None
        peers[name] = Peer(name, bot)
    return peers


def sample_like(peer: Peer, settings: Settings) -> None:
    """The peer answers with `settings`' sampling (the bench's, once its model is loaded)."""
    values = settings.as_dict()
    peer.bot.configure(peer.bot.settings.updated({k: values[k] for k in SAMPLING_KEYS}))


def answer(peer: Peer, item: dict, tokenizer) -> tuple[int, float]:
    """Every turn of `item` answered by the peer, each answer kept in the conversation for the
    next turn. Returns (tokens, seconds) over the turns."""
    conversation = Conversation()
    tokens, seconds = 0, 0.0
    for turn in item["turns"]:
        conversation.messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        try:
            done = [event for event in peer.bot.reply(conversation) if isinstance(event, Done)][-1]
        except RemoteError as exc:
            raise PeerError(f"peer {peer.name}: {exc}") from None
        seconds += time.perf_counter() - start
        count = (peer.bot.usage or {}).get("completion_tokens")
        if isinstance(count, int):
            peer.counted.add("usage")
        else:
            count = len(tokenizer.encode(done.text, add_special_tokens=False))
            peer.counted.add("tokenizer")
        tokens += count
        conversation.messages.append({"role": "assistant", "content": done.text})
    return tokens, seconds


def warm_up(peer: Peer, tokenizer) -> None:
    """A first short answer (a server's first request may allocate, or load its model)."""
    settings = peer.bot.settings
    peer.bot.configure(settings.updated({"max_new_tokens": 8}))
    try:
        answer(peer, {"turns": ["Hello"]}, tokenizer)
    finally:
        peer.bot.configure(settings)
        peer.counted.clear()
