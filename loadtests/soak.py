"""``make soak``: 1,000 mixed requests at 8-way concurrency; no request lost, no output corrupted,
no 5xx, and resident memory that does not grow.

    python -m loadtests.soak [--url URL [--pid PID]] [--requests 1000] [--concurrency 8]
                             [--duration 3600] [--pool 96] [--max-tokens 48] [--seed 0]

Without ``--url`` it starts ``parrot serve`` (the embedded model) on a loopback port and stops it
with SIGTERM at the end; it talks to no other host. Phases:

1. *Reference*: each of ``--pool`` distinct valid requests (``soak_requests.py``: the five tasks
   of ../shared/data and JSON schemas of schemas.jsonl; unconstrained, json_schema, json_object,
   guided_choice, guided_regex; chat and completions; greedy and seeded; drafting on and off) is
   sent alone, non-streamed. Its answer is the sequential output every later copy must equal.
2. *Warm-up*: each of them once more (``--warmup``), from 8 clients, so that the memory full
   batches of these prompts need is held before resident memory is first read.
3. *Soak*: ``--requests`` requests from 8 (``--concurrency``) closed-loop clients, each drawn
   by ``soak_requests.plan``: malformed ones (bad JSON, wrong types, unknown parameters, ...)
   must get a 4xx in OpenAI's error shape; cancelled ones close their connection after a few
   streamed chunks or before a non-streamed answer; the rest run to the end, streamed or not.
   Every request gets exactly one outcome: ok, expected_4xx, cancelled, unexpected_5xx,
   error_event (an error inside a 200 stream), unexpected_status, bad_response, transport_error,
   timeout. A finished answer must equal its reference (text, finish_reason, completion tokens);
   a cancelled stream's text must be a prefix of it; a finished constrained output must satisfy
   its constraint. No new request starts after ``--duration`` seconds.
4. *Settle*: the server must report no running or waiting request (cancelled ones freed), and
   its request counters must have seen every soak request. Resident memory (VmRSS from
   /proc/PID/status of the server process) after the warm-up and now gives the growth.
5. *Recheck*: ``--recheck`` reference requests again, alone: still the same answers.

Pauses: a monitor notes when this process sleeps far longer than asked (it was stopped, e.g. by
SIGSTOP) and when the server process is seen stopped; they are reported, not failures. Prints
tables; writes loadtests/results/soak.json (every request) and soak.md. Exit status 0 when every
goal holds: 0 lost, 0 corrupted, 0 unexpected 5xx (or error events), no other unexpected outcome,
0 constraint violations, the server idle after the soak, RSS growth under 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, TypeVar

import httpx

from loadtests.load_workload import DATA
from loadtests.soak_report import render, summarize
from loadtests.soak_requests import PoolEntry, Planned, candidate_entries, plan

RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")
# Resident memory is read this long after the server went idle: its engine hands freed memory
# back to the OS then (``Scheduler.release_free_memory``), and the reading should not race that.
IDLE_S = 2.0


@dataclass
class Answer:
    """The part of an answer that must not depend on load."""

    text: str
    finish_reason: str | None
    completion_tokens: int | None


@dataclass
class Record:
    index: int
    phase: str
    action: str
    kind: str  # the pool entry's key or the malformed request's name
    stream: bool
    outcome: str = "ok"
    http_status: int | None = None
    seconds: float = 0.0
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    compared: bool = False
    mismatch: dict[str, Any] | None = None
    violation: str | None = None
    text: str = field(default="", repr=False)  # kept in memory only


# -- One request ----------------------------------------------------------------------------


def _openai_error_shape(response: httpx.Response) -> str | None:
    """None if the body is ``{"error": {"message": str, "type": str, "param", "code"}}``, else why not."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"body is not an OpenAI error: {response.text[:200]!r}"
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error):
        return f"error object lacks message/type/param/code: {str(error)[:200]}"
    return None


def _status_outcome(record: Record, response: httpx.Response, body_text: str) -> None:
    """A valid request answered with something other than 200."""
    record.outcome = "unexpected_5xx" if response.status_code >= 500 else "unexpected_status"
    record.error = body_text[:300]


def _take(record: Record, choice: dict[str, Any], usage: dict[str, Any] | None) -> None:
    if choice.get("finish_reason"):
        record.finish_reason = choice["finish_reason"]
    if usage:
        record.completion_tokens = usage.get("completion_tokens")
        speculation = usage.get("speculation") or {}
        record.drafted, record.accepted = speculation.get("drafted_tokens", 0), speculation.get("accepted_tokens", 0)


