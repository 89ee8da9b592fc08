"""The engine thread: a bounded queue of requests, stepped together, results handed to asyncio.

The HTTP layer never runs the model. It submits a ``GenerationRequest`` and gets a
``RequestHandle`` whose ``events()`` async iterator yields the engine's ``StepOutput``s. One
thread owns the engine and loops:

1. admit waiting requests while fewer than ``max_running`` run (a full waiting queue makes
   ``submit`` raise ``QueueFull``, which the API turns into 429);
2. drop cancelled requests (client gone, timeout), which frees their KV caches at once;
3. one ``Engine.step`` over every running request: all of them advance in the same forward
   pass, so a long request cannot starve short ones, and long prompts are prefilled in chunks;
4. hand each request's output to its asyncio queue with ``call_soon_threadsafe``; the handle
   keeps the finish reason and stats snapshot of the last one. A request's ``Generation`` never
   leaves this thread: observers and routes read ``StepOutput``s and the handle;
5. when nothing runs or waits any more, give the memory the finished requests freed back to the
   OS (``release_free_memory``) before sleeping.

Faults: a request whose grammar fails ends with its own error (``Generation.error``), the others
of the step go on; an exception in ``Engine.step`` fails the requests of that step (their KV caches are
dropped) and the loop goes on with the waiting ones; one in ``Engine.start`` fails that request
only. Anything else raising in the loop is a bug of the loop itself, whose state can no longer
be trusted: the engine stops, every request still waiting or running fails, ``failure`` says
why (``/health`` then answers 503), and ``submit`` refuses new requests.
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

from parrot.engine.engine import Engine, Generation
from parrot.engine.errors import EngineError, EngineRequestError, EngineStopped
from parrot.engine.interface import FinishReason, GenerationRequest, SequenceStats, StepOutput
from parrot.engine.memory import release_free_memory

log = logging.getLogger("parrot.scheduler")


class QueueFull(Exception):
    """The waiting queue is at its bound."""


@dataclass
class _Done:
    error: EngineError | None = None


@dataclass(frozen=True)
class OutputLatency:
    """Latencies of one output, measured once on the engine thread for every observer.

    ``ttft_s``: submission -> this output, when it is the request's first (else None).
    ``itl_s``: for a later output with tokens, the time since the previous output divided by its
    tokens, one sample per token: a verification pass can emit several tokens at once, and this
    is the time per output token as vLLM reports it (else None).
    """

    ttft_s: float | None
    itl_s: float | None


def output_latency(enqueued_at: float, last_output_at: float | None, num_tokens: int, now: float) -> OutputLatency:
    """The ``OutputLatency`` of an output of ``num_tokens`` tokens at ``now``."""
    if last_output_at is None:
        return OutputLatency(now - enqueued_at, None)
    return OutputLatency(None, (now - last_output_at) / num_tokens if num_tokens > 0 else None)


class Observer(Protocol):
    """Metrics hooks, called on the engine thread: on_admit, on_output per output, on_finish."""

    def on_admit(self, handle: RequestHandle) -> None: ...
    def on_output(self, handle: RequestHandle, output: StepOutput, latency: OutputLatency) -> None: ...
    def on_finish(self, handle: RequestHandle) -> None: ...
    def on_queue(self, waiting: int, running: int, kv_positions: int) -> None: ...


class RequestHandle:
    """One submitted request, as the HTTP side sees it.

    The engine thread writes ``finish_reason`` and ``stats`` (a snapshot: from admission on,
    then the last output's) before it queues the output they came with, so a reader that has
    received an output sees them at least that recent. The request's ``Generation`` stays on
    the engine thread.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, scheduler: Scheduler, tag: str) -> None:
        self.request = request
        self.tag = tag  # the endpoint, for metrics labels
        self.loop = loop
        self.queue: asyncio.Queue[StepOutput | _Done] = asyncio.Queue()
        self.scheduler = scheduler
        self.cancelled = False
        self.enqueued_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.last_output_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self.stats: SequenceStats | None = None  # None until the engine accepted the request
        self.error: EngineError | None = None

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
        """Outputs until the generation ends; raises its EngineError if it failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                return
            yield item


class Scheduler:
    def __init__(self, engine: Engine, max_running: int, max_queue: int, observer: Observer | None = None) -> None:
        self.engine = engine
        self.max_running = max_running
        self.max_queue = max_queue
        self.observer = observer
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[tuple[RequestHandle, Generation]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._stepped = False  # a step ran since the heap's free memory was last released
        self._kv_positions = 0  # positions the running requests' KV caches hold (engine thread)
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine loop stopped by itself, if it did

    # -- called from the HTTP side --------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a new thread (``run`` runs it on the calling thread)."""
        self._thread = threading.Thread(target=self.run, name="parrot-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop (after its current step) and wait for it: whatever still runs or waits
        fails with ``EngineStopped``."""
        self.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def close(self) -> None:
        """``stop`` without waiting."""
        with self._cv:
            self._stop = True
            self._cv.notify()

    def submit(self, request: GenerationRequest, tag: str = "") -> RequestHandle:
        handle = RequestHandle(request, asyncio.get_running_loop(), self, tag)
        with self._cv:
            if self.failure is not None:
                raise EngineError(f"the engine has stopped: {self.failure}")
            if self._stop:
                raise EngineStopped()
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
        """The engine loop; returns after ``stop`` (or a fault of the loop itself, see the module
        docstring). All model work happens on this thread."""
        error: EngineError = EngineStopped()
        try:
            self._loop()
        except Exception as exc:
            log.exception("the engine loop failed; the engine has stopped")
            error = EngineError(f"internal error in the engine loop: {type(exc).__name__}")
            with self._cv:
                self.failure = str(error)
        with self._cv:
            self._stop = True  # submit refuses from now on, so nothing is left waiting
            left = list(self._waiting) + [h for h, _ in self._running]
            self._waiting.clear()
        for _, generation in self._running:
            generation.finish("error")
        self._running = []
        for handle in left:
            self._finish(handle, error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = not (self._stop or self._waiting or self._running)
            if idle and self._stepped:
                self._stepped = False
                release_free_memory()  # outside the lock: submit() does not wait for it
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    return
                admitted = self._admit()
            for handle in admitted:
                self._start(handle)
            self._drop_cancelled()
            if self._running:
                self._step()
                self._stepped = True
            self._kv_positions = sum(generation.cache.length for _, generation in self._running)
            self._report_queue()

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
            generation = self.engine.start(handle.request)
        except EngineRequestError as exc:  # the request's fault (HTTP 400)
            self._finish(handle, exc)
            return
        except Exception as exc:  # a bug, or no memory for its KV cache: fail this request only
            log.exception("starting a request failed")
            self._finish(handle, EngineError(f"internal error while starting the request: {type(exc).__name__}"))
            return
        handle.stats = generation.stats.snapshot()
        self._running.append((handle, generation))
        if self.observer is not None:
            self.observer.on_admit(handle)

    def _drop_cancelled(self) -> None:
        for handle, generation in [r for r in self._running if r[0].cancelled]:
            generation.cancel()
            self._running.remove((handle, generation))
            self._ended(handle, generation, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step([generation for _, generation in self._running])
        except Exception as exc:  # a bug or an out-of-memory: fail these requests, keep serving
            log.exception("engine step failed for %d requests", len(self._running))
            for handle, generation in self._running:
                generation.finish("error")
                self._ended(handle, generation, EngineError(f"internal error while generating: {type(exc).__name__}"))
            self._running = []
            return
        now = time.perf_counter()
        still_running = []
        for (handle, generation), output in zip(self._running, outputs):
            if output is not None:
                self._output(handle, output, now)
            if generation.error is not None:  # this request alone failed (its grammar)
                log.warning("a request failed: %s", generation.error)
                self._ended(handle, generation, generation.error)
            elif generation.finished:
                self._finish(handle, None)
            else:
                still_running.append((handle, generation))
        self._running = still_running

    def _output(self, handle: RequestHandle, output: StepOutput, now: float) -> None:
        if self.observer is not None:
            latency = output_latency(handle.enqueued_at, handle.last_output_at, len(output.token_ids), now)
            self.observer.on_output(handle, output, latency)
        handle.last_output_at = now
        handle.finish_reason, handle.stats = output.finish_reason, output.stats
        handle.deliver(output)

    def _ended(self, handle: RequestHandle, generation: Generation, error: EngineError | None) -> None:
        """Finish a request the scheduler ended (cancelled, or failed), or one whose own error ended
        it in the engine (``Generation.error``): its finish reason and stats are the generation's."""
        handle.finish_reason, handle.stats = generation.finish_reason, generation.stats.snapshot()
        self._finish(handle, error)

    def _finish(self, handle: RequestHandle, error: EngineError | None) -> None:
        handle.error = error
        if self.observer is not None:
            self.observer.on_finish(handle)
        handle.deliver(_Done(error))

    def _report_queue(self) -> None:
        if self.observer is not None:
            self.observer.on_queue(len(self._waiting), len(self._running), self._kv_positions)
