"""Servers the benchmarks run beside each other: Parrot's and llama.cpp's processes on loopback
ports, the environment llama.cpp's programs need, resident memory of a process, and streamed
OpenAI-style requests read event by event. Imported by the benchmarks; imports none of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import RESULTS


def peer_env() -> dict[str, str]:
    """The environment for llama.cpp's programs: this process's, less the OMP_WAIT_POLICY=PASSIVE
    that importing Parrot sets (llama.cpp's OpenMP threads then sleep at every barrier of a pass:
    measured, llama-bench's one-token pass took 40 ms instead of 15)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    return env


class Server:
    """A server subprocess on a loopback port, ready once its /health answers 200."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.name, self.port, self.command = name, port, command
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log or RESULTS / f"bench_peers_{name}.log", "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def logged_baseline(server: Server) -> int | None:
    """The resident memory the server logged before loading its model (Python, torch and its own
    modules): the memory rule's baseline (bytes; None if the log does not say)."""
    with open(server.log.name) as f:
        found = re.search(r"resident memory \d+ MB \((\d+) MB before loading", f.read())
    return int(found.group(1)) * 2**20 if found else None


def cost_curves(server: Server) -> dict[str, dict[int, float]]:
    """The Parrot server's drafting cost curve (ms by tokens of a pass): as measured at start-up
    (its log) and as it stands now (``parrot_pass_cost_seconds`` in /metrics, kept current from
    the passes served; 1, 2, 4, 8, 16 and 17 tokens)."""
    curves: dict[str, dict[int, float]] = {}
    with open(server.log.name) as f:
        found = re.search(r"forward cost for 1\.\.\d+ tokens \(ms\): ([\d ]+)", f.read())
    if found:
        curves["start_up"] = {t: float(ms) for t, ms in enumerate(found.group(1).split(), 1)}
    now = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        metric = re.match(r'parrot_pass_cost_seconds\{tokens="(\d+)"\} (\S+)', line)
        if metric:
            now[int(metric.group(1))] = float(metric.group(2)) * 1e3
    if now:
        curves["end"] = now
    return curves


def resident(pid: int) -> int:
    """Resident memory (VmRSS) of process ``pid``, bytes; 0 where /proc is not there."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def sse_events(url: str, body: dict[str, Any], timeout: float = 600) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI-style request (``url`` is the endpoint's)."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def stream_chat(url: str, prompt: str, max_tokens: int, extra: dict[str, Any], completion: bool = False) -> dict[str, Any]:
    """One greedy streamed chat completion: token count, TTFT, decode and end-to-end times
    (``completion``: a plain completion of the prompt, for a model without a chat template)."""
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra,
            **({"prompt": prompt} if completion else {"messages": [{"role": "user", "content": prompt}]})}
    start = time.perf_counter()
    first = last = None
    chunks, text, usage = 0, [], None
    for event in sse_events(url + ("/v1/completions" if completion else "/v1/chat/completions"), body):
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            piece = choice.get("text") if completion else (choice.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                text.append(piece)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    first = first or end
    last = last or end
    return {"tokens": tokens, "ttft_s": first - start, "decode_s": last - first, "total_s": end - start,
            "text": "".join(text), "speculation": (usage or {}).get("speculation", {})}
