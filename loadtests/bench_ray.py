"""Throughput of Parrot on Ray Serve with 1 and 2 replicas, beside the single-process server.

    make bench-ray [BENCH_RAY_ARGS="--rounds 3 --max-tokens 64"]

Three systems on this machine, all up at once (an idle server waits on its queue and costs no
CPU), run in turns in rotating order for ``--rounds`` rounds so that neighbours' load spreads:
``parrot serve`` alone (``model.threads`` = every core), and one Ray Serve instance with two
applications: ``ray_1`` (1 replica on every core) and ``ray_2`` (2 replicas, the cores split
between them), both behind the session-affinity gateway (parrot/server/ray_app.py). The workload: 10
sessions (``user`` = the session), one closed-loop client each, 10 requests per session over
prompts from ../shared/data (two per task, greedy, streamed every other request). Per system:
requests/s, completion tokens/s, latency p50/p95, and the ratio to the single-process server.

On 2 cores two replicas cannot beat one: they split the same cores and memory bandwidth, and
each pass then reads the weights on one thread. What it takes to scale is replicas on cores (or
machines) of their own, which is what the Ray cluster is for.

Prints a table and writes loadtests/results/bench_ray.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import RESULTS, machine
from loadtests.bench_peers import TASKS, held_out_prompts
from loadtests.peers import Server

SESSIONS = 10
PER_SESSION = 10


def prompts(max_chars: int) -> list[str]:
    out = []
    for task in TASKS:
        rows = [r for r in held_out_prompts(task, 40) if len(r["prompt"]) <= max_chars]
        out += [r["prompt"] for r in rows[:2]]
    return out


def run_workload(url: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
    """10 sessions of 10 requests, one client per session; returns throughput and latencies."""
    latencies: list[float] = []
    tokens = 0
    replicas: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        nonlocal tokens
        with httpx.Client(timeout=600) as client:
            for k in range(PER_SESSION):
                body = {"messages": [{"role": "user", "content": texts[(s + k) % len(texts)]}],
                        "max_tokens": max_tokens, "temperature": 0, "user": f"session-{s}"}
                if k % 2:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                start = time.perf_counter()
                with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    raw = r.read().decode()
                elapsed = time.perf_counter() - start
                if r.status_code != 200:
                    with lock:
                        errors.append(f"{r.status_code} {raw[:200]}")
                    continue
                if body.get("stream"):
                    usage = [json.loads(line[6:]) for line in raw.splitlines()
                             if line.startswith("data: {") and '"usage": {' in line]
                    n = usage[-1]["usage"]["completion_tokens"]
                else:
                    n = json.loads(raw)["usage"]["completion_tokens"]
                with lock:
                    latencies.append(elapsed)
                    tokens += n
                    replica = r.headers.get("x-parrot-replica", "single")
                    replicas[replica] = replicas.get(replica, 0) + 1

    start = time.perf_counter()
    threads = [threading.Thread(target=session, args=(s,)) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "errors": errors, "wall_s": wall, "completion_tokens": tokens,
            "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None, "replicas": replicas}


def start_ray(port: int, cores: int) -> None:
    import ray
    from ray import serve

    from parrot.config import load_config
    from parrot.server.ray_app import build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=cores, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, replicas in (("ray_1", 1), ("ray_2", 2)):
        config = load_config(None, overrides={"model": {"threads": max(1, cores // replicas)}})
        print(f"[bench-ray] deploying {name}: {replicas} replica(s) of {config.model.threads} thread(s)", flush=True)
        serve.run(build_app(config, replicas=replicas), name=name, route_prefix=f"/{name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-chars", type=int, default=2500)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_ray.json")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    texts = prompts(args.max_prompt_chars)
    single_port, ray_port = 8771, 8772
    env = dict(os.environ, PARROT_MODEL_THREADS=str(cores))
    single = Server("single", [sys.executable, "-m", "parrot.cli", "serve", "--port", str(single_port)], single_port, env=env)
    try:
        start_ray(ray_port, cores)
        single.wait()
        urls = {"single": single.url, "ray_1": f"http://127.0.0.1:{ray_port}/ray_1",
                "ray_2": f"http://127.0.0.1:{ray_port}/ray_2"}
        for name, url in urls.items():  # warm-up: every prompt once, one client
            for text in texts:
                httpx.post(url + "/v1/chat/completions", timeout=600,
                           json={"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
        order = list(urls)
        for round_ in range(args.rounds):
            for name in order[round_ % 3:] + order[: round_ % 3]:
                result = run_workload(urls[name], texts, args.max_tokens)
                runs[name].append(result)
                print(f"[bench-ray] round {round_ + 1} {name}: {result['requests']} requests in {result['wall_s']:.1f} s, "
                      f"{result['tokens_per_s']:.1f} tokens/s, replicas {result['replicas']}, errors {len(result['errors'])}",
                      flush=True)
    finally:
        single.stop()
        try:
            from ray import serve

            serve.shutdown()
            import ray

            ray.shutdown()
        except Exception:
            pass
    summary = {}
    for name, results in runs.items():
        summary[name] = {key: statistics.median(r[key] for r in results)
                         for key in ("requests_per_s", "tokens_per_s", "p50_s", "p95_s")}
        summary[name]["errors"] = sum(len(r["errors"]) for r in results)
    base = summary["single"]["tokens_per_s"]
    lines = [f"# Ray Serve replicas, {time.strftime('%Y-%m-%d %H:%M')}: {machine()}",
             f"{SESSIONS} sessions x {PER_SESSION} requests, one client per session, max_tokens {args.max_tokens}, "
             f"{len(texts)} prompts from ../shared/data, greedy, every other request streamed; median of {args.rounds} rounds",
             "", "| system | requests/s | completion tokens/s | vs single process | latency p50 s | p95 s | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    labels = {"single": "parrot serve (one process)", "ray_1": "Ray Serve, 1 replica", "ray_2": "Ray Serve, 2 replicas"}
    for name, s in summary.items():
        lines.append(f"| {labels[name]} | {s['requests_per_s']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{s['tokens_per_s'] / base:.2f}x | {s['p50_s']:.2f} | {s['p95_s']:.2f} | {s['errors']} |")
    table = "\n".join(lines)
    print(table)
    args.out.write_text(json.dumps({"machine": machine(), "cpu_flags": _flags(), "max_tokens": args.max_tokens,
                                    "rounds": args.rounds, "summary": summary, "runs": runs, "table": table}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {args.out}")
    return 0


def _flags() -> list[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c")))
    return []


if __name__ == "__main__":
    sys.exit(main())
