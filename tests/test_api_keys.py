"""API keys (parrot/server/auth.py) on the tiny model behind the real app: a /v1/ request without a key,
or with a wrong one, gets a 401 in OpenAI's error shape and reaches nothing; any configured key
(given, or from a key file) is served; /health and /metrics stay open unless protected; keys are
compared in constant time; PARROT_API_KEY names the key as PARROT_SERVER_API_KEY does."""

from __future__ import annotations

import hmac
import time

import httpx
import openai
import pytest

from parrot.server.app import create_app
from parrot.server.auth import KeyChecker, read_keys
from parrot.config import Config, DraftingConfig, ServerConfig, load_config
from tests.conftest import RunningServer, engine_builder, free_port, start_server
from tests.tiny import tiny_engine

CHAT = {"messages": [{"role": "user", "content": "abcabc"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# one key per line\nfile-key-1\n\n  file-key-2  \n")
    running = start_server(tiny_engine("native", DraftingConfig(adaptive=False, max_draft=4)), loaded_name="tiny",
                           api_key="main-key", api_key_file=str(key_file))
    yield running
    running.stop()


def _post(url: str, key: str | None, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(url + path, json=CHAT, headers=headers, timeout=60)


@pytest.mark.parametrize("key, code", [(None, "missing_api_key"), ("", "missing_api_key"), ("wrong", "invalid_api_key"),
                                       ("main-keyx", "invalid_api_key"), ("file-key", "invalid_api_key")])
def test_a_request_without_a_valid_key_gets_openais_401(keyed, key, code):
    headers = {"Authorization": "Bearer" if key == "" else f"Bearer {key}"} if key is not None else {}
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_every_configured_key_is_served_and_the_sdk_reports_a_wrong_one(keyed):
    for key in ("main-key", "file-key-1", "file-key-2"):
        assert _post(keyed.url, key).status_code == 200
        assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", timeout=30).status_code == 401  # every /v1/ path, not only generation
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="main-key", max_retries=0)
    assert client.chat.completions.create(model="tiny", **CHAT).choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_health_metrics_and_the_dashboard_page_stay_open_but_its_data_does_not(keyed):
    for path in ("/health", "/metrics", "/dashboard"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 200, path
    assert httpx.get(keyed.url + "/v1/stats", timeout=30).status_code == 401
    assert httpx.get(keyed.url + "/v1/stats", headers={"Authorization": "Bearer file-key-2"}, timeout=30).status_code == 200


def test_protect_monitoring_puts_health_and_metrics_behind_the_keys():
    config = Config(server=ServerConfig(api_key="k", protect_monitoring=True))
    running = RunningServer(create_app(config, builder=engine_builder(tiny_engine("native"), "tiny")), free_port())
    running.thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # ready: /health answers 200 to the key
        try:
            if httpx.get(running.url + "/health", headers={"Authorization": "Bearer k"}, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        for path in ("/health", "/metrics"):
            assert httpx.get(running.url + path, timeout=30).status_code == 401, path
            assert httpx.get(running.url + path, headers={"Authorization": "Bearer k"}, timeout=30).status_code == 200
    finally:
        running.stop()


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Every configured key's digest is compared, whichever matches, and never the key itself:
    the time does not depend on which key matched or how much of one did."""
    checker = KeyChecker(["alpha", "beta", "gamma"])
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented, expected in (("alpha", True), ("gamma", True), ("alphx", False), ("", False)):
        seen.clear()
        assert checker.verify(presented) is expected
        assert len(seen) == 3 and all(len(a) == len(b) == 32 for a, b in seen)  # SHA-256 digests, all three


def test_key_settings_come_from_the_environment_and_a_bad_key_file_is_refused(tmp_path):
    assert load_config(env={"PARROT_API_KEY": "x"}).server.api_key == "x"
    assert load_config(env={"PARROT_API_KEY": "x", "PARROT_SERVER_API_KEY": "y"}).server.api_key == "y"
    with pytest.raises(ValueError, match="cannot read"):
        read_keys(ServerConfig(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_keys(ServerConfig(api_key_file=str(tmp_path / "empty")))
    assert read_keys(ServerConfig()) == []
