"""Faults survived, on real uvicorn servers running the tiny deterministic model (each forward pass
slowed down a little, so that requests stay in flight while the test acts): an exception in an
engine step, a fault of the engine loop, clients that leave, SIGTERM, and no exception left for
asyncio to report as never retrieved."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from parrot.config import DraftingConfig
from tests.conftest import free_port, start_server
from tests.tiny import SlowForward, tiny_engine

ROOT = Path(__file__).resolve().parents[1]
POISON = "poison"  # a request whose prompt holds this fails in the engine step (see _faulty)


def _tiny_server(delay_s: float = 0.01, **settings):
    engine = tiny_engine("native", DraftingConfig(adaptive=False, max_draft=8))
    engine.forward = SlowForward(engine.forward, delay_s)
    return engine, start_server(engine, loaded_name="tiny", **settings)


def _faulty(engine, after_tokens: int = 4) -> None:
    """Make ``engine.step`` raise once a poisoned request has ``after_tokens`` output tokens."""
    poison = engine.tokenizer.encode(POISON)
    step = engine.step

    def faulty_step(sequences):
        for seq in sequences:
            if seq.request.prompt_ids[-len(poison):] == poison and len(seq.output_ids) >= after_tokens:
                raise RuntimeError("injected fault")
        return step(sequences)

    engine.step = faulty_step


def _body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "speculation": {"enabled": False}, **extra}


def _stream(url: str, body: dict, lines: list[str], first: threading.Event | None = None) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if first is not None:
                    first.set()


def _wait(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_an_engine_step_exception_fails_only_its_requests_and_the_server_keeps_serving():
    engine, server = _tiny_server(max_running=1)
    _faulty(engine)
    scheduler = server.app.state.parrot.scheduler
    try:
        # A poisoned stream runs alone (max_running 1) while a healthy request waits its turn.
        lines: list[str] = []
        started = threading.Event()
        streaming = threading.Thread(target=_stream, args=(server.url, _body("abc " + POISON, 40), lines, started))
        streaming.start()
        assert started.wait(30)
        waiting = httpx.post(server.url + "/v1/completions", json=_body("abcabc", 12), timeout=60)
        streaming.join(30)
        # The stream got its first tokens, then an error event in OpenAI's shape, then [DONE].
        payloads = [json.loads(line[6:]) for line in lines[:-1]]
        assert lines[-1] == "data: [DONE]"
        assert "choices" in payloads[0]
        error = payloads[-1]["error"]
        assert error["type"] == "server_error" and error["message"] == "internal error while generating: RuntimeError"
        # The request that was waiting, not in the failing step, ran to the end.
        assert waiting.status_code == 200, waiting.text
        assert waiting.json()["usage"]["completion_tokens"] == 12
        # Not streamed, the poisoned request is a 500 in OpenAI's shape; the server goes on serving.
        failed = httpx.post(server.url + "/v1/completions", json=_body("x " + POISON, 40), timeout=60)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        after = httpx.post(server.url + "/v1/completions", json=_body("abc", 8), timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
        assert _wait(lambda: scheduler.running == 0 and scheduler.waiting == 0)
    finally:
        server.stop()


def test_a_fault_of_the_engine_loop_fails_requests_at_once_and_health_says_so():
    engine, server = _tiny_server()
    scheduler = server.app.state.parrot.scheduler
    try:
        def broken() -> None:
            raise RuntimeError("a bug in the loop")

        scheduler._drop_cancelled = broken  # runs on every turn of the loop, outside Engine.step
        r = httpx.post(server.url + "/v1/completions", json=_body("abc", 8), timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error in the engine loop: RuntimeError"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "error",
                                 "error": "the engine has stopped: internal error in the engine loop: RuntimeError"}
        refused = httpx.post(server.url + "/v1/completions", json=_body("abc", 8), timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(server.url + "/v1/stats").json()["status"] == "error"
    finally:
        server.stop()


def _running_generation(scheduler):
    """The one generation the engine runs, once there is one (the engine thread's object)."""
    assert _wait(lambda: len(scheduler._running) == 1 and scheduler._running[0][1].cache is not None)
    return scheduler._running[0][1]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_mid_generation_frees_its_kv_cache(stream):
    engine, server = _tiny_server(delay_s=0.02)
    scheduler = server.app.state.parrot.scheduler
    body = _body("abcabc", 400)
    try:
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        break  # leave after the first chunk
                generation = _running_generation(scheduler)
                cache = weakref.ref(generation.cache)
        else:
            seen: list = []

            def watch() -> None:
                running = _running_generation(scheduler)
                seen.extend([running, weakref.ref(running.cache)])

            watching = threading.Thread(target=watch)
            watching.start()
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
                httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
            watching.join()
            generation, cache = seen
        assert _wait(lambda: scheduler.running == 0), "the generation was not dropped"
        assert generation.finish_reason == "cancelled" and generation.cache is None
        assert len(generation.output_ids) < 400
        gc.collect()
        assert cache() is None, "the KV cache is still referenced"
    finally:
        server.stop()


def test_cancelled_requests_leave_no_unretrieved_exception_for_asyncio_to_log(caplog):
    engine, server = _tiny_server(delay_s=0.02, request_timeout_s=0.3)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            # A timeout (504) and a client that leaves, each with n = 2 choices drained together.
            timed_out = httpx.post(server.url + "/v1/completions", json=_body("abc", 300, n=2), timeout=30)
            assert timed_out.status_code == 504
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json=_body("abc", 300, n=2), timeout=0.2)
            scheduler = server.app.state.parrot.scheduler
            assert _wait(lambda: scheduler.running == 0)
            time.sleep(0.5)  # the handlers finish after the engine dropped their requests
            gc.collect()
        lost = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
        assert not lost, lost
    finally:
        server.stop()