async def _complete(client: httpx.AsyncClient, planned: Planned, record: Record) -> None:
    entry = planned.entry
    assert entry is not None
    if not planned.stream:
        response = await client.post(entry.path, json=entry.body)
        record.http_status = response.status_code
        if response.status_code != 200:
            return _status_outcome(record, response, response.text)
        try:
            data = response.json()
            choice = data["choices"][0]
            record.text = choice["message"]["content"] if entry.endpoint == "chat" else choice["text"]
            _take(record, choice, data["usage"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            record.outcome, record.error = "bad_response", f"{type(exc).__name__}: {exc}: {response.text[:200]}"
        return
    body = {**entry.body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", entry.path, json=body) as response:
        record.http_status = response.status_code
        if response.status_code != 200:
            return _status_outcome(record, response, (await response.aread()).decode("utf-8", "replace"))
        pieces: list[str] = []
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                record.outcome, record.error = "error_event", str(event["error"])[:300]
                continue
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if entry.endpoint == "chat" else choice.get("text")
                if piece:
                    pieces.append(piece)
                    record.chunks += 1
                _take(record, choice, None)
            if event.get("usage"):
                _take(record, {}, event["usage"])
            if planned.action == "cancel_stream" and record.chunks >= planned.cancel_after_chunks and not record.finish_reason:
                record.outcome = "cancelled"
                break  # leaving the block closes the connection mid-stream
        record.text = "".join(pieces)
        if record.outcome == "ok" and not done:
            record.outcome, record.error = "bad_response", "the stream ended without data: [DONE]"


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """``awaitable``'s result, or TimeoutError once ``timeout`` seconds have passed *while this
    process ran*: waited in slices of 1 s, a slice that ends late (the process was stopped, as
    other benchmarks on the machine do with SIGSTOP) counts as 1.5 s, so a stopped machine does not
    turn every request in flight into a timeout."""
    task = asyncio.ensure_future(awaitable)
    left = timeout
    try:
        while left > 0:
            before = time.monotonic()
            done, _ = await asyncio.wait({task}, timeout=min(1.0, left))
            if done:
                return task.result()
            left -= min(time.monotonic() - before, 1.5)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    raise asyncio.TimeoutError


async def send(client: httpx.AsyncClient, planned: Planned, phase: str, timeout: float) -> Record:
    """Send one planned request; never raises: whatever happens becomes the record's outcome."""
    kind = planned.malformed.name if planned.malformed else planned.entry.key  # type: ignore[union-attr]
    record = Record(planned.index, phase, planned.action, kind, planned.stream)
    start = time.perf_counter()
    try:
        if planned.malformed is not None:
            m = planned.malformed
            response = await within(
                client.request(m.method, m.path, content=m.content, headers={"content-type": m.content_type}), timeout)
            record.http_status = response.status_code
            shape = _openai_error_shape(response)
            if 400 <= response.status_code < 500 and shape is None:
                record.outcome = "expected_4xx"
            else:
                record.outcome = "unexpected_5xx" if response.status_code >= 500 else "unexpected_status"
                record.error = shape or f"a malformed request got {response.status_code}"
        elif planned.action == "cancel_wait":
            try:  # cancelling the request closes its connection before the answer
                await asyncio.wait_for(_complete(client, planned, record), planned.cancel_after_s)
            except asyncio.TimeoutError:
                record.outcome = "cancelled"
        else:
            await within(_complete(client, planned, record), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.outcome, record.error = "timeout", f"no complete answer within {timeout:g} s"
    except httpx.HTTPError as exc:
        record.outcome, record.error = "transport_error", f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # a stream event that is not JSON
        record.outcome, record.error = "bad_response", f"{type(exc).__name__}: {exc}"
    record.seconds = round(time.perf_counter() - start, 3)
    return record


# -- Checks ---------------------------------------------------------------------------------


def violation(entry: PoolEntry, text: str) -> str | None:
    """Why a finished (finish_reason "stop") constrained output breaks its constraint, or None."""
    if entry.constraint in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"not JSON: {exc}"
        return None if entry.constraint == "json_schema" or isinstance(value, dict) else "json_object output is not an object"
    if entry.constraint == "choice" and text not in entry.check:
        return f"{text!r} is not one of {entry.check}"
    if entry.constraint == "regex" and re.fullmatch(entry.check, text) is None:
        return f"{text!r} does not match {entry.check!r}"
    return None


def check(record: Record, entry: PoolEntry, reference: Answer) -> None:
    """Compare a finished answer with its reference (a cancelled stream: its text is a prefix)."""
    if record.outcome == "cancelled" and record.action == "cancel_stream":
        record.compared = True
        if not reference.text.startswith(record.text):
            record.mismatch = _difference(record.text, reference.text, "cancelled stream is not a prefix of the reference")
        return
    if record.outcome != "ok":
        return
    record.compared = True
    got = Answer(record.text, record.finish_reason, record.completion_tokens)
    if got != reference:
        record.mismatch = _difference(record.text, reference.text, "differs from the sequential output")
        record.mismatch.update(finish=[record.finish_reason, reference.finish_reason],
                               tokens=[record.completion_tokens, reference.completion_tokens])
    if record.finish_reason == "stop" and entry.constraint != "none":
        record.violation = violation(entry, record.text)


def _difference(got: str, want: str, what: str) -> dict[str, Any]:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"what": what, "first_difference_at": at, "got": got[max(0, at - 40): at + 80],
            "reference": want[max(0, at - 40): at + 80]}


# -- The server process -----------------------------------------------------------------------


def rss_kb(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in kB, from /proc/PID/status."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    except OSError:
        return None


def stopped(pid: int | None) -> bool:
    """Whether the process is stopped (state T, as after SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, TypeError):
        return False


def listening_pid(port: int) -> int | None:
    """The process listening on a local TCP ``port`` (from /proc/net/tcp*), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    return None


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's samples from /metrics: ``name{labels}`` -> value."""
    text = (await within(client.get("/metrics"), 600)).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def counted_requests(before: dict[str, float], after: dict[str, float]) -> Counter[str]:
    """Requests the server counted in between, by status, leaving out /health and /metrics."""
    counts: Counter[str] = Counter()
    for name, value in after.items():
        if name.startswith("parrot_requests_total{") and 'endpoint="/health"' not in name and 'endpoint="/metrics"' not in name:
            status = re.search(r'status="(\d+)"', name)
            counts[status.group(1) if status else "?"] += int(value - before.get(name, 0.0))
    return +counts


class Monitor:
    """Samples the server's RSS every 2 s and notes pauses: this process sleeping 3 s longer than
    asked (it was stopped), or the server process seen stopped."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.samples, self.pauses, self.server_stopped_seen = pid, [], [], 0
        self.start = time.monotonic()

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.5)
            late = time.monotonic() - before - 0.5
            if late > 3:
                self.pauses.append({"at_s": round(before - self.start, 1), "seconds": round(late, 1)})
            self.server_stopped_seen += stopped(self.pid)
            if not self.samples or time.monotonic() - self.start - self.samples[-1][0] >= 2:
                self.samples.append((round(time.monotonic() - self.start, 1), rss_kb(self.pid)))


def start_server(port: int, request_timeout: float, fixed_drafts: int, log: Path,
                 api_key: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PARROT_SERVER_REQUEST_TIMEOUT_S": str(request_timeout)}
    if api_key:
        env["PARROT_API_KEY"] = api_key
    if fixed_drafts:
        env.update(PARROT_DRAFTING_ADAPTIVE="false", PARROT_DRAFTING_MAX_DRAFT=str(fixed_drafts))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_healthy(client: httpx.AsyncClient, process: subprocess.Popen[bytes] | None, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"parrot serve exited with {process.returncode}")
        try:
            r = await client.get("/health", timeout=5)
            if r.status_code == 200:
                return str(r.json().get("model"))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1)
    raise TimeoutError(f"{client.base_url} not ready after {timeout:g} s")


def log_problems(log: Path) -> list[str]:
    """Lines of the server's log that say something went wrong."""
    pattern = re.compile(r"Traceback|ERROR|CRITICAL|never retrieved|Exception in|Task was destroyed")
    return [line for line in log.read_text(errors="replace").splitlines() if pattern.search(line)]


# -- The run --------------------------------------------------------------------------------


async def run(args: argparse.Namespace, url: str, pid: int | None, process: subprocess.Popen[bytes] | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    # No httpx timeouts: a request's time limit is `within`'s, which does not count pauses.
    key = getattr(args, "api_key", None)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None, headers=headers) as client:
        model = await wait_healthy(client, process, 900)
        monitor = Monitor(pid)
        watcher = asyncio.ensure_future(monitor.run())
        rss: dict[str, int | None] = {"loaded": rss_kb(pid)}
        phases: dict[str, float] = {}
        records: list[Record] = []

        # 1. Reference: each pool entry alone; entries the server refuses (4xx) are replaced.
        t = time.monotonic()
        pool: list[PoolEntry] = []
        references: dict[str, Answer] = {}
        refused: list[dict[str, Any]] = []
        for entry in candidate_entries(args.data, args.seed, args.max_tokens, args.max_prompt_chars):
            if len(pool) == args.pool:
                break
            record = await send(client, Planned(-1 - len(records), "complete", entry), "reference", args.timeout)
            records.append(record)
            if record.outcome == "ok":
                pool.append(entry)
                references[entry.key] = Answer(record.text, record.finish_reason, record.completion_tokens)
                if record.finish_reason == "stop" and entry.constraint != "none":
                    record.violation = violation(entry, record.text)
            elif record.outcome == "unexpected_status" and record.http_status and 400 <= record.http_status < 500:
                refused.append({"key": entry.key, "status": record.http_status, "error": record.error})
            _progress(f"reference {len(pool)}/{args.pool}", record)
        phases["reference_s"] = time.monotonic() - t
        if not pool:
            raise RuntimeError("no valid request got a 200 from the server: nothing to soak with")
        await asyncio.sleep(IDLE_S)
        rss["after_reference"] = rss_kb(pid)

        # 2. Warm-up: every pool entry once at full concurrency, half of them streamed, so that the
        # first reading of resident memory is taken once the server has held full batches of every
        # prompt the soak sends (glibc keeps what such batches allocated for the next ones).
        t = time.monotonic()
        by_key = {e.key: e for e in pool}
        warm = [Planned(-10_000 - i, "complete", pool[i % len(pool)], stream=i % 2 == 1)
                for i in range(len(pool) if args.warmup is None else args.warmup)]

        async def warm_loop() -> None:
            while warm:
                record = await send(client, warm.pop(0), "warmup", args.timeout)
                check(record, by_key[record.kind], references[record.kind])
                records.append(record)

        await asyncio.gather(*(warm_loop() for _ in range(args.concurrency)))
        phases["warmup_s"] = time.monotonic() - t
        await asyncio.sleep(IDLE_S)
        rss["start"] = rss_kb(pid)
        counters_before = await metrics(client)

        # 3. Soak: closed loop, `concurrency` clients.
        t = time.monotonic()
        issued = 0
        soak: list[Record] = []

        async def client_loop() -> None:
            nonlocal issued
            while issued < args.requests and time.monotonic() - t < args.duration:
                planned = plan(issued, pool, args.seed)
                issued += 1
                record = await send(client, planned, "soak", args.timeout)
                if planned.entry is not None:
                    check(record, planned.entry, references[planned.entry.key])
                soak.append(record)
                if len(soak) % 50 == 0 or record.outcome not in ("ok", "expected_4xx", "cancelled") or record.mismatch:
                    _progress(f"soak {len(soak)}/{args.requests} ({time.monotonic() - t:.0f} s)", record)

        loops = [asyncio.ensure_future(client_loop()) for _ in range(args.concurrency)]
        results = await asyncio.gather(*loops, return_exceptions=True)
        crashed = [repr(r) for r in results if isinstance(r, BaseException)]  # would lose requests: reported
        phases["soak_s"] = time.monotonic() - t
        phases_at = {"soak": t - monitor.start, "soak_end": time.monotonic() - monitor.start}  # on the samples' clock

        # 4. Settle: nothing running or waiting; every request counted; RSS at the end.
        t = time.monotonic()
        idle = False
        while time.monotonic() - t < 120:
            sample = await metrics(client)
            if sample.get("parrot_requests_running") == 0 and sample.get("parrot_requests_waiting") == 0:
                idle = True
                break
            await asyncio.sleep(1)
        phases["settle_s"] = time.monotonic() - t
        counted = counted_requests(counters_before, await metrics(client))
        await asyncio.sleep(IDLE_S)
        rss["end"] = rss_kb(pid)

        # 5. Recheck: reference requests alone again.
        t = time.monotonic()
        for i, entry in enumerate(pool[: args.recheck]):
            record = await send(client, Planned(-20_000 - i, "complete", entry), "recheck", args.timeout)
            check(record, entry, references[entry.key])
            records.append(record)
        phases["recheck_s"] = time.monotonic() - t
        health = (await within(client.get("/health"), 600)).status_code
        watcher.cancel()

    records.extend(sorted(soak, key=lambda r: r.index))
    return {"model": model, "url": url, "server_pid": pid, "pool_refused": refused, "issued": issued,
            "client_crashes": crashed, "idle_after_soak": idle, "server_counted": dict(counted), "health_after": health,
            "rss_kb": rss, "rss_samples": monitor.samples, "pauses": monitor.pauses,
            "server_stopped_samples": monitor.server_stopped_seen, "phases_s": phases, "phases_at": phases_at,
            "records": [{k: v for k, v in asdict(r).items() if k != "text"} for r in records],
            "pool": {k: {"task": e.task, "constraint": e.constraint, "endpoint": e.endpoint, "sampling": e.sampling,
                         "drafting": e.drafting} for k, e in by_key.items()}}


def _progress(label: str, record: Record) -> None:
    note = "" if record.outcome in ("ok", "expected_4xx", "cancelled") else f" {record.http_status} {record.error}"
    note += f" MISMATCH {record.mismatch}" if record.mismatch else ""
    print(f"[soak] {label}: #{record.index} {record.action} {record.kind}: {record.outcome}{note}"[:400],
          file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "cpu")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return {"cpu": name, "isa": isa, "cores": os.cpu_count(), "loadavg": os.getloadavg()}


def dump(result: dict[str, Any]) -> str:
    """JSON with one line per request and per RSS sample (indented, they would be 20 lines each)."""
    rows = ("records", "rss_samples")
    text = json.dumps({k: v for k, v in result.items() if k not in rows}, indent=1)[: -len("\n}")]
    for key in rows:
        text += f',\n "{key}": [\n  ' + ",\n  ".join(json.dumps(row) for row in result[key]) + "\n ]"
    return text + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server on this machine (default: start parrot serve on the embedded model)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id (default: whoever listens on the port)")
    p.add_argument("--port", type=int, default=8763)
    p.add_argument("--requests", type=int, default=1000, help="soak requests")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--duration", type=float, default=3600, help="seconds after which no new soak request starts")
    p.add_argument("--pool", type=int, default=96, help="distinct valid requests, each with a sequential reference")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests before the first RSS reading (default: --pool)")
    p.add_argument("--recheck", type=int, default=16, help="reference requests sent alone again after the soak")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-prompt-chars", type=int, default=3000, help="use only task prompts up to this length")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request before it counts as a timeout")
    p.add_argument("--server-timeout", type=float, default=3600,
                   help="request_timeout_s of the server started (long: a stopped machine must not turn into 504s)")
    p.add_argument("--fixed-drafts", type=int, default=0, metavar="N",
                   help="start the server with drafting.adaptive = false and max_draft N: drafts of up to N tokens are "
                        "verified whole, in full batches too (on 2 cores the adaptive policy drafts next to nothing at "
                        "8-way concurrency); 0: the default adaptive policy")
    p.add_argument("--api-key", default=None, help="serve with this API key (PARROT_API_KEY) and send it with every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args(argv)
    if args.url and not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error("--url must be a loopback address: the soak only drives a server on this machine")

    process, log = None, args.out.with_suffix(".server.log")
    url = args.url.rstrip("/") if args.url else f"http://127.0.0.1:{args.port}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.url is None:
        process = start_server(args.port, args.server_timeout, args.fixed_drafts, log, args.api_key)
    pid = process.pid if process else (args.pid or listening_pid(int(url.rsplit(":", 1)[1].split("/")[0])))
    started = time.strftime("%Y-%m-%d %H:%M")
    wall = time.monotonic()
    exit_status = None
    try:
        result = asyncio.run(run(args, url, pid, process))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)  # drains; nothing is in flight any more
            try:
                exit_status = process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
    result.update(date=started, wall_s=time.monotonic() - wall, machine=machine(), server_exit=exit_status,
                  server_log_problems=log_problems(log) if process else None,
                  settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    result["summary"] = summarize(result)
    markdown = render(result)
    args.out.write_text(dump(result))
    args.out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}", file=sys.stderr)
    return 0 if all(result["summary"]["goals"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

