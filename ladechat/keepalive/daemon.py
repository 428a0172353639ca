"""The warm server: `python -m ladechat.keepalive.daemon` (started by client.start, not by hand).

It loads the model as `ladechat serve` does (backends/opener.open_here), tells the command that started it how
the load goes through a pipe (`phase TEXT`, `notice TEXT`, then `ready` or `error TEXT`), then
serves serve.app.Api's app on its Unix socket, in its own session (a terminal's Ctrl-C or hang-up
never reaches it) with the folder / as its working directory. It holds its key's lock for its
whole life, so a dead server's files are known for what they are. It stops:

    idle           no request for keep-alive seconds (the latest request's X-Ladechat-Warm says how
                   long; -1: never)
    POST /warm/stop {"wait": false}  (ladechat stop) at once; answers in progress end (their
                   clients say so and keep the question)
    POST /warm/stop {"wait": true}   (a command of another ladechat version replaces it) gives up
                   its socket and lock at once, and gives the answers in progress 30 s to finish
    SIGTERM        answers in progress get 30 s (serve.app.Api.drain), then end with an error event

Routes besides the API's: GET /warm/info (what `ladechat ps` shows, and the build a command
compares with its own), POST /warm/store/clear (the chat's /store clear, on the model thread).
A request's header X-Ladechat-Warm (JSON: store, template, keep_alive) gives that request's store
and template, which the OpenAI-style request has no place for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from ladechat import __version__
from ladechat.errors import UserError
from ladechat.keepalive.runtime import FOREVER, Paths, ServerKey, build, remove_files, write_record

HEADER = "x-ladechat-warm"
# A request's own max_tokens decides how long an answer may be; the server's is only a cap.
MAX_NEW_TOKENS = 1_000_000
GRACE = 30.0  # seconds answers in progress get when the server is told to stop (SIGTERM, a newer ladechat)
# Where in an ASGI scope's state Daemon puts the settings a request gives besides the API's fields
# (store, template), for WarmApi.request_base.
SCOPE_SETTINGS = "ladechat_warm_settings"


def log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


class Status:
    """Lines to the command that started this server; a command that is gone (Ctrl-C) is no error."""

    def __init__(self, fd: int) -> None:
        self.file = os.fdopen(fd, "w", buffering=1) if fd >= 0 else None

    def send(self, kind: str, text: str = "") -> None:
        if self.file is None:
            return
        try:
            self.file.write(f"{kind} {' '.join(text.split())}".rstrip() + "\n")
            self.file.flush()
        except OSError:  # BrokenPipeError: nobody reads any more
            self.close()

    @contextmanager
    def progress(self, message: str):
        self.send("phase", message)
        yield lambda text: self.send("phase", text)  # the phase's line, as it goes

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError:
                pass


def load(key: ServerKey, status: Status, model_thread):
    """(settings, Bot) for the server's load options, as `ladechat serve` loads: the device's defaults; the
    requests give their own settings. Compiled steps are warmed up on model_thread (a
    serve.worker.ModelThread), the thread that will answer."""
    from ladechat.backends.opener import open_here
    from ladechat.backends.spec import Spec

    spec = Spec.from_load_options(key.options, settings={"max_new_tokens": MAX_NEW_TOKENS})
    return open_here(spec, status.progress, model_thread.run)


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def make_api(bot, settings, model_thread=None):
    from ladechat.backends.detok import Detokenizer
    from ladechat.serve.app import Api, ServeConfig

    class WarmApi(Api):
        """serve.app.Api whose settings for a request take the store and template that request gave
        (put in its scope's state by Daemon), and whose streams keep the stop string that ended an
        answer, as the chat and `ask` show it when they answer in-process."""

        def request_base(self, request):
            extra = request.scope.get("state", {}).get(SCOPE_SETTINGS)
            return self.base.updated(extra) if extra else self.base

        async def stream(self, job, rid, include_usage, tooling=None, text=False):
            chunks = super().stream(job, rid, include_usage, tooling, text)
            if not job.settings.stop:
                async for item in chunks:
                    yield item
                return
            detok = Detokenizer(self.tokenizer)
            sent = ""
            async for item in chunks:
                data = item.get("data")
                if data and data != "[DONE]":
                    item, sent = self.keep_stop(item, data, detok, sent)
                yield item

        @staticmethod
        def keep_stop(item: dict, data: str, detok, sent: str) -> tuple[dict, str]:
            obj = json.loads(data)
            ext = obj.get("ladechat") if isinstance(obj.get("ladechat"), dict) else {}
            if ext.get("tokens"):
                detok.add(ext["tokens"])
            choices = obj.get("choices") or []
            if not choices:
                return item, sent
            delta = choices[0].get("delta") or {}
            content = delta.get("content") or ""
            stats = ext.get("stats") or {}
            if stats.get("finish_reason") == "stop" and detok.text.startswith(sent + content):
                rest = detok.text[len(sent) + len(content):]  # the stop string, which the API cuts
                if rest:
                    delta["content"] = content + rest
                    ext.setdefault("segments", []).append([rest, False])
                    content += rest
                    item = {**item, "data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}
            return item, sent + content

    return WarmApi(bot, bot.loaded.tokenizer, bot.loaded.context_length, settings,
                   ServeConfig(model_id=bot.name, max_queue=16, drain_timeout=GRACE), log=log,
                   model_thread=model_thread)


class Daemon:
    """The ASGI app on the socket: /warm/* here, the rest to the API, every API request counted
    as activity (the idle clock starts when the last one ends)."""

    def __init__(self, api, bot, paths: Paths, lock_fd: int, spec: ServerKey, keep_alive: float, notices: list[str]) -> None:
        """api: the API of `bot`, the Bot this server loaded."""
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.api, self.bot, self.paths, self.lock_fd, self.spec = api, bot, paths, lock_fd, spec
        self.keep_alive = keep_alive
        self.notices = notices
        self.inner = api.app()
        self.routes = Starlette(routes=[Route("/warm/info", self.info), Route("/warm/stop", self.stop, methods=["POST"]),
                                        Route("/warm/store/clear", self.clear_store, methods=["POST"])])
        self.active = 0
        self.last = time.monotonic()
        self.started = time.time()
        self.sock_inode: int | None = None
        self.released = False
        self.server = None

    # -- the clock ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.active > 0 or self.api.worker.unfinished > 0

    def expired(self) -> bool:
        return not self.busy and self.keep_alive >= 0 and time.monotonic() - self.last >= self.keep_alive

    def idle_until(self) -> float | None:
        """When it stops if nothing comes (seconds since the epoch); None while busy or kept forever."""
        if self.busy or self.keep_alive < 0:
            return None
        return time.time() + max(0.0, self.keep_alive - (time.monotonic() - self.last))

    def release(self) -> None:
        """Give up the socket and the lock: from now on a command starts another server."""
        if not self.released:
            self.released = True
            remove_files(self.paths, self.lock_fd, self.sock_inode)

    # -- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        if scope["path"].startswith("/warm/"):
            return await self.routes(scope, receive, send)
        try:
            extra = self.request_settings(scope)
        except ValueError as exc:
            from starlette.responses import JSONResponse

            body = {"error": {"message": f"X-Ladechat-Warm: {exc}", "type": "invalid_request_error", "param": None,
                              "code": None}}
            return await JSONResponse(body, status_code=400)(scope, receive, send)
        if extra:
            scope = {**scope, "state": {**scope.get("state", {}), SCOPE_SETTINGS: extra}}
        self.active += 1
        try:
            await self.inner(scope, receive, send)
        finally:
            self.active -= 1
            self.last = time.monotonic()

    def request_settings(self, scope) -> dict | None:
        raw = next((v for k, v in scope["headers"] if k == HEADER.encode()), None)
        if raw is None:
            return None
        try:
            given = json.loads(raw)
        except ValueError:
            raise ValueError("not JSON") from None
        if not isinstance(given, dict):
            raise ValueError("not a JSON object")  # noqa: TRY004 -- a 400 for the request, like the rest
        extra = {}
        if "store" in given:
            if not isinstance(given["store"], bool):
                raise ValueError("store must be true or false")
            extra["store"] = given["store"]
        if "template" in given:
            if given["template"] is not None and not isinstance(given["template"], str):
                raise ValueError("template must be a name or null")
            extra["template"] = given["template"]
        if "keep_alive" in given:
            keep = given["keep_alive"]
            if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep):
                raise ValueError("keep_alive must be a number of seconds (negative: forever)")
            self.keep_alive = FOREVER if keep < 0 else float(keep)
        return extra or None

    # -- /warm --------------------------------------------------------------------------------
    async def info(self, request):
        from starlette.responses import JSONResponse

        loaded = self.bot.loaded
        gpu = 0
        if loaded.device.type == "cuda":
            import torch

            gpu = torch.cuda.memory_reserved(loaded.device)
        return JSONResponse({
            "build": build(), "version": __version__, "pid": os.getpid(), "model": self.bot.name,
            "describe": self.bot.describe(), "device": f"{loaded.device} {str(loaded.dtype).removeprefix('torch.')}",
            "options": self.spec.options, "options_text": self.spec.describe_options(),
            "keep_alive": self.keep_alive, "idle_until": self.idle_until(), "busy": self.busy,
            "memory": resident_bytes(), "gpu_memory": gpu, "started": self.started, "notices": self.notices,
            "log": str(self.paths.log)})

    async def stop(self, request):
        from starlette.background import BackgroundTask
        from starlette.responses import JSONResponse

        try:
            wait = bool((await request.json()).get("wait"))
        except (ValueError, AttributeError):
            wait = False
        self.release()
        if wait:
            log("replaced by a server of another ladechat: finishing the answers in progress")
            self.server.should_exit = True
            return JSONResponse({"stopping": "after the answers in progress"})
        log("stopped (ladechat stop)")
        return JSONResponse({"stopping": "now"}, background=BackgroundTask(self.exit_now))

    def exit_now(self) -> None:
        sys.stderr.flush()
        os._exit(0)

    async def clear_store(self, request):
        import asyncio

        from starlette.responses import JSONResponse

        forgotten = await asyncio.get_running_loop().run_in_executor(self.api.worker.executor, self.bot.clear_store)
        return JSONResponse({"forgotten": forgotten})

    # -- serving ------------------------------------------------------------------------------
    def serve(self, sock: socket.socket) -> None:
        import uvicorn

        daemon = self

        class Server(uvicorn.Server):
            async def on_tick(self, counter: int) -> bool:
                if await super().on_tick(counter):
                    return True
                if counter % 5 == 0 and daemon.expired():
                    log(f"idle for {daemon.keep_alive:g} s: stopping")
                    return True
                return False

            async def shutdown(self, sockets=None) -> None:
                daemon.release()  # first: a command that comes now starts a new server
                daemon.api.drain()  # answers in progress get GRACE seconds, then an error event each
                await super().shutdown(sockets)

        config = uvicorn.Config(self, log_level="warning", access_log=False, lifespan="off", interface="asgi3",
                                timeout_graceful_shutdown=GRACE + 10)
        self.server = Server(config)
        try:
            self.server.run(sockets=[sock])
        finally:
            self.release()


def bind(path: Path) -> socket.socket:
    """A listening socket at `path` (0600), after removing a dead server's (this one holds the lock)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ladechat.keepalive.daemon")
    parser.add_argument("--root", required=True)
    parser.add_argument("--status-fd", type=int, default=-1)
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--keep-alive", type=float, required=True)
    parser.add_argument("spec")
    args = parser.parse_args(argv)
    os.umask(0o077)
    status = Status(args.status_fd)
    spec = ServerKey.from_json(args.spec)
    paths = Paths(Path(args.root), spec.key())
    record = {"pid": os.getpid(), "options": spec.options, "build": build(), "started": time.time()}
    write_record(args.lock_fd, {**record, "state": "loading"})
    log(f"ladechat {build()} (pid {os.getpid()}): loading {spec.model} ({spec.describe_options()})")
    from ladechat.serve.worker import ModelThread

    model_thread = ModelThread()
    try:
        settings, bot = load(spec, status, model_thread)
    except BaseException as exc:  # noqa: BLE001 -- the starting command is told, in one line
        if isinstance(exc, UserError):
            message = str(exc)
        elif isinstance(exc, MemoryError):
            message = f"out of memory loading {spec.model}; try --load-in-4bit or a smaller --dtype"
        else:
            traceback.print_exc()
            message = f"the warm server failed loading {spec.model}: {type(exc).__name__}: {exc} (its log: {paths.log})"
        log(f"error: {message}")
        status.send("error", message)
        remove_files(paths, args.lock_fd)
        sys.stderr.flush()
        os._exit(1)  # at once: tearing down what the load imported takes seconds
    notices = list(bot.notices)  # the load's: every command that uses this server shows them
    bot.notices.clear()
    api = make_api(bot, settings, model_thread)
    daemon = Daemon(api, bot, paths, args.lock_fd, spec, args.keep_alive, notices)
    try:
        sock = bind(paths.sock)
    except OSError as exc:
        message = f"cannot listen on {paths.sock}: {exc.strerror or exc}"
        log(f"error: {message}")
        status.send("error", message)
        remove_files(paths, args.lock_fd)
        sys.stderr.flush()
        os._exit(1)
    daemon.sock_inode = os.lstat(paths.sock).st_ino
    write_record(args.lock_fd, {**record, "state": "ready"})
    log(f"serving {bot.describe()} on {paths.sock}, kept {args.keep_alive:g} s after the last request")
    for notice in notices:
        status.send("notice", notice)
    status.send("ready")
    status.close()
    daemon.serve(sock)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
