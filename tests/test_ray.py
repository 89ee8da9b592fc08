"""Parrot on Ray Serve (parrot/server/ray_app.py), for real on loopback: a local Ray instance, two
replicas of the embedded model behind the gateway, 100 requests from 10 sessions, one replica
killed mid-run.

Properties: every request ends (none hangs) and, with the client retrying what failed cleanly
(a 503 ``replica_unavailable`` in OpenAI's shape, or a stream ending with that error event), all
100 are answered; before the kill each session's requests all land on one replica, and after it
none lands on the killed one; greedy answers are the same on every replica, streamed or not.
About 1.5 min, most of it starting Ray and loading the model twice.
"""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import ray  # the test extras install ray[serve]

from tests.conftest import free_port

SESSIONS = 10
PER_SESSION = 10
KILL_AFTER = 30  # answered requests before a replica is killed
PROMPTS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Correct the grammar: she go to school every days.",
    "Summarize: The meeting moved from Monday to Tuesday because the room was booked.",
]


@pytest.fixture(scope="module")
def ray_parrot():
    from ray import serve

    from parrot.config import load_config
    from parrot.server.ray_app import build_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = load_config(None, overrides={"model": {"source": "embedded", "threads": 1}})
        serve.run(build_app(config, replicas=2, num_cpus=1), name="parrot", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _until_the_gateway_routes_to_both(url)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _until_the_gateway_routes_to_both(url: str) -> None:
    """Requests with new session keys until both replicas have answered one: the gateway's router
    learns the replicas after serve.run returns, and a session key hashed while it knew only one
    would move once it learns the other (seen on a loaded machine)."""
    seen: set[str] = set()
    for i in range(40):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "user": f"warm-up-{i}"}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-parrot-replica"])
        if len(seen) == 2:
            return
        time.sleep(0.25)
    raise AssertionError(f"40 session keys all reached {seen}")


def _ask(url: str, session: int, k: int, log: list) -> dict:
    """One request of a session, retried (up to 5 attempts) when it failed cleanly."""
    prompt = PROMPTS[(session + k) % len(PROMPTS)]
    stream = k % 2 == 1
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
            "user": f"session-{session}", "stream": stream}
    for attempt in range(1, 6):
        failure = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            replica = r.headers.get("x-parrot-replica")
            resent = int(r.headers.get("x-parrot-resent", 0))
            raw = r.read().decode()
        if r.status_code == 200 and not stream:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        elif r.status_code == 200:
            events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            if errors:
                failure = ("stream_error", errors[0]["code"])
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if "choices" in c)
        else:
            error = json.loads(raw)["error"]  # OpenAI's shape, or this fails
            assert r.status_code == 503 and error["code"] == "replica_unavailable", (r.status_code, error)
            assert r.headers.get("retry-after") == "1"
            failure = (r.status_code, error["code"])
        log.append({"session": session, "k": k, "attempt": attempt, "replica": replica, "failure": failure,
                    "resent": resent, "time": time.monotonic()})
        if failure is None:
            return {"session": session, "k": k, "prompt": prompt, "stream": stream, "replica": replica,
                    "text": text, "attempts": attempt, "time": time.monotonic()}
        time.sleep(1)
    raise AssertionError(f"session {session} request {k} failed 5 times: {failure}")


