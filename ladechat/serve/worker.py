"""The model thread of `ladechat serve`: one thread owns the backend; requests are its jobs, in
arrival order, and a job's events reach its request's asyncio queue as each step finishes."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ladechat.backends.events import Piece
from ladechat.conversation import Conversation
from ladechat.engine.threads import release_openmp_team
from ladechat.serve.wire import ApiError
from ladechat.settings import Settings

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


class ModelThread:
    """The one thread that runs a server's model: its compiled steps' warm-up too, before the
    server opens, since CUDA graphs belong to the thread that captured them."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladechat-model")

    def run(self, fn, *args):
        """fn(*args) on the model thread; its result, or its exception, here. Ctrl-C while it runs
        (a server's start-up compile) ends the process at once: the model thread cannot be
        stopped mid-compile, and the interpreter's exit would wait for it."""
        future = self.executor.submit(fn, *args)
        try:
            return future.result()
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)


class Worker:
    """One thread owns the model; jobs run in submission order (a one-thread executor's FIFO)."""

    def __init__(self, backend, max_queue: int, log=None, thread: ModelThread | None = None) -> None:
        """thread: the model thread the backend was warmed up on, if any."""
        self.backend = backend
        self.log = log or (lambda line: None)
        self.max_queue = max_queue
        # From here on the model thread runs the model: the OpenMP team this thread used to load it
        # would halve the model thread's speed (engine/threads.py: release_openmp_team).
        release_openmp_team()
        self.executor = (thread or ModelThread()).executor
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
