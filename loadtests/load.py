"""HTTP load generator for a running Parrot server (or any OpenAI-compatible one).

    python -m loadtests.load --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --compare

An asyncio + httpx client sends chat (or completion) requests built from the evaluation prompts
in ``../shared/data`` (``--mix`` chooses tasks and weights) to the one server named by ``--url``
(loopback by default), streaming or not, in one of two modes:

- closed loop, ``--concurrency N``: N clients, each sending its next request when the last one
  is answered (a list ``1,2,4,8`` sweeps the levels one after the other);
- open loop, ``--rate R``: requests arrive as a Poisson process of R per second, whatever the
  server's state (a list sweeps too).

Each run stops issuing requests after ``--requests`` requests or ``--duration`` seconds, whichever
comes first, and waits for those in flight. ``--compare`` runs every level twice, speculation on
then off (the request's ``speculation: {"enabled": ...}`` field), with the same prompts in the
same order. Every request is recorded (TTFT, inter-chunk latencies, e2e, tokens in and out,
``usage.speculation``, HTTP status); errors and timeouts are counted, never dropped.

Writes ``<out>/<name>.json`` (every request), ``<name>.md`` (the tables), ``<name>_cdf.png``
(latency CDFs) and, for a sweep, ``<name>_sweep.png`` (throughput and TTFT against the level);
prints the tables on stdout and progress on stderr. Metric definitions: ``load_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.load_report import compare_table, failures, plot_cdfs, plot_sweep, summarize, table
from loadtests.load_workload import DATA, Prompt, Workload

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Record:
    """One request as the client saw it (times in seconds; ``start_s`` from the run's start)."""

    index: int
    task: str
    prompt_id: str
    start_s: float
    status: str = "ok"  # ok | error | timeout
    http_status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    e2e_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    speculation: dict[str, int] | None = None


@dataclass
class Settings:
    url: str
    endpoint: str
    stream: bool
    max_tokens: int
    temperature: float
    ignore_eos: bool
    model: str | None
    timeout_s: float
    requests: int | None
    duration_s: float | None
    seed: int


def request_body(settings: Settings, prompt: Prompt, speculation: bool | None, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": settings.max_tokens, "temperature": settings.temperature, "stream": settings.stream}
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if settings.stream:
        body["stream_options"] = {"include_usage": True}
    if settings.model:
        body["model"] = settings.model
    if settings.temperature > 0:
        body["seed"] = settings.seed + index
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if speculation is not None:
        body["speculation"] = {"enabled": speculation}
    # A scope of its own per request: the same prompts run once per setting and level, and the
    # prefix cache would serve the later runs' prompts from the earlier ones'.
    body["cache_salt"] = f"load-{uuid.uuid4().hex}"
    return body


def _text_of(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _take_usage(record: Record, usage: dict[str, Any]) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    record.speculation = usage.get("speculation")


async def send(client: httpx.AsyncClient, settings: Settings, prompt: Prompt, index: int, speculation: bool | None,
               run_start: float) -> Record:
    """Send one request and record it; never raises (failures become the record's status)."""
    path = "/v1/chat/completions" if settings.endpoint == "chat" else "/v1/completions"
    body = request_body(settings, prompt, speculation, index)
    sent = time.perf_counter()
    record = Record(index=index, task=prompt.task, prompt_id=prompt.id, start_s=sent - run_start)
    try:
        await asyncio.wait_for(_exchange(client, path, body, record, sent), settings.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.status, record.error = "timeout", f"no complete answer within {settings.timeout_s:g} s"
    except httpx.HTTPError as exc:
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError) as exc:  # a body that is not the OpenAI shape
        record.status, record.error = "error", f"bad response: {type(exc).__name__}: {exc}"
    record.e2e_s = time.perf_counter() - sent
    if record.status == "ok" and record.ttft_s is not None and (record.completion_tokens or 0) > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)  # type: ignore[operator]
    return record


async def _exchange(client: httpx.AsyncClient, path: str, body: dict[str, Any], record: Record, sent: float) -> None:
    if not body["stream"]:
        r = await client.post(path, json=body)
        record.http_status = r.status_code
        if r.status_code != 200:
            record.status, record.error = "error", _error_message(r.text)
            return
        data = r.json()
        _take_usage(record, data.get("usage") or {})
        record.finish_reason = data["choices"][0].get("finish_reason") if data.get("choices") else None
        return
    async with client.stream("POST", path, json=body) as r:
        record.http_status = r.status_code
        if r.status_code != 200:
            record.status, record.error = "error", _error_message((await r.aread()).decode("utf-8", "replace"))
            return
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:  # an error after the stream started
                record.status, record.error = "error", chunk["error"].get("message", "error event")
                continue
            if chunk.get("usage"):
                _take_usage(record, chunk["usage"])
            for choice in chunk.get("choices") or []:
                if _text_of(choice):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.chunks += 1
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


class Progress:
    """One line on stderr per finished request."""

    def __init__(self, label: str, total: int | None) -> None:
        self.label, self.total = label, total
        self.done = self.errors = self.timeouts = 0
        self.start = time.perf_counter()

    def update(self, record: Record) -> None:
        self.done += 1
        self.errors += record.status == "error"
        self.timeouts += record.status == "timeout"
        of = f"/{self.total}" if self.total else ""
        note = "" if record.status == "ok" else f"  last: {record.status} {record.http_status or ''} {record.error or ''}"[:160]
        print(f"[load] {self.label}: {self.done}{of} done, {self.errors} errors, {self.timeouts} timeouts, "
              f"{time.perf_counter() - self.start:.1f} s{note}", file=sys.stderr, flush=True)


async def run_closed(client: httpx.AsyncClient, settings: Settings, workload: Workload, concurrency: int,
                     speculation: bool | None, progress: Progress) -> tuple[list[Record], float]:
    """N clients in a loop; none starts a request after the count or the duration is reached."""
    records: list[Record] = []
    issued = 0
    start = time.perf_counter()

    def next_index() -> int | None:
        nonlocal issued
        if settings.requests is not None and issued >= settings.requests:
            return None
        if settings.duration_s is not None and time.perf_counter() - start >= settings.duration_s:
            return None
        issued += 1
        return issued - 1

    async def client_loop() -> None:
        while (index := next_index()) is not None:
            record = await send(client, settings, workload.prompt(index), index, speculation, start)
            records.append(record)
            progress.update(record)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - start


async def run_open(client: httpx.AsyncClient, settings: Settings, workload: Workload, rate: float,
                   speculation: bool | None, progress: Progress) -> tuple[list[Record], float]:
    """Poisson arrivals at ``rate`` per second (exponential gaps from a seeded generator)."""
    records: list[Record] = []
    rng = random.Random(settings.seed)
    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    at, index = 0.0, 0

    async def one(i: int) -> None:
        record = await send(client, settings, workload.prompt(i), i, speculation, start)
        records.append(record)
        progress.update(record)

    while (settings.requests is None or index < settings.requests) and (settings.duration_s is None or at < settings.duration_s):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
        index += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index), time.perf_counter() - start


async def wait_ready(client: httpx.AsyncClient, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        try:
            r = await client.get("/health", timeout=5)
            if r.status_code == 200:
                return dict(r.json())
            state = r.json().get("status", r.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            state = type(exc).__name__
        if time.monotonic() >= deadline:
            raise SystemExit(f"[load] the server at {client.base_url} is not ready ({state}) after {seconds:g} s")
        print(f"[load] waiting for {client.base_url}/health ({state})", file=sys.stderr, flush=True)
        await asyncio.sleep(2)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _levels(text: str, kind: type) -> list[Any]:
    values = [kind(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (the only host this talks to)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--mix", default="all", help="tasks and weights: 'all', 'grammar,summarization' or 'summarization=2,open_chat=1'")
    p.add_argument("--data", type=Path, default=DATA, help="folder of <task>.jsonl prompt files")
    p.add_argument("--max-prompt-chars", type=int, default=None, help="use only prompts up to this length")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=lambda t: _levels(t, int), default=None, help="closed loop: clients, or a sweep 1,2,4,8 (default 1)")
    mode.add_argument("--rate", type=lambda t: _levels(t, float), default=None, help="open loop: Poisson arrivals per second, or a sweep")
    p.add_argument("--requests", type=int, default=20, help="requests per run at most (0: no limit)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per run at most to start requests (0: no limit)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests (no TTFT/ITL)")
    p.add_argument("--speculation", choices=("server", "on", "off"), default="server", help="the per-request speculation field")
    p.add_argument("--compare", action="store_true", help="run every level with speculation on, then off")
    p.add_argument("--model", default=None, help="the 'model' field (default: none, the server's model)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as a timeout")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the first run")
    p.add_argument("--wait-ready", type=float, default=300.0, help="seconds to wait for /health to turn 200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    p.add_argument("--name", default="load", help="file name stem of the results")
    return p


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings(url=args.url.rstrip("/"), endpoint=args.endpoint, stream=args.stream, max_tokens=args.max_tokens,
                        temperature=args.temperature, ignore_eos=args.ignore_eos, model=args.model, timeout_s=args.timeout,
                        requests=args.requests or None, duration_s=args.duration or None, seed=args.seed)
    if settings.requests is None and settings.duration_s is None:
        raise SystemExit("[load] give --requests or --duration (or both): a run must end")
    workload = Workload.from_args(args.data, args.mix, args.seed, args.max_prompt_chars)
    open_loop = args.rate is not None
    levels: list[float] = args.rate if open_loop else (args.concurrency or [1])
    settings_list: list[bool | None] = [True, False] if args.compare else [{"server": None, "on": True, "off": False}[args.speculation]]
    max_clients = int(max(levels)) if not open_loop else 1000
    limits = httpx.Limits(max_connections=max_clients + 4, max_keepalive_connections=max_clients + 4)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    runs: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=settings.url, limits=limits, timeout=timeout) as client:
        health = await wait_ready(client, args.wait_ready)
        for i in range(args.warmup):
            record = await send(client, settings, workload.prompt(-1 - i), -1 - i, None, time.perf_counter())
            print(f"[load] warm-up {i + 1}/{args.warmup}: {record.status} in {record.e2e_s:.1f} s", file=sys.stderr, flush=True)
        started = datetime.datetime.now(datetime.timezone.utc)
        for level in levels:
            for speculation in settings_list:
                spec_label = "server default" if speculation is None else ("on" if speculation else "off")
                load_label = f"{level:g} req/s" if open_loop else f"c={int(level)}"
                label = f"{load_label}, speculation {spec_label}"
                load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                progress = Progress(label, settings.requests)
                if open_loop:
                    records, wall = await run_open(client, settings, workload, float(level), speculation, progress)
                else:
                    records, wall = await run_closed(client, settings, workload, int(level), speculation, progress)
                run = {"load_label": load_label, "level": level, "mode": "open" if open_loop else "closed",
                       "speculation": speculation, "speculation_label": spec_label, "wall_s": wall,
                       "loadavg_before": load_before, "requests": [asdict(r) for r in records]}
                run["summary"] = summarize(run)
                runs.append(run)
    return {
        "meta": {
            "date": started.isoformat(timespec="seconds"),
            "url": settings.url,
            "model": health.get("model"),
            "machine": machine(),
            "settings": asdict(settings) | {"mix": args.mix, "mode": "open" if open_loop else "closed",
                                            "levels": levels, "compare": args.compare, "warmup": args.warmup},
        },
        "runs": runs,
    }


def write_results(result: dict[str, Any], out: Path, name: str) -> str:
    """Write JSON, markdown and plots; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    meta, runs = result["meta"], result["runs"]
    s = meta["settings"]
    title = (f"Parrot load test {meta['date'][:10]}, {meta['model']}, {s['mode']} loop, max_tokens {s['max_tokens']}, "
             f"mix {s['mix']}\n{meta['machine']}")
    md = [f"Load test {meta['date']} against {meta['url']} ({meta['model']}), {s['mode']} loop, "
          f"{'streaming' if s['stream'] else 'non-streaming'} {s['endpoint']}, max_tokens {s['max_tokens']}, "
          f"temperature {s['temperature']:g}, mix {s['mix']}, at most {s['requests']} requests / {s['duration_s']} s per run.",
          f"Machine: {meta['machine']}.", "", table(runs)]
    failed = failures(runs)
    if failed:
        md += ["", "Failed requests:", failed]
    comparison = compare_table(runs)
    if comparison:
        md += ["", comparison]
    text = "\n".join(md) + "\n"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    plot_cdfs(runs, str(out / f"{name}_cdf.png"), title)
    if len({r["level"] for r in runs}) > 1:
        plot_sweep(runs, str(out / f"{name}_sweep.png"), title,
                   "offered rate (requests/s)" if s["mode"] == "open" else "concurrent clients")
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(main_async(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"[load] {exc}", file=sys.stderr)
        return 2
    text = write_results(result, args.out, args.name)
    print(text)
    print(f"[load] wrote {args.out / args.name}.json, .md and plots", file=sys.stderr)
    failed = sum(r["summary"]["errors"] + r["summary"]["timeouts"] for r in result["runs"])
    return 1 if failed and not any(r["summary"]["ok"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
