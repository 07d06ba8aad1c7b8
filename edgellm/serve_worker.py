"""One generation at a time for `edgellm serve`: a bounded FIFO of requests, run by one worker thread
through `Engine.generate`, with its events bridged to the asyncio side.

Why a thread of our own: generation is synchronous torch code that would block the event loop, and
the engine (its KV cache above all) must only ever be driven by one caller. A single thread that takes
jobs in arrival order gives both, and lets the next request reuse the KV prefix the last one left.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from .generate import Done, GenerationSettings, Token

_END = object()  # posted after a job's last event


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    ids: list[int]
    settings: GenerationSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)  # the engine checks it after each token
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    finished: bool = False

    @property
    def queue_s(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted


class Scheduler:
    """Runs jobs on `engine` in arrival order; at most `max_waiting` wait behind the running one."""

    def __init__(self, engine: Any, max_waiting: int, on_done: Callable[[Job, Done], None] | None = None):
        """`on_done(job, done)`: called on the worker thread as each generation ends."""
        self.engine = engine
        self.on_done = on_done
        self.max_waiting = max_waiting
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="edgellm-generate", daemon=True)
        self._thread.start()

    # -- the asyncio side ------------------------------------------------------------------------
    def submit(self, ids: list[int], settings: GenerationSettings) -> Job:
        """Queue a generation (call from the event loop); QueueFull when the queue is full."""
        job = Job(ids, settings, asyncio.get_running_loop())
        with self._cond:
            if self._closed or len(self._jobs) + (self._running is not None) > self.max_waiting:
                raise QueueFull
            self._jobs.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone (call from the event loop): drop the job if it waits, stop it at the next
        token if it runs."""
        job.stop.set()
        with self._cond:
            waiting = job in self._jobs
            if waiting:
                self._jobs.remove(job)
        if waiting:  # it will never run: end its event stream here
            job.finished = True
            job.events.put_nowait(_END)

    async def events(self, job: Job) -> AsyncIterator[Token | Done]:
        """The job's Token events then its Done; the engine's exception if it failed."""
        while True:
            item = await job.events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"running": int(self._running is not None), "waiting": len(self._jobs)}

    def close(self) -> None:
        """Stop the running job, drop the waiting ones, end the worker thread (call from the event loop)."""
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._running.stop.set()
            self._cond.notify()
        for job in list(self._jobs):
            self.cancel(job)

    # -- the worker thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._jobs.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        try:
            if not job.stop.is_set():
                for ev in self.engine.generate(job.ids, job.settings, stop=job.stop):
                    if isinstance(ev, Done) and self.on_done is not None:
                        self.on_done(job, ev)
                    self._post(job, ev)
        except Exception as e:  # reported to the request; the server and the engine go on
            self._post(job, e)
        finally:
            job.finished = True
            self._post(job, _END)

    @staticmethod
    def _post(job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop has closed (server shutting down)
            job.stop.set()
