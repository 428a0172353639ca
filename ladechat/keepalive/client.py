"""The command's side of keep-alive: find the warm server for a set of load options, start it if
there is none (exactly one, whoever asks at once), replace one of another ladechat build, stop and
list them; WarmBot answers through one. No torch or transformers here, as for `--api`.

Finding (ensure):
    the socket answers /warm/info with our build -> use it
    it answers with another build                  -> ask it to give way ({"wait": true}), start ours
    nothing answers and nobody holds the lock      -> a dead server's files (or none): start one
    nothing answers but the lock is held           -> another command is starting it: wait for it
Starting holds the lock from before the spawn; the server inherits it and holds it while it lives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ladechat.backends.base import RemoteError, ServerFailure
from ladechat.backends.events import Notice
from ladechat.backends.remote import Endpoint, RemoteBot
from ladechat.engine.config import ConfigError
from ladechat.keepalive.runtime import (
    Paths,
    ServerKey,
    WarmError,
    build,
    check_owned,
    format_duration,
    is_held,
    private_folder,
    read_record,
    remove_files,
    try_lock,
)

BASE = "http://ladechat-warm"  # the host is a label: the transport goes to the socket
URL = BASE + "/v1"
HEADER = "X-Ladechat-Warm"
RELEASE_TIMEOUT = 15.0  # seconds a server told to stop gets before it is killed

Progress = Callable[[str], AbstractContextManager]


def connection(paths: Paths) -> httpx.Client:
    """A client on the server's socket (plain HTTP: no TLS context, no proxies)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.sock), verify=False), trust_env=False,
                        timeout=httpx.Timeout(30.0, read=None))


@dataclass
class Warm:
    """A warm server this command found or started: its files, a client on its socket, its
    /warm/info, and what the command should say (that it started it, that it replaced one)."""

    spec: ServerKey
    paths: Paths
    client: httpx.Client
    info: dict
    said: list[str] = field(default_factory=list)

    def gone(self, wait: float = 2.0) -> bool:
        """Whether the server has ended (its lock let go), waiting up to `wait` seconds for it: a
        process the kernel is still tearing down may cut its connections before it lets go of its
        lock."""
        deadline = time.monotonic() + wait
        while is_held(self.paths.lock):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True


def probe(paths: Paths, client: httpx.Client) -> dict | None:
    """The server's /warm/info; None when nothing listens on its socket (no socket, or a dead
    server's). WarmError for a socket that is not this user's."""
    if not check_owned(paths.sock, socket=True):
        return None
    try:
        response = client.get(BASE + "/warm/info", timeout=httpx.Timeout(10.0))
    except httpx.TimeoutException:
        raise WarmError(f"the warm server at {paths.sock} does not answer; 'ladechat stop --all' ends it") from None
    except httpx.TransportError:  # refused or cut: a dead server's socket, or one that is stopping
        return None
    if response.status_code != 200:
        return {}  # not one of ours, or of a ladechat from before /warm/info: replaced
    try:
        info = response.json()
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def find(spec: ServerKey, root: Path) -> Warm | None:
    """The warm server for `spec` in `root` if one of this build is up and listening; None otherwise
    (ensure then starts, replaces or waits for it)."""
    private_folder(root)
    paths = Paths(root, spec.key())
    paths.check_length()
    client = connection(paths)
    try:
        info = probe(paths, client)
    except WarmError:
        client.close()
        raise
    if info is None or info.get("build") != build():
        client.close()
        return None
    return Warm(spec, paths, client, info)


