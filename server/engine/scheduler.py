"""The engine thread: a bounded queue of requests, stepped together, results handed to asyncio.

The HTTP layer never runs the model. It submits a ``GenerationRequest`` and gets a
``RequestHandle`` whose ``events()`` async iterator yields the engine's ``StepOutput``s. One
thread owns the engine and loops:

1. admit waiting requests while fewer than ``max_running`` run (a full waiting queue makes
   ``submit`` raise ``QueueFull``, which the API turns into 429);
2. drop cancelled requests (client gone, timeout), which frees their KV caches at once;
3. one ``Engine.step`` over every running request: all of them advance in the same forward
   pass, so a long request cannot starve short ones, and long prompts are prefilled in chunks;
4. hand each request's output to its asyncio queue with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from server.engine.engine import Engine, Generation, GenerationRequest, StepOutput

log = logging.getLogger("parrot.scheduler")


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class EngineError(Exception):
    """A request could not be run (invalid for the engine, or the engine failed)."""


@dataclass
class _Done:
    error: str | None = None


class Observer(Protocol):
    """Metrics hooks, called on the engine thread."""

    def on_admit(self, handle: "RequestHandle") -> None: ...
    def on_output(self, handle: "RequestHandle", output: StepOutput) -> None: ...
    def on_finish(self, handle: "RequestHandle") -> None: ...
    def on_queue(self, waiting: int, running: int) -> None: ...


class RequestHandle:
    """One submitted request, as the HTTP side sees it."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, scheduler: "Scheduler", tag: str) -> None:
        self.request = request
        self.tag = tag  # the endpoint, for metrics labels
        self.loop = loop
        self.queue: asyncio.Queue[StepOutput | _Done] = asyncio.Queue()
        self.scheduler = scheduler
        self.cancelled = False
        self.enqueued_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.last_output_at: float | None = None
        self.generation: Generation | None = None
        self.error: str | None = None

    def cancel(self) -> None:
        """Stop generating (client gone or timed out); the engine thread frees the KV cache."""
        if not self.cancelled:
            self.cancelled = True
            self.scheduler.wake()

    def deliver(self, item: StepOutput | _Done) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    async def events(self) -> AsyncIterator[StepOutput]:
        """Outputs until the generation ends; raises EngineError if it failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise EngineError(item.error)
                return
            yield item


class Scheduler:
    def __init__(self, engine: Engine, max_running: int, max_queue: int, observer: Observer | None = None) -> None:
        self.engine = engine
        self.max_running = max_running
        self.max_queue = max_queue
        self.observer = observer
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[RequestHandle] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- called from the HTTP side --------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a new thread (``run`` runs it on the calling thread)."""
        self._thread = threading.Thread(target=self.run, name="parrot-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest, tag: str = "") -> RequestHandle:
        handle = RequestHandle(request, asyncio.get_running_loop(), self, tag)
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(handle)
            self._cv.notify()
        self._report_queue()
        return handle

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- the engine thread ----------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop; returns after ``stop``. All model work happens on this thread."""
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    break
                admitted = self._admit()
            for handle in admitted:
                self._start(handle)
            self._drop_cancelled()
            if self._running:
                self._step()
            self._report_queue()
        for handle in list(self._waiting) + self._running:
            self._finish(handle, "the server is shutting down")

    def _admit(self) -> list[RequestHandle]:
        admitted: list[RequestHandle] = []
        while self._waiting and len(self._running) + len(admitted) < self.max_running:
            admitted.append(self._waiting.popleft())
        return admitted

    def _start(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            self._finish(handle, None)
            return
        handle.admitted_at = time.perf_counter()
        try:
            handle.generation = self.engine.start(handle.request)
        except ValueError as exc:
            self._finish(handle, str(exc))
            return
        self._running.append(handle)
        if self.observer is not None:
            self.observer.on_admit(handle)

    def _drop_cancelled(self) -> None:
        for handle in [h for h in self._running if h.cancelled]:
            assert handle.generation is not None
            handle.generation.cancel()
            self._running.remove(handle)
            self._finish(handle, None)

    def _step(self) -> None:
        generations = [h.generation for h in self._running]
        try:
            outputs = self.engine.step(generations)  # type: ignore[arg-type]
        except Exception as exc:  # a bug or an out-of-memory: fail these requests, keep serving
            log.exception("engine step failed for %d requests", len(self._running))
            for handle in self._running:
                assert handle.generation is not None
                handle.generation.finish("error")
                self._finish(handle, f"internal error while generating: {type(exc).__name__}")
            self._running = []
            return
        now = time.perf_counter()
        still_running = []
        for handle, output in zip(self._running, outputs):
            if output is not None:
                if self.observer is not None:
                    self.observer.on_output(handle, output)
                handle.last_output_at = now
                handle.deliver(output)
            assert handle.generation is not None
            if handle.generation.finished:
                self._finish(handle, None)
            else:
                still_running.append(handle)
        self._running = still_running

    def _finish(self, handle: RequestHandle, error: str | None) -> None:
        handle.error = error
        if self.observer is not None:
            self.observer.on_finish(handle)
        handle.deliver(_Done(error))

    def _report_queue(self) -> None:
        if self.observer is not None:
            self.observer.on_queue(len(self._waiting), len(self._running))
