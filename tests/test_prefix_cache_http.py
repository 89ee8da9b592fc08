"""The prefix cache as clients meet it, on the embedded model behind the real app: the next turn
of a chat reuses the last one's KV (``usage.prompt_tokens_details.cached_tokens``, streamed too)
and answers as a cold request does; tenants (API keys, ``user``) and ``cache_salt`` never share
blocks unless a shared prompt is configured, and then only its blocks; /metrics and /v1/stats
count queries and hits."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from parrot.server.app import create_app
from parrot.config import Config, PrefixCacheConfig
from parrot.engine.engine import Engine
from parrot.engine.prefix_cache import PrefixCache
from tests.conftest import RunningServer, engine_builder, fixed_cost_curve, free_port

SHARED = "You are Parrot's test assistant. Answer in one short sentence, and never use more words than needed."
DOCUMENT = ("The lighthouse at Cape Wrath was built in 1828 by Robert Stevenson. It stands on cliffs 120 metres "
            "above the sea, and its light can be seen 22 nautical miles away. The keepers left in 1998, when the "
            "light was automated. A road of 11 miles links it to a ferry across the Kyle of Durness. ")


@pytest.fixture(scope="module")
def server(embedded_engine):
    forward = embedded_engine.forward
    engine = Engine(forward, embedded_engine.tokenizer, embedded_engine.drafting,
                    fixed_cost_curve(embedded_engine.drafting.max_draft + 1),
                    prefix_cache=PrefixCache(forward.kv_layout, 64 << 20))
    config = Config(prefix_cache=PrefixCacheConfig(shared_prompt=SHARED))
    running = RunningServer(create_app(config, builder=engine_builder(engine, "SmolLM2-135M-Instruct")),
                            free_port()).start()
    yield running
    running.stop()


def _chat(url: str, messages: list[dict[str, str]], key: str = "k1", **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_next_turn_reuses_the_conversation_and_answers_as_a_cold_request(server):
    question = f"Conversation {uuid.uuid4().hex[:6]}. " + DOCUMENT + "When was the lighthouse built?"
    turn = [{"role": "user", "content": question}]
    first = _chat(server.url, turn)
    assert _cached(first) == 0
    turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "How far can its light be seen?"}]
    warm = _chat(server.url, turn)
    cold = _chat(server.url, turn, cache_salt="a scope of its own")  # the same request, computed anew
    assert _cached(cold) == 0
    assert _cached(warm) >= warm["usage"]["prompt_tokens"] - 24  # all but the new question and a partial block
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    # Streamed, the usage chunk says it too.
    turn += [{"role": "assistant", "content": warm["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Who built it?"}]
    body = {"messages": turn, "temperature": 0, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens"] - 16


def test_tenants_and_salts_never_share_blocks(server):
    messages = [{"role": "user", "content": f"Tenant test {uuid.uuid4().hex[:6]}. " + DOCUMENT + "Summarise."}]
    assert _cached(_chat(server.url, messages, key="alice")) == 0
    again = _chat(server.url, messages, key="alice")
    assert _cached(again) > 0  # the same tenant: a hit
    assert _cached(_chat(server.url, messages, key="bob")) == 0  # another API key
    assert _cached(_chat(server.url, messages, key="alice", user="someone")) == 0  # another user of the key
    assert _cached(_chat(server.url, messages, key="alice", cache_salt="x")) == 0  # another salt


def test_a_configured_shared_prompt_is_the_only_thing_tenants_share(server):
    def ask(key: str, words: str) -> dict:
        return _chat(server.url, [{"role": "system", "content": SHARED}, {"role": "user", "content": words + DOCUMENT}],
                     key=key)

    ask("carol", f"Shared {uuid.uuid4().hex[:6]}: ")
    other = ask("dave", f"Shared {uuid.uuid4().hex[:6]}: ")
    tokenizer_count = len(server.app.state.parrot.loaded.tokenizer.encode_chat(
        [{"role": "system", "content": SHARED}], add_generation_prompt=False))
    block = server.app.state.parrot.engine.prefix_cache.block_tokens
    assert 0 < _cached(other) == block * (tokenizer_count // block)  # the system prompt's whole blocks, no more


def test_completions_responses_and_counters_report_the_cache(server):
    prompt = f"Completion {uuid.uuid4().hex[:6]}. " + DOCUMENT
    for expected_hit in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                       timeout=60).json()
        assert (r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is expected_hit
    body = {"input": f"Responses {uuid.uuid4().hex[:6]}. " + DOCUMENT, "max_output_tokens": 4, "temperature": 0}
    first = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    r = httpx.post(server.url + "/v1/responses", json={**body, "input": "And then?", "previous_response_id": first["id"]},
                   timeout=60).json()
    assert r["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]  # and the answer
    metrics = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("parrot:prefix")}
    assert values["parrot:prefix_cache_hits_total"] > 0
    assert values["parrot:prefix_cache_queries_total"] > values["parrot:prefix_cache_hits_total"]
    assert 0 < values["parrot:prefix_cache_bytes"] <= values["parrot:prefix_cache_budget_bytes"] <= 64 << 20
    window = httpx.get(server.url + "/v1/stats").json()["window"]
    assert 0 < window["prefix_cache_hit_rate"] < 1


def test_structured_output_tool_calls_and_n_choices_reuse_and_answer_as_cold(server):
    schema = {"type": "object", "properties": {"year": {"type": "integer"}, "builder": {"type": "string"}},
              "required": ["year", "builder"], "additionalProperties": False}
    messages = [{"role": "user", "content": f"Grammar {uuid.uuid4().hex[:6]}. " + DOCUMENT + "Who built it, and when?"}]
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
           "key": f"tenant-{uuid.uuid4().hex}"}  # a tenant of its own: nothing cached before (the system prompt)
    first = _chat(server.url, messages, **fmt)
    warm = _chat(server.url, messages, **fmt)
    cold = _chat(server.url, messages, cache_salt="cold", **fmt)
    assert _cached(first) == 0 and _cached(warm) > 0 and _cached(cold) == 0
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    json.loads(warm["choices"][0]["message"]["content"])  # the grammar held
    tools = [{"type": "function", "function": {"name": "record", "parameters": schema}}]
    calls = [_chat(server.url, messages, tools=tools, tool_choice="required", cache_salt=salt)
             for salt in ("tools", "tools", "tools-cold")]
    assert _cached(calls[0]) == 0 and _cached(calls[1]) > 0 and _cached(calls[2]) == 0
    assert calls[1]["choices"][0]["message"]["tool_calls"][0]["function"] == \
        calls[2]["choices"][0]["message"]["tool_calls"][0]["function"]
    # n = 3 in one request: the choices after the first wait for it to read the prompt, then reuse it.
    n3 = _chat(server.url, [{"role": "user", "content": f"Choices {uuid.uuid4().hex[:6]}. " + DOCUMENT}], n=3)
    assert len({c["message"]["content"] for c in n3["choices"]}) == 1  # greedy: one answer
    metrics = httpx.get(server.url + "/metrics").text
    assert "parrot:prefix_cache_hits_total" in metrics
