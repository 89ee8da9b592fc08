"""Windowed serving statistics for the dashboard (``GET /v1/stats``), fed as a scheduler observer.

Prometheus (``parrot/server/metrics.py``) keeps cumulative histograms for a scraper to difference; the
dashboard has no scraper, so this collector keeps the recent past itself: time is cut into
buckets of ``bucket_s`` seconds and only the buckets of the last ``window_s`` seconds are kept
(older ones are dropped as new ones open, which bounds memory by the window, not the uptime).
Each bucket holds counts and the raw latency samples that fell into it, so percentiles are exact
over any span of whole buckets.

What is counted, and when:
- A "request" is one generated sequence (an ``n=3`` completion is three). It counts when it
  finishes, as ``ok``, ``cancelled`` (client gone, timeout) or ``error``.
- TTFT and ITL are the scheduler's ``OutputLatency`` of each output, the samples
  ``parrot/server/metrics.py`` observes too: TTFT is submission -> first token; ITL is the time since
  the previous emission divided by the tokens emitted, one sample per token (a verification pass
  can emit several tokens at once). End-to-end is submission -> finish, for ``ok`` requests.
- Output tokens and the ``SPECULATION_COUNTERS`` (forward passes, drafted, accepted and forced
  tokens) count as each step happens (differences of the stats snapshots that outputs carry), so
  a long request moves the charts while it runs rather than all at once when it ends.
- Queue depth and running requests are the values the scheduler last reported, plus the maximum
  seen in each bucket.

Hooks run on the engine thread and ``snapshot`` on the event loop; one lock guards the buckets.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from parrot.engine.interface import SPECULATION_COUNTERS, StepOutput
from parrot.engine.scheduler import Observer, OutputLatency, RequestHandle


def percentile(samples: list[tuple[float, int]], q: float) -> float | None:
    """Weighted nearest-rank percentile of ``(value, weight)`` pairs; None when there are none.

    Nearest rank: the smallest value whose cumulative weight reaches ``q`` percent of the total,
    so the result is always an observed value. Example: values 1, 2, 3, 4 with weight 1 each give
    p50 = 2 (cumulative 2 of 4 reaches 50%) and p99 = 4.
    """
    if not samples:
        return None
    ordered = sorted(samples)
    total = sum(weight for _, weight in ordered)
    target = max(1, math.ceil(total * q / 100.0))
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= target:
            return value
    return ordered[-1][0]


@dataclass
class _Bucket:
    start: float  # perf_counter at the bucket's start
    admitted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"ok": 0, "cancelled": 0, "error": 0})
    output_tokens: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPECULATION_COUNTERS, 0))
    ttft: list[tuple[float, int]] = field(default_factory=list)
    itl: list[tuple[float, int]] = field(default_factory=list)  # (seconds per token, tokens)
    e2e: list[tuple[float, int]] = field(default_factory=list)
    max_waiting: int = 0
    max_running: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found there


class StatsCollector:
    """Scheduler observer that keeps the last ``window_s`` seconds in ``bucket_s`` buckets."""

    def __init__(self, window_s: float = 300.0, bucket_s: float = 5.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.clock = clock  # the scheduler's clock: handles carry perf_counter times
        self.started_at = clock()
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}
        self._seen: dict[int, dict[str, int]] = {}  # id(handle) -> counters already added
        self.waiting = 0
        self.running = 0

    # -- observer hooks (engine thread) ---------------------------------------------------------

    def on_admit(self, handle: RequestHandle) -> None:
        with self._lock:
            self._bucket(self.clock()).admitted += 1
            self._seen[id(handle)] = dict.fromkeys(SPECULATION_COUNTERS, 0)

    def on_output(self, handle: RequestHandle, output: StepOutput, latency: OutputLatency) -> None:
        n = len(output.token_ids)
        with self._lock:
            bucket = self._bucket(self.clock())
            bucket.output_tokens += n
            if latency.ttft_s is not None:
                bucket.ttft.append((latency.ttft_s, 1))
                bucket.prefix_query_tokens += output.stats.prefix_query_tokens
                bucket.prefix_hit_tokens += output.stats.cached_tokens
            if latency.itl_s is not None:
                bucket.itl.append((latency.itl_s, n))
            seen = self._seen.get(id(handle))
            if seen is not None:
                for name, value in output.stats.counters().items():
                    bucket.counters[name] += value - seen[name]
                    seen[name] = value

    def on_finish(self, handle: RequestHandle) -> None:
        now = self.clock()
        with self._lock:
            bucket = self._bucket(now)
            if handle.error is not None or handle.finish_reason == "error":
                status = "error"
            elif handle.cancelled or handle.stats is None or handle.finish_reason == "cancelled":
                status = "cancelled"  # handle.stats is None: it never reached the engine
            else:
                status = "ok"
            bucket.finished[status] += 1
            if status == "ok":
                bucket.e2e.append((now - handle.enqueued_at, 1))
            # Every change of the counters came with an output, already added in on_output.
            self._seen.pop(id(handle), None)

    def on_queue(self, waiting: int, running: int, kv_positions: int = 0) -> None:
        with self._lock:
            self.waiting, self.running = waiting, running
            bucket = self._bucket(self.clock())
            bucket.max_waiting = max(bucket.max_waiting, waiting)
            bucket.max_running = max(bucket.max_running, running)

    # -- reading (event loop) -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The ``GET /v1/stats`` body (see ``parrot/server/routes/dashboard.py`` for the field list)."""
        now = self.clock()
        wall_offset = time.time() - now
        with self._lock:
            self._expire(now)
            current = self._index(now)
            first = current - self._num_buckets() + 1
            buckets = [self._buckets.get(i) or _Bucket(start=i * self.bucket_s) for i in range(first, current + 1)]
            waiting, running = self.waiting, self.running
        # The window covers whole buckets, but never more time than the collector has existed,
        # so rates right after start-up are not diluted by minutes that never happened.
        span = min(now - buckets[0].start, now - self.started_at)
        series = [self._point(b, min(self.bucket_s, now - b.start), wall_offset) for b in buckets
                  if b.start + self.bucket_s > self.started_at]
        return {
            "time": now + wall_offset,
            "uptime_s": now - self.started_at,
            "window_s": self.window_s,
            "bucket_s": self.bucket_s,
            "current": {"waiting": waiting, "running": running},
            "window": self._aggregate(buckets, max(span, 1e-9)),
            "series": series,
        }

    # -- internals ------------------------------------------------------------------------------

    def _num_buckets(self) -> int:
        return int(math.ceil(self.window_s / self.bucket_s))

    def _index(self, t: float) -> int:
        return int(t // self.bucket_s)

    def _bucket(self, t: float) -> _Bucket:
        index = self._index(t)
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = _Bucket(start=index * self.bucket_s)
            self._expire(t)
        return bucket

    def _expire(self, now: float) -> None:
        oldest = self._index(now) - self._num_buckets() + 1
        for index in [i for i in self._buckets if i < oldest]:
            del self._buckets[index]

    @staticmethod
    def _latency(samples: list[tuple[float, int]]) -> dict[str, Any]:
        return {"p50": percentile(samples, 50), "p99": percentile(samples, 99), "count": sum(w for _, w in samples)}

    def _aggregate(self, buckets: list[_Bucket], span: float) -> dict[str, Any]:
        finished = {k: sum(b.finished[k] for b in buckets) for k in ("ok", "cancelled", "error")}
        counters = {k: sum(b.counters[k] for b in buckets) for k in SPECULATION_COUNTERS}
        output_tokens = sum(b.output_tokens for b in buckets)
        passes = counters["forward_passes"]
        queried = sum(b.prefix_query_tokens for b in buckets)
        hit = sum(b.prefix_hit_tokens for b in buckets)
        return {
            "span_s": span,
            "requests": finished,
            "request_rate": sum(finished.values()) / span,
            "admitted": sum(b.admitted for b in buckets),
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / span,
            **counters,
            "accepted_per_pass": counters["accepted_tokens"] / passes if passes else None,
            "tokens_per_pass": output_tokens / passes if passes else None,
            "acceptance_rate": counters["accepted_tokens"] / counters["drafted_tokens"] if counters["drafted_tokens"] else None,
            "ttft_s": self._latency([s for b in buckets for s in b.ttft]),
            "itl_s": self._latency([s for b in buckets for s in b.itl]),
            "e2e_s": self._latency([s for b in buckets for s in b.e2e]),
            "max_waiting": max(b.max_waiting for b in buckets),
            "max_running": max(b.max_running for b in buckets),
            "prefix_cache_queried_tokens": queried,
            "prefix_cache_hit_tokens": hit,
            "prefix_cache_hit_rate": hit / queried if queried else None,
        }

    def _point(self, b: _Bucket, length: float, wall_offset: float) -> dict[str, Any]:
        length = max(length, 1e-9)
        passes = b.counters["forward_passes"]
        return {
            "t": b.start + wall_offset,
            "request_rate": sum(b.finished.values()) / length,
            "errors": b.finished["error"],
            "output_tokens_per_s": b.output_tokens / length,
            "ttft_p50": percentile(b.ttft, 50), "ttft_p99": percentile(b.ttft, 99),
            "itl_p50": percentile(b.itl, 50), "itl_p99": percentile(b.itl, 99),
            "e2e_p50": percentile(b.e2e, 50), "e2e_p99": percentile(b.e2e, 99),
            "accepted_per_pass": b.counters["accepted_tokens"] / passes if passes else None,
            "tokens_per_pass": b.output_tokens / passes if passes else None,
            "drafted_tokens": b.counters["drafted_tokens"],
            "accepted_tokens": b.counters["accepted_tokens"],
            "forced_tokens": b.counters["forced_tokens"],
            "waiting": b.max_waiting,
            "running": b.max_running,
            "prefix_cache_hit_rate": b.prefix_hit_tokens / b.prefix_query_tokens if b.prefix_query_tokens else None,
        }


class Observers:
    """Fans the scheduler's observer hooks out to several observers (Prometheus metrics, stats)."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def on_admit(self, handle: RequestHandle) -> None:
        for o in self.observers:
            o.on_admit(handle)

    def on_output(self, handle: RequestHandle, output: StepOutput, latency: OutputLatency) -> None:
        for o in self.observers:
            o.on_output(handle, output, latency)

    def on_finish(self, handle: RequestHandle) -> None:
        for o in self.observers:
            o.on_finish(handle)

    def on_queue(self, waiting: int, running: int, kv_positions: int) -> None:
        for o in self.observers:
            o.on_queue(waiting, running, kv_positions)
