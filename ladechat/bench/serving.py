"""`ladechat bench --api URL`: serving overhead. The same prompts answered in this process and
through `ladechat serve` (streaming, one client), alternately, item by item, with the same model
and settings, neither drafting from a store of past answers; tokens/s of each, end to end (prompt
in, last token out), and whether the answers are token-identical.

The in-process answers run on a worker thread, as the server's do: on a busy CPU, torch steps
run on the main thread were measured slower than the same steps on a worker thread of the same
process, which would otherwise count as negative serving overhead."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ladechat.backends.local import Bot
from ladechat.backends.remote import RemoteBot
from ladechat.conversation import Conversation
from ladechat.engine.events import Done
from ladechat.errors import UserError
from ladechat.settings import Settings


class ServeBenchError(UserError, ValueError):
    pass


def _answer(backend, prompt: str) -> tuple[tuple[int, ...], float]:
    start = time.perf_counter()
    done = None
    for event in backend.reply(Conversation(messages=[{"role": "user", "content": prompt}])):
        if isinstance(event, Done):
            done = event
    return done.text_tokens, time.perf_counter() - start


def check_server(remote: RemoteBot) -> None:
    """ServeBenchError unless the server can be compared with this process."""
    if not remote.stats_reported:
        raise ServeBenchError(f"{remote.describe()}: the serving benchmark needs ladechat serve (token ids per chunk)")
    if remote.settings.store:
        # Its store remembers every answer it gave, earlier runs of these prompts included: drafts
        # this process cannot have, so the served side would look faster than it is.
        raise ServeBenchError(f"{remote.describe()} drafts from its store of past answers: start it with --no-store "
                              "to compare like with like")


def run(loaded, settings: Settings, remote: RemoteBot, prompts: list[str],
        progress: Callable[[int, int], None] = lambda i, n: None) -> dict:
    check_server(remote)
    settings = settings.updated({"store": False})
    local = Bot(loaded, settings)
    if remote.info.get("model") != local.describe():
        raise ServeBenchError(f"the server runs {remote.info.get('model')}, this process loaded {local.describe()}: "
                              "start both with the same --model and --dtype")
    remote.configure(settings)
    rows = []
    thread = ThreadPoolExecutor(max_workers=1)
    for i, prompt in enumerate(prompts):
        progress(i + 1, len(prompts))
        here, here_s = thread.submit(_answer, local, prompt).result()
        there, there_s = _answer(remote, prompt)
        rows.append({"tokens": len(here), "in_process_s": round(here_s, 4), "served_tokens": len(there),
                     "served_s": round(there_s, 4), "identical": here == there})
    tokens = sum(r["tokens"] for r in rows)
    served_tokens = sum(r["served_tokens"] for r in rows)
    here_s = sum(r["in_process_s"] for r in rows)
    there_s = sum(r["served_s"] for r in rows)
    here_tps, there_tps = tokens / here_s, served_tokens / there_s
    return {"model": loaded.name, "server": remote.describe(), "settings": settings.as_dict(), "items": rows,
            "in_process_tokens_per_s": round(here_tps, 2), "served_tokens_per_s": round(there_tps, 2),
            "served_vs_in_process": round(there_tps / here_tps, 4),
            "identical": sum(r["identical"] for r in rows)}