def ensure(spec: ServerKey, keep_alive: float, root: Path, progress: Progress, client: httpx.Client | None = None) -> Warm:
    """The live warm server for `spec` in `root`, found or started (progress(message) while it
    loads or while another command starts it). WarmError (one line) when it cannot be."""
    private_folder(root)
    paths = Paths(root, spec.key())
    paths.check_length()
    client = client or connection(paths)
    said: list[str] = []
    started = False
    while True:
        info = probe(paths, client)
        if info is not None:
            if info.get("build") == build() or started:  # the one just started is ours, whatever
                return Warm(spec, paths, client, info, said)
            said.append(f"the warm server of {info.get('model') or spec.model} runs ladechat "
                        f"{info.get('build') or '(an older one)'}, this is {build()}: replaced by this version")
            replace(paths, client, info)
            continue
        lock = try_lock(paths.lock)
        if lock is not None:
            if started:  # it was ready a moment ago
                os.close(lock)
                raise WarmError(f"the warm server for {spec.model} ended as soon as it started; its log: {paths.log}")
            said.extend(start(spec, paths, lock, keep_alive, progress))
            said.append(f"{spec.model} stays loaded for {format_duration(keep_alive)} after its last answer, so the "
                        "next command answers at once ('ladechat ps' shows it, 'ladechat stop' unloads it; "
                        "--keep-alive 0 loads in the command instead)" if keep_alive >= 0 else
                        f"{spec.model} stays loaded until 'ladechat stop' unloads it ('ladechat ps' shows it)")
            started = True
            continue
        with progress(f"waiting for {spec.model}, which another ladechat command is loading"):
            while not _answers(paths) and is_held(paths.lock):
                time.sleep(0.05)


def _answers(paths: Paths) -> bool:
    """Whether something listens on the socket (a server that has finished loading)."""
    if not paths.sock.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(paths.sock))
            return True
        except OSError:
            return False


def start(spec: ServerKey, paths: Paths, lock: int, keep_alive: float, progress: Progress) -> list[str]:
    """Start the server for `spec`, handing it the lock; wait until it is loaded and listens. Returns
    its load's notices; WarmError with its own one-line reason when it fails to load."""
    try:
        log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        os.close(lock)
        raise WarmError(f"cannot write {paths.log}: {exc.strerror or exc}") from None
    read, write = os.pipe()
    command = [sys.executable, "-m", "ladechat.keepalive.daemon", "--root", str(paths.root), "--status-fd", str(write),
               "--lock-fd", str(lock), f"--keep-alive={keep_alive!r}", spec.as_json()]
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(write, lock),
                                start_new_session=True, cwd="/")
    except OSError as exc:
        os.close(read)
        os.close(lock)
        raise WarmError(f"cannot start a warm server: {exc.strerror or exc}") from None
    finally:
        os.close(write)
        os.close(log)
    notices: list[str] = []
    error = None
    phase = "loading the model in a server that keeps it for the next commands"
    try:
        with os.fdopen(read, "r", encoding="utf-8", errors="replace") as status:
            while True:
                with progress(phase) as update:
                    while True:
                        line = status.readline()
                        while line.startswith("notice "):
                            notices.append(line[len("notice "):].rstrip("\n"))
                            line = status.readline()
                        kind, _, text = line.rstrip("\n").partition(" ")
                        if kind != "phase" or update is None:
                            break
                        update(text)  # the server's phase, on the same line
                if kind == "phase":
                    phase = text
                elif kind == "ready":
                    break
                elif kind == "error":
                    error = text
                    break
                else:  # the pipe closed: the server is gone
                    error = ended(proc, spec, paths)
                    break
    finally:
        os.close(lock)  # the server holds it now (or has ended)
    if error is not None:
        raise WarmError(error)
    return notices


