"""Cross-request drafting: a tenant's earlier prompts and outputs are drafting context for its
next request, never another tenant's, in bounded memory; outputs do not change."""

from __future__ import annotations

import random

import httpx
import pytest
from starlette.requests import Request

from parrot.config import DraftingConfig
from parrot.server.sessions import SessionStore, tenant_of
from tests.conftest import start_server
from tests.tiny import tiny_engine


def test_store_keeps_the_most_recent_tokens_of_the_most_recent_tenants():
    store = SessionStore(max_tenants=2, max_tokens=10)
    store.add("a", [1, 2, 3, 4])
    store.add("a", [5, 6, 7, 8])
    store.add("a", [9, 10, 11])  # 11 tokens: the oldest text goes
    assert store.context("a") == [[5, 6, 7, 8], [9, 10, 11]]
    store.add("a", list(range(100, 130)))  # longer than the bound: its last 10 tokens
    assert store.context("a") == [list(range(120, 130))]
    store.add("b", [1])
    store.context("a")  # a is now the most recently used
    store.add("c", [2])  # a third tenant: the least recently used (b) goes
    assert store.context("b") == [] and store.context("a") and store.context("c") == [[2]]
    assert store.tokens() == 11


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_tenants_are_an_api_key_and_a_user_together():
    alice_key = tenant_of(_request({"Authorization": "Bearer k1"}), "alice")
    assert alice_key == tenant_of(_request({"Authorization": "Bearer k1"}), "alice")
    assert alice_key != tenant_of(_request({"Authorization": "Bearer k2"}), "alice")  # another key, same user name
    assert alice_key != tenant_of(_request({"Authorization": "Bearer k1"}), "bob")
    assert tenant_of(_request({}), "alice") != alice_key
    assert "k1" not in alice_key  # the key itself is not kept
    assert tenant_of(_request({}), None) is None


@pytest.fixture(scope="module")
def url():
    engine = tiny_engine("native", DraftingConfig(adaptive=False, max_draft=8))
    running = start_server(engine, loaded_name="tiny", session_drafting=True)
    yield running.url
    running.stop()


def _complete(url: str, prompt: list[int], user: str | None, session: bool = True, key: str = "k") -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "speculation": {"session": session}, **({"user": user} if user else {})}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tenant_drafts_from_its_earlier_request_and_only_its_own(url):
    rng = random.Random(5)
    prompt = [rng.randrange(1, 64) for _ in range(16)]
    first = _complete(url, prompt, "alice")
    # The same prompt again: the drafter finds it in alice's session and copies the answer.
    again = _complete(url, prompt, "alice")
    others = [_complete(url, prompt, "bob"), _complete(url, prompt, "alice", key="other"),
              _complete(url, prompt, "alice", session=False)]
    texts = {r["choices"][0]["text"] for r in (first, again, *others)}
    assert len(texts) == 1  # drafting never changes the output
    spec = again["usage"]["speculation"]
    assert spec["accepted_tokens"] >= 20 and spec["forward_passes"] <= 4
    for r in others:  # another user, another key, or not opted in: nothing of alice's to copy
        assert r["usage"]["speculation"]["accepted_tokens"] < 8, r["usage"]


def test_session_requests_need_the_server_setting_and_a_tenant(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "speculation": {"session": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.session"
    engine = tiny_engine("native")
    off = start_server(engine, loaded_name="tiny")
    try:
        r = httpx.post(off.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "user": "alice",
                                                          "speculation": {"session": True}})
        assert r.status_code == 400 and "server.session_drafting" in r.json()["error"]["message"]
    finally:
        off.stop()