def test_sessions_stick_to_replicas_and_survive_a_replica_killed_mid_run(ray_parrot):
    url = ray_parrot
    answers: list[dict] = []
    log: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        try:
            for k in range(PER_SESSION):
                answer = _ask(url, s, k, log)
                with lock:
                    answers.append(answer)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(s,), daemon=True) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while len(answers) < KILL_AFTER and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    assert not errors, errors
    with lock:
        before = list(answers)
    victim = next(a["replica"] for a in before if a["session"] == 0)
    killed_at = time.monotonic()
    _kill_replica(victim)
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not errors, errors

    assert len(answers) == SESSIONS * PER_SESSION  # every request answered, some after a retry
    # Greedy: one answer per prompt, whichever replica gave it, streamed or not.
    by_prompt: dict[str, set[str]] = {}
    for a in answers:
        by_prompt.setdefault(a["prompt"], set()).add(a["text"])
    assert all(len(texts) == 1 and next(iter(texts)) for texts in by_prompt.values()), by_prompt
    # Affinity: before the kill, each session on one replica.
    for s in range(SESSIONS):
        replicas = {a["replica"] for a in before if a["session"] == s}
        assert len(replicas) <= 1, (s, replicas)
    moved = {a["session"] for a in before if a["replica"] == victim}
    assert 0 in moved
    after = [entry for entry in log if entry["time"] > killed_at + 0.5 and entry["failure"] is None]
    assert after and all(entry["replica"] != victim for entry in after)
    assert any(entry["session"] in moved for entry in after)  # the victim's sessions are served elsewhere
    failures = [entry for entry in log if entry["failure"] is not None]
    print(f"\n{len(answers)} answers, {len(before)} before the kill; replicas before: "
          f"{sorted({a['replica'] for a in before})}, killed {victim} (sessions {sorted(moved)}); "
          f"resent by the gateway: {sum(e['resent'] for e in log)}; "
          f"clean failures retried by the client: {len(failures)} {[e['failure'] for e in failures]}")


def _kill_replica(replica: str) -> None:
    from ray.util import list_named_actors

    names = [a for a in list_named_actors(all_namespaces=True) if "ParrotReplica" in a["name"] and replica in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def test_gateway_answers_in_openai_shape(ray_parrot):
    url = ray_parrot
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.headers["x-parrot-replica"]
    r = httpx.get(url + "/v1/nope", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": "not a list"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "parrot:num_requests_waiting" in metrics and "parrot:kv_cache_usage_perc" in metrics


def test_affinity_keys():
    from parrot.server.ray_app import PREFIX_CHARS, affinity_key

    chat = json.dumps({"messages": [{"role": "system", "content": "x" * PREFIX_CHARS}, {"role": "user", "content": "a"}]})
    other = json.dumps({"messages": [{"role": "system", "content": "x" * PREFIX_CHARS}, {"role": "user", "content": "b"}]})
    assert affinity_key({}, chat.encode()).startswith("prefix:")
    assert affinity_key({}, chat.encode()) == affinity_key({}, other.encode())  # same prefix, same replica
    assert affinity_key({}, json.dumps({"prompt": "y"}).encode()) != affinity_key({}, chat.encode())
    user = affinity_key({}, json.dumps({"prompt": "y", "user": "u1"}).encode())
    assert user.startswith("tenant:") and user == affinity_key({}, json.dumps({"prompt": "z", "user": "u1"}).encode())
    keyed = affinity_key({"authorization": "Bearer k1"}, json.dumps({"prompt": "y", "user": "u1"}).encode())
    assert keyed != user  # another API key's user of the same name is another tenant
    assert affinity_key({}, b"") == affinity_key({}, b"not json") == ""


class _Stream:
    """A replica's streamed answer as the gateway sees it: chunks, then the replica is lost."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.cancelled = list(chunks), False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        raise ray.exceptions.ActorUnavailableError("the replica was killed", None)

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("ended", [False, True])
def test_a_replica_lost_mid_stream_ends_it_once_with_an_error_and_after_done_adds_nothing(ended):
    """Lost mid-way, the client gets an error event and one [DONE]; lost after the app had sent its
    [DONE] (the call not yet returned), the answer is whole and nothing follows its [DONE] (the
    kill test once read two [DONE]s, the second after an error event)."""
    import asyncio

    from parrot.server.ray_app import _relay

    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    stream = _Stream([chunk, b"data: [DONE]\n\n"] if ended else [chunk])

    async def read() -> bytes:
        return b"".join([c async for c in _relay(stream, b"")])

    events = [line[6:] for line in asyncio.run(read()).decode().splitlines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]" and stream.cancelled
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [e["code"] for e in errors] == ([] if ended else ["replica_unavailable"])


def test_plain_serve_does_not_import_ray():
    code = ("import sys, parrot.cli, parrot.server.app; from parrot.cli import build_parser; "
            "build_parser().parse_args(['serve']); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-c", "import sys; from parrot.cli import main; sys.exit(main(['serve', '--replicas', '2']))"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--replicas and --max-replicas need --ray" in out.stderr