def ended(proc: subprocess.Popen, spec: ServerKey, paths: Paths) -> str:
    """Why a server ended while loading, in one line."""
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"killed by {name}" + (" (the system's out-of-memory killer does that)" if -code == signal.SIGKILL else "")
    else:
        how = f"exit status {code}" if code is not None else "it closed its pipe"
    try:
        tail = [line for line in paths.log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    except OSError:
        tail = []
    last = f": {' '.join(tail[0].split())[:200]}" if tail else ""
    return f"the warm server for {spec.model} ended while loading it ({how}); its log {paths.log}{last}"


def replace(paths: Paths, client: httpx.Client, info: dict) -> None:
    """Ask the server at `paths` to give way (it finishes its answers in progress without its socket
    and lock); killed if it does not let go of the lock in time."""
    try:
        response = client.post(BASE + "/warm/stop", json={"wait": True}, timeout=httpx.Timeout(10.0))
        asked = response.status_code == 200
    except httpx.HTTPError:
        asked = False
    _wait_released(paths, read_record(paths.lock).get("pid") or info.get("pid"), RELEASE_TIMEOUT if asked else 0.0)


def _wait_released(paths: Paths, pid, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            if not isinstance(pid, int) or not _is_server(pid):
                break
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if not is_held(paths.lock):
                return
            time.sleep(0.05)
        if not is_held(paths.lock):
            return
    if is_held(paths.lock):
        raise WarmError(f"the warm server at {paths.sock} does not stop (pid {pid}); end it and run the command again")


def _is_server(pid: int) -> bool:
    """Whether `pid` is a warm server (where /proc tells, by its command line; elsewhere the lock
    file, this user's, named it)."""
    if not os.path.isdir("/proc/self"):
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ladechat.keepalive.daemon" in f.read()
    except OSError:
        return False


# -- ladechat ps / stop -------------------------------------------------------------------------
@dataclass
class Entry:
    """One server: its files, what it wrote in its lock file, and its /warm/info (None while it loads)."""

    paths: Paths
    record: dict
    info: dict | None

    @property
    def model(self) -> str:
        if self.info:
            return self.info.get("model") or "?"
        return (self.record.get("options") or {}).get("model") or "the embedded model"

    def names(self) -> set[str]:
        given = (self.record.get("options") or (self.info or {}).get("options") or {}).get("model")
        names = {self.model, self.model.split(" (")[0], "embedded" if given is None else given}
        if given:
            names.add(os.path.basename(given.rstrip("/")))
        return names


def servers(root: Path) -> list[Entry]:
    """The live warm servers in `root`; a dead server's files are removed on the way."""
    if not root.exists():
        return []
    private_folder(root)
    entries = []
    for paths in Paths.all(root):
        lock = try_lock(paths.lock)
        if lock is not None:  # nobody holds it: what is left of a dead server
            remove_files(paths, lock)
            continue
        info = None
        if check_owned(paths.sock, socket=True):
            with connection(paths) as client:
                info = probe(paths, client)
        entries.append(Entry(paths, read_record(paths.lock), info))
    return entries


def stop(root: Path, model: str | None, every: bool) -> list[Entry]:
    """Stop the warm servers that hold `model` (every one with `every`; with neither, the only one)
    and wait until they have let go of their memory. Returns those stopped."""
    entries = servers(root)
    if model is not None:
        chosen = [e for e in entries if model in e.names()]
        if not chosen:
            raise WarmError(f"no warm server holds {model!r}" + (f" (they hold: {', '.join(e.model for e in entries)})"
                                                                 if entries else ""))
    elif every or len(entries) <= 1:
        chosen = entries
    else:
        raise WarmError(f"{len(entries)} warm servers are running ({', '.join(e.model for e in entries)}): name the "
                        "model, or stop them all with --all")
    for entry in chosen:
        asked = False
        if entry.info is not None:
            with connection(entry.paths) as client:
                try:
                    asked = client.post(BASE + "/warm/stop", json={"wait": False},
                                        timeout=httpx.Timeout(10.0)).status_code == 200
                except httpx.HTTPError:
                    pass
        _wait_released(entry.paths, entry.record.get("pid"), 10.0 if asked else 0.0)
    return chosen


# -- answering ----------------------------------------------------------------------------------
class WarmBot(RemoteBot):
    """The --api client on a warm server's socket, which sends the store and template with each
    request too (RemoteBot leaves them to the server), says what loading the server said, and
    finds or starts the server again when it cannot be reached before an answer begins (expired,
    stopped, killed, replaced): a question is never lost to that."""

    def __init__(self, warm: Warm, settings: dict, given: set[str], keep_alive: float, progress: Progress) -> None:
        self.warm = warm
        self.keep_alive = keep_alive
        self.progress = progress
        self.notices = list(warm.info.get("notices") or []) + warm.said
        warm.client.headers[HEADER] = json.dumps({"keep_alive": keep_alive})
        super().__init__(Endpoint(URL), None, settings, given, client=warm.client)
        self._send_settings()

    def _send_settings(self) -> None:
        self.client.headers[HEADER] = json.dumps({"keep_alive": self.keep_alive, "store": self.settings.store,
                                                  "template": self.settings.template})

    def describe(self) -> str:
        return f"{self.warm.info.get('describe') or self.name}, kept loaded"

    def configure(self, settings) -> None:
        old = self.settings
        if settings.template != old.template and settings.template is not None:
            from ladechat.templates import TemplateError, resolve

            try:
                resolve(None, settings.template)
            except TemplateError as exc:
                raise ConfigError(str(exc)) from None
        super().configure(settings.updated({"store": old.store, "template": old.template}))
        self.settings = settings
        self._send_settings()

    def clear_store(self) -> int:
        try:
            response = self.client.post(BASE + "/warm/store/clear", json={})
            return int(response.json()["forgotten"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"the warm server could not clear the store: {exc}") from None

    def reply(self, conversation) -> Iterator:
        """RemoteBot's answer, its failures said in terms of the warm server."""
        try:
            yield from self._reply(conversation)
        except ServerFailure as exc:
            if self.warm.gone():
                raise ServerFailure(f"the warm server of {self.name} stopped mid-answer (its log: {self.warm.paths.log}); "
                                    "the next question loads the model again") from None
            raise ServerFailure(self._in_our_terms(exc)) from None
        except RemoteError as exc:
            raise RemoteError(self._in_our_terms(exc)) from None

    @staticmethod
    def _in_our_terms(exc: RemoteError) -> str:
        return str(exc).replace(f"the server at {URL}", "the warm server").replace(
            "the connection to ladechat-warm", "the connection to the warm server")

    def _reply(self, conversation) -> Iterator:
        while self.notices:
            yield Notice(self.notices.pop(0))
        events = super().reply(conversation)
        try:
            try:
                first = next(events)
            except StopIteration:
                return
            except ServerFailure:
                # Before the answer began: the server may be gone (expired, stopped, killed) or
                # replaced; found or started again (ensure), it is asked once more.
                events.close()
                try:
                    self.warm = ensure(self.warm.spec, self.keep_alive, self.warm.paths.root, self.progress, self.client)
                except WarmError as exc:  # stopped or failed while loading: the question waits for /retry
                    raise ServerFailure(str(exc)) from None
                self.notices.extend(self.warm.said)
                while self.notices:
                    yield Notice(self.notices.pop(0))
                events = super().reply(conversation)
                try:
                    first = next(events)
                except StopIteration:
                    return
            yield first
            yield from events
        finally:
            events.close()


def table(entries: list[Entry], now: float | None = None) -> list[str]:
    """`ladechat ps`: one row per server (model, device and dtype, load options, memory, until when, pid)."""
    now = time.time() if now is None else now
    rows = [("MODEL", "DEVICE", "OPTIONS", "MEMORY", "UNTIL", "PID")]
    for e in entries:
        info = e.info or {}
        if e.info is None:
            until, memory, device = "loading", "-", "-"
        else:
            if info.get("busy"):
                until = "answering"
            elif info.get("idle_until") is None:
                until = "forever"
            else:
                until = _until(info["idle_until"], now)
            memory = _size(info.get("memory") or 0) + (f" + {_size(info['gpu_memory'])} GPU" if info.get("gpu_memory") else "")
            device = info.get("device") or "?"
        options = info.get("options_text") or ServerKey.from_options(e.record.get("options") or {}).describe_options()
        rows.append((e.model, device, options, memory, until, str(info.get("pid") or e.record.get("pid") or "?")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _until(idle_until, now: float) -> str:
    """When a server unloads, as `ps` shows it ("forever" past what a clock can say)."""
    try:
        left = max(0.0, float(idle_until) - now)
        return f"{format_duration(round(left))} from now ({time.strftime('%H:%M:%S', time.localtime(idle_until))})"
    except (OverflowError, ValueError, OSError, TypeError):
        return "forever"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