def test_drain_timeout_ends_the_requests_still_running_with_an_error_event():
    engine, server = _tiny_server(delay_s=0.02, drain_timeout_s=0.5)
    lines: list[str] = []
    started = threading.Event()
    streaming = threading.Thread(target=_stream, args=(server.url, _body("abc", 400), lines, started))
    streaming.start()
    assert started.wait(30)
    server.server.handle_exit(signal.SIGTERM, None)  # what the signal does (this server runs on a thread)
    streaming.join(30)
    server.thread.join(30)
    assert not server.thread.is_alive(), "the server did not exit"
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error"


def test_sigterm_drains_in_flight_requests_refuses_new_ones_then_exits():
    """A real server process: SIGTERM while a stream and a plain request run. /health and new
    requests get 503 at once; both requests run to the end; then the process exits with 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "tests.serve_tiny", "--port", str(port), "--delay", "0.02"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert _wait(lambda: _healthy(url), timeout=120), "the server did not start"
        lines: list[str] = []
        started = threading.Event()
        streaming = threading.Thread(target=_stream, args=(url, _body("abc", 150, stream_options={"include_usage": True}),
                                                           lines, started))
        streaming.start()
        plain: list[httpx.Response] = []
        posting = threading.Thread(target=lambda: plain.append(
            httpx.post(url + "/v1/completions", json=_body("abcabc", 100), timeout=60)))
        posting.start()
        assert started.wait(30)
        time.sleep(0.2)  # the plain request is in flight too
        process.send_signal(signal.SIGTERM)
        assert _wait(lambda: httpx.get(url + "/health").status_code == 503, timeout=10)
        assert httpx.get(url + "/health").json() == {"status": "draining"}
        refused = httpx.post(url + "/v1/completions", json=_body("abc", 4), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        streaming.join(60)
        posting.join(60)
        assert not streaming.is_alive() and not posting.is_alive()
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 150  # the whole stream
        assert plain[0].status_code == 200 and plain[0].json()["usage"]["completion_tokens"] == 100
        assert process.wait(timeout=30) == 0
        log = process.stdout.read() if process.stdout else ""
        assert "drained: no request in flight" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
