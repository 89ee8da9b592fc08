"""``make fuzz``: schemathesis against a running Parrot, with bounded generation.

    python -m loadtests.fuzz [--url URL] [--max-examples 25] [--phases examples,coverage,fuzzing]
                             [--max-tokens 32] [--seed S]

Without ``--url`` it starts ``parrot serve`` (the embedded model) on a loopback port with
``server.max_completion_tokens`` = ``--max-tokens``: the OpenAPI schema then gives every completion
budget that maximum (and a request that sets none gets at most that many), so every generated
request ends. Runs schemathesis (``st run``) over ``/openapi.json``, valid and invalid requests
(``--mode all``) with its ``not_a_server_error`` check: any 5xx fails the run, and so does a
request that takes longer than ``--request-timeout`` (a hang). Then it stops the server with
SIGTERM (which drains) and checks that it exits with status 0. Prints schemathesis's report and a
summary; writes schemathesis's JSON run report to loadtests/results/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def schemathesis_command() -> list[str]:
    """The ``st`` command of the environment running this (``make install`` puts it in .venv/bin)."""
    beside = Path(sys.executable).parent / "st"
    found = str(beside) if beside.exists() else shutil.which("st")
    if found is None:
        raise RuntimeError("schemathesis is not installed (it is a test dependency: make install)")
    return [found]


def run_schemathesis(url: str, report: Path, *, max_examples: int, phases: str, request_timeout: float,
                     seed: int | None = None, workers: int = 1, timeout: float | None = None,
                     quiet: bool = False) -> dict[str, Any]:
    """Run ``st run`` against ``url`` and return its JSON run report (``exit_code``, ``test_cases``,
    ``failures``, ...). ``timeout``: seconds for the whole run, after which it counts as a hang."""
    command = schemathesis_command() + [
        "run", url + "/openapi.json", "--checks", "not_a_server_error", "--mode", "all",
        "--max-examples", str(max_examples), "--phases", phases, "--request-timeout", str(request_timeout),
        "--workers", str(workers), "--generation-database", "none", "--no-color",
        "--report", "json", "--report-json-path", str(report),
    ] + (["--seed", str(seed)] if seed is not None else [])
    output = subprocess.run(command, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT,
                            text=True, timeout=timeout, check=False)
    if not report.exists():
        raise RuntimeError(f"schemathesis wrote no report (exit {output.returncode}): {output.stdout or ''}")
    result: dict[str, Any] = json.loads(report.read_text())
    if quiet:
        result["output"] = output.stdout
    return result


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"parrot serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"parrot serve not ready after {timeout} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (its max_completion_tokens bounds the run)")
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--max-tokens", type=int, default=32, help="server.max_completion_tokens of the server started")
    parser.add_argument("--max-examples", type=int, default=25, help="test cases per operation and phase")
    parser.add_argument("--phases", default="examples,coverage,fuzzing")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as a hang")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = parser.parse_args(argv)

    process = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        env = {**os.environ, "PARROT_SERVER_MAX_COMPLETION_TOKENS": str(args.max_tokens),
               "PARROT_SERVER_REQUEST_TIMEOUT_S": str(args.request_timeout)}
        process = subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(args.port)], env=env)
        _wait_healthy(url, process)
    start = time.monotonic()
    try:
        report = run_schemathesis(url, Path(args.out), max_examples=args.max_examples, phases=args.phases,
                                  request_timeout=args.request_timeout, seed=args.seed)
    finally:
        exit_status = None
        if process is not None:
            process.send_signal(signal.SIGTERM)  # drains: nothing is in flight any more
            try:
                exit_status = process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    cases = report["test_cases"]
    print(f"\nfuzz: {cases['generated']} requests over {report['operations']['tested']} operations in "
          f"{time.monotonic() - start:.0f} s; failures: {len(report['failures'])}, errors: {len(report['errors'])}; "
          f"schemathesis exit {report['exit_code']}"
          + (f"; server exit after SIGTERM: {exit_status}" if process is not None else ""))
    print(f"wrote {args.out}")
    server_ok = process is None or exit_status == 0
    return 0 if report["exit_code"] == 0 and server_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
