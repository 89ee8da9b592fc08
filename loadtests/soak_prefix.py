"""``make soak-prefix``: random multi-turn conversations from 8 clients against a prefix cache
smaller than what they send, every answer checked against a server without the cache.

    python -m loadtests.soak_prefix [--conversations 300] [--clients 8] [--budget 48M]

It starts two ``parrot serve`` processes on the embedded model on loopback ports: one with the
prefix cache at ``--budget`` (smaller than the conversations' KV together, so blocks are evicted
all along), one with ``--prefix-cache-bytes 0``. Each conversation has a tenant (one of three API
keys), one of a few system prompts (conversations of a tenant share its blocks), a first message
from ../shared/data, and 2-4 turns of follow-up questions, each turn carrying the history with
the cached server's answers; greedy or seeded sampling, streamed or not. Every turn goes to both
servers and the answers must be equal (text, finish reason, tokens). A monitor reads the cached
server's resident memory every 0.2 s.

Goals (exit status 0 when all hold): every request answered 200 on both servers; every answer
equal; hits counted (the cache was used) and blocks evicted (the budget was binding); resident
memory at most its level after the warm-up, less the cache's bytes then, plus the budget and the
running requests' KV caches (``server.max_running`` caches of the longest request). Prints a table
and writes loadtests/results/soak_prefix.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import DATA, RESULTS
from loadtests.peers import Server, resident

SYSTEMS = [
    "You are a helpful assistant. Answer briefly.",
    "You are a careful editor. Keep answers short and plain.",
    "You are a research assistant who answers from the given text only.",
]
FOLLOW_UPS = ["Say that again in fewer words.", "Why?", "Give one example.", "What is the key point?",
              "Answer in one word.", "Explain it to a child.", "Is that certain?"]
KEYS = ["tenant-a", "tenant-b", "tenant-c"]


def plan(count: int, seed: int, max_chars: int) -> list[dict[str, Any]]:
    """``count`` conversations, each a tenant, a system prompt, a first message and its turns."""
    rng = random.Random(seed)
    prompts = []
    for task in ("grammar", "summarization", "context_qa", "open_chat", "code_edit"):
        with open(DATA / f"{task}.jsonl") as f:
            prompts += [json.loads(line)["prompt"][:max_chars] for line in f]
    convs = []
    for i in range(count):
        sampled = rng.random() < 0.3
        convs.append({
            "id": i, "key": rng.choice(KEYS), "system": rng.choice(SYSTEMS), "first": rng.choice(prompts),
            "turns": rng.randint(2, 4), "max_tokens": rng.choice((12, 16, 24)), "stream": rng.random() < 0.5,
            "sampling": {"temperature": 0.8, "seed": rng.randint(0, 999)} if sampled else {"temperature": 0},
            "follow_ups": [rng.choice(FOLLOW_UPS) for _ in range(4)],
        })
    return convs


async def ask(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat request: status, text, finish reason, completion and cached tokens."""
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.text[:200]}
        data = r.json()
        return {"status": 200, "text": data["choices"][0]["message"]["content"],
                "finish": data["choices"][0]["finish_reason"], "tokens": data["usage"]["completion_tokens"],
                "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"]}
    text, finish, usage = [], None, {}
    body = {**body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread())[:200].decode(errors="replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": 200, "error": str(event["error"])[:200]}
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return {"status": 200, "text": "".join(text), "finish": finish, "tokens": usage.get("completion_tokens"),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def run(cached_url: str, reference_url: str, conversations: list[dict[str, Any]], clients: int,
              reference_salt: bool = False, timeout: float = 300) -> list[dict[str, Any]]:
    """Every conversation, ``clients`` at a time; one record per turn. ``reference_salt``: the
    reference server is the cached one, asked with a fresh ``cache_salt`` (nothing reused)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    records: list[dict[str, Any]] = []

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=timeout) as client:
            while not queue.empty():
                conv = queue.get_nowait()
                messages = [{"role": "system", "content": conv["system"]}, {"role": "user", "content": conv["first"]}]
                for turn in range(conv["turns"]):
                    body = {"messages": list(messages), "max_tokens": conv["max_tokens"], "stream": conv["stream"],
                            **conv["sampling"]}
                    got = await ask(client, cached_url, conv["key"], body)
                    reference_body = {**body, "cache_salt": uuid.uuid4().hex} if reference_salt else body
                    want = await ask(client, reference_url, conv["key"], reference_body)
                    same = all(got.get(f) == want.get(f) for f in ("text", "finish", "tokens"))
                    records.append({"conversation": conv["id"], "turn": turn + 1, "got": got, "want": want,
                                    "equal": same and got["status"] == 200 and "error" not in got})
                    if got.get("status") != 200 or "error" in got:
                        break
                    messages += [{"role": "assistant", "content": got["text"]},
                                 {"role": "user", "content": conv["follow_ups"][turn]}]

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r for r in records if r["got"].get("status") != 200 or "error" in r["got"]
              or r["want"].get("status") != 200 or "error" in r["want"]]
    return {"requests": len(records), "errors": len(errors), "unequal": sum(not r["equal"] for r in records),
            "cached_tokens": sum(r["got"].get("cached") or 0 for r in records),
            "turns_with_hits": sum((r["got"].get("cached") or 0) > 0 for r in records),
            "examples": [r for r in records if not r["equal"]][:3]}


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("parrot:prefix")}


def _parse_size(text: str) -> int:
    from parrot.cli import byte_size
    return byte_size(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--budget", type=_parse_size, default=48 << 20, help="the cached server's prefix cache (48M)")
    parser.add_argument("--max-chars", type=int, default=1500, help="first messages cut to this many characters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--out", default=str(RESULTS / "soak_prefix.json"))
    args = parser.parse_args(argv)

    from parrot.engine.kernels import cpu_description

    convs = plan(args.conversations, args.seed, args.max_chars)
    command = [sys.executable, "-m", "parrot.cli", "serve"]
    cached = Server("cached", command + ["--port", str(args.port), "--prefix-cache-bytes", str(args.budget)], args.port,
                    log=RESULTS / "soak_prefix_cached.log")
    plain = Server("plain", command + ["--port", str(args.port + 1), "--prefix-cache-bytes", "0"], args.port + 1,
                   log=RESULTS / "soak_prefix_plain.log")
    samples: list[int] = []
    stop = threading.Event()
    try:
        cached.wait()
        plain.wait()
        # Warm-up: torch's code for every kind of request paged in before the baseline is read.
        asyncio.run(run(cached.url, plain.url, plan(8, args.seed + 1, args.max_chars), 8))
        warm_metrics = _metrics(cached.url)
        baseline = resident(cached.process.pid)

        def monitor() -> None:
            while not stop.wait(0.2):
                samples.append(resident(cached.process.pid))

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        started = time.perf_counter()
        records = asyncio.run(run(cached.url, plain.url, convs, args.clients))
        elapsed = time.perf_counter() - started
        stop.set()
        metrics = _metrics(cached.url)
    finally:
        stop.set()
        cached.stop()
        plain.stop()
    summary = summarize(records)
    # The running requests' KV caches: max_running of them, each as long as the longest request.
    from parrot.config import load_config

    max_running = load_config().server.max_running
    bytes_per_position = 30 * 2 * 3 * 64 * 2  # the embedded model: layers x k/v x kv heads x head dim x fp16
    longest = 2048  # positions: a request here stays well under (1,500 characters, 4 turns of 24 tokens)
    allowed = baseline - warm_metrics.get("parrot:prefix_cache_bytes", 0) + args.budget + \
        max_running * longest * bytes_per_position
    peak = max(samples) if samples else 0
    goals = {
        "0 errors": summary["errors"] == 0,
        "every answer equal to the cache-off server's": summary["unequal"] == 0,
        "the cache was used (hits)": summary["turns_with_hits"] > 0,
        "the budget was binding (evictions)": metrics.get("parrot:prefix_cache_evicted_blocks", 0) > 0,
        "resident memory within budget + running caches": peak <= allowed,
    }
    result = {"cpu": cpu_description(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args) | {"out": args.out},
              "elapsed_s": elapsed, "summary": summary, "metrics": metrics, "goals": goals,
              "memory": {"baseline": baseline, "peak": peak, "allowed": allowed, "budget": args.budget,
                         "cache_bytes_after_warmup": warm_metrics.get("parrot:prefix_cache_bytes", 0)},
              "records": records}
    mib = 2 ** 20
    print(f"{summary['requests']} requests in {elapsed:.0f} s from {args.clients} clients "
          f"({args.conversations} conversations); {summary['errors']} errors, {summary['unequal']} unequal answers")
    print(f"cached tokens {summary['cached_tokens']} over {summary['turns_with_hits']} turns; cache "
          f"{metrics.get('parrot:prefix_cache_bytes', 0) / mib:.1f} MiB held of {args.budget / mib:.0f}, "
          f"{metrics.get('parrot:prefix_cache_evicted_blocks', 0):.0f} blocks evicted")
    print(f"resident memory: {baseline / mib:.0f} MiB after warm-up, peak {peak / mib:.0f} MiB, "
          f"allowed {allowed / mib:.0f} MiB")
    print("| goal | met |\n|---|---|\n" + "\n".join(f"| {g} | {'yes' if ok else 'NO'} |" for g, ok in goals.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
