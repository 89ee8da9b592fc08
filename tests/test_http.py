"""End to end against a real uvicorn server on loopback, with the official openai SDK and httpx.

The server runs the embedded SmolLM2 model (the session's engine). Outputs are kept short.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from parrot.server.textdiff import apply_edits
from tests.conftest import start_server

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name three primary colors, separated by commas."}]
DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. It was the tallest man-made structure in the world until 1930."
)


@pytest.fixture(scope="module")
def client(http_server):
    return OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", **kwargs)


def test_models_and_health(http_server, client):
    health = httpx.get(http_server.url + "/health").json()
    assert health["status"] == "ok" and health["backend"]["name"] == "native"
    assert health["backend"]["whole_pass_compiled"] == (http_server.app.state.parrot.loaded.forward.native is not None)
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_a_ready_server_keeps_its_start_up_objects_out_of_the_collectors_scans(embedded_engine):
    # A full collection walks every tracked object holding the GIL, a pause of every stream (115-120
    # ms over a loaded Qwen2.5 server's 257,000 objects): what is alive once the model is loaded is
    # frozen, later garbage is still collected, and the app's shutdown unfreezes.
    import gc

    gc.unfreeze()  # whatever another server of this session left frozen
    assert gc.get_freeze_count() == 0
    server = start_server(embedded_engine)
    try:
        assert gc.get_freeze_count() > 10_000
        assert not any(obj is embedded_engine for obj in gc.get_objects())  # frozen: not scanned
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0


def test_chat_completion_greedy_with_usage_and_speculation(client):
    r = _chat(client, messages=QUESTION, temperature=0, max_tokens=24)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    spec = r.usage.model_extra["speculation"]
    assert spec["forward_passes"] >= 1


def test_completions_with_prompt_string_and_token_ids(client, http_server):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", temperature=0, max_tokens=8)
    text = r.choices[0].text
    assert text
    ids = httpx.post(http_server.url + "/v1/completions", json={"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4,
                                                              "temperature": 0}).json()
    assert ids["usage"]["prompt_tokens"] == 5 and ids["usage"]["completion_tokens"] == 4


def test_streamed_text_equals_non_streamed_text(client):
    full = _chat(client, messages=QUESTION, temperature=0, max_tokens=32)
    chunks = list(_chat(client, messages=QUESTION, temperature=0, max_tokens=32, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == full.choices[0].finish_reason


def test_streamed_completions_end_with_done(http_server):
    with httpx.stream("POST", http_server.url + "/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_ends_output_before_it(client):
    full = _chat(client, messages=QUESTION, temperature=0, max_tokens=32).choices[0].message.content
    stop = full.split()[2]
    r = _chat(client, messages=QUESTION, temperature=0, max_tokens=32, stop=[stop])
    out = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert out == full[: full.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       _chat(client, messages=QUESTION, temperature=0, max_tokens=32, stop=[stop], stream=True) if c.choices)
    assert streamed == out


def test_n_choices_and_seeded_sampling(client):
    r = _chat(client, messages=QUESTION, temperature=0, max_tokens=12, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    a = _chat(client, messages=QUESTION, temperature=1.0, max_tokens=16, seed=7)
    b = _chat(client, messages=QUESTION, temperature=1.0, max_tokens=16, seed=7)
    c = _chat(client, messages=QUESTION, temperature=1.0, max_tokens=16, seed=8, n=3)
    d = _chat(client, messages=QUESTION, temperature=1.0, max_tokens=16, seed=8, n=3)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [x.message.content for x in d.choices] == [x.message.content for x in c.choices]
    texts = {x.message.content for x in c.choices} | {a.choices[0].message.content}
    assert len(texts) > 1


def test_logprobs_cover_the_output(client, http_server):
    r = _chat(client, messages=QUESTION, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or content[-1].token == "<|im_end|>"
    joined = b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace")
    assert joined.startswith(r.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.logprob >= entry.top_logprobs[-1].logprob - 1e-6
        # Greedy: the chosen token is the most likely one.
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-5
    comp = httpx.post(http_server.url + "/v1/completions",
                      json={"prompt": "One, two, three,", "max_tokens": 5, "temperature": 0, "logprobs": 2}).json()
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"]


def test_streamed_logprobs_cover_tokens_that_make_no_text_yet(client, http_server):
    # Emoji take several tokens each; the tokens before a character's last make no text, and
    # their logprobs must still be streamed (in chunks with an empty delta), none dropped.
    ask = [{"role": "user", "content": "Write three emoji and the Japanese word for cat."}]
    whole = _chat(client, messages=ask, temperature=0, max_tokens=40, logprobs=True, top_logprobs=1)
    streamed, textless = [], 0
    for chunk in _chat(client, messages=ask, temperature=0, max_tokens=40, logprobs=True, top_logprobs=1, stream=True):
        for choice in chunk.choices:
            entries = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            streamed += entries
            textless += bool(entries) and not choice.delta.content
    assert textless > 0  # the prompt does produce tokens without text (else this checks nothing)
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in whole.choices[0].logprobs.content]
    comp = {"prompt": "Three emoji: ", "max_tokens": 30, "temperature": 0, "logprobs": 1}
    plain = httpx.post(http_server.url + "/v1/completions", json=comp, timeout=60).json()["choices"][0]["logprobs"]
    tokens = []
    with httpx.stream("POST", http_server.url + "/v1/completions", json={**comp, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += (choice.get("logprobs") or {}).get("tokens") or []
    assert tokens == plain["tokens"]


def test_predicted_outputs_are_accepted_when_the_prediction_is_right(client):
    messages = [{"role": "user", "content": "Repeat this sentence exactly: " + DOC}]
    plain = _chat(client, messages=messages, temperature=0, max_tokens=60)
    text = plain.choices[0].message.content
    r = _chat(client, messages=messages, temperature=0, max_tokens=60, prediction={"type": "content", "content": text})
    assert r.choices[0].message.content == text
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens >= details.accepted_prediction_tokens
    spec = r.usage.model_extra["speculation"]
    assert spec["accepted_tokens"] > 0
    assert spec["forward_passes"] < r.usage.completion_tokens


def test_speculation_can_be_switched_off_per_request(client):
    on = _chat(client, messages=QUESTION, temperature=0, max_tokens=24)
    off = _chat(client, messages=QUESTION, temperature=0, max_tokens=24, extra_body={"speculation": {"enabled": False}})
    assert off.choices[0].message.content == on.choices[0].message.content
    assert off.usage.model_extra["speculation"]["drafted_tokens"] == 0


def test_eight_concurrent_clients_match_their_sequential_outputs(client):
    prompts = [[{"role": "user", "content": f"Write one sentence about the number {i}."}] for i in range(8)]
    sequential = [_chat(client, messages=p, temperature=0, max_tokens=24).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda p: _chat(client, messages=p, temperature=0, max_tokens=24).choices[0].message.content,
                                   prompts))
    assert concurrent == sequential


BAD_REQUESTS = [
    # (endpoint, body or raw bytes, status, error type, param)
    ("/v1/chat/completions", b"{not json", 400, "invalid_request_error", None),
    ("/v1/chat/completions", b"", 400, "invalid_request_error", None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "invalid_request_error",
     "messages[0].content[1].type"),  # a text-only model: the part it cannot read, not "should be a string"
    ("/v1/chat/completions", {"messages": QUESTION, "temperature": 5}, 400, "invalid_request_error", "temperature"),
    ("/v1/chat/completions", {"messages": QUESTION, "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 100000}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": QUESTION, "n": 0}, 400, "invalid_request_error", "n"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ("/v1/chat/completions", {"messages": QUESTION, "stop": [""]}, 400, "invalid_request_error", "stop"),
    ("/v1/chat/completions", {"messages": QUESTION, "model": "gpt-4"}, 404, "invalid_request_error", "model"),
    ("/v1/chat/completions", {"messages": QUESTION, "frequency_penalty": 2.5}, 400, "invalid_request_error", "frequency_penalty"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "function"}]}, 400, "invalid_request_error", "tools[0].function"),
    ("/v1/chat/completions", {"messages": QUESTION, "mystery": 1}, 400, "invalid_request_error", "mystery"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, 400, "invalid_request_error", "top_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "speculation": {"max_draft": -1}}, 400, "invalid_request_error", "speculation.max_draft"),
    ("/v1/completions", {"prompt": "x" * 60000, "max_tokens": 10}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999999]}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "invalid_request_error", "prompt"),  # lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udc00"}]}', 400, "invalid_request_error",
     "messages[0].content"),
    ("/v1/correct", b'{"text": "\\ud83d"}', 400, "invalid_request_error", "text"),
    ("/v1/completions", {"prompt": []}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "invalid_request_error", "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),  # 0 needs echo
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "invalid_request_error", "best_of"),
    ("/v1/summarize", {"text": ""}, 400, "invalid_request_error", "text"),
    ("/v1/summarize", {"text": "abc", "style": "poem"}, 400, "invalid_request_error", "style"),
    ("/v1/summarize", {"text": "abc", "max_input_tokens": 3}, 400, "invalid_request_error", "max_input_tokens"),
    ("/v1/correct", {"txt": "abc"}, 400, "invalid_request_error", "text"),  # the first problem: text missing
    ("/v1/nothing", {}, 404, "invalid_request_error", None),
]


@pytest.mark.parametrize("endpoint, body, status, kind, param", BAD_REQUESTS)
def test_bad_requests_get_openai_shaped_errors(http_server, endpoint, body, status, kind, param):
    if isinstance(body, bytes):
        r = httpx.post(http_server.url + endpoint, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(http_server.url + endpoint, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind
    assert error["param"] == param
    assert error["message"]


def test_context_window_error_states_exact_token_counts(http_server, embedded_engine):
    prompt = "hello " * 9000
    n = len(embedded_engine.tokenizer.encode(prompt))
    r = httpx.post(http_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "8192" in message and f"{n + 10} tokens ({n} in the prompt, 10 in the completion)" in message


def test_oversize_body_gets_413(http_server):
    r = httpx.post(http_server.url + "/v1/completions", content=b"x" * (5 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_metrics_parse_and_counters_move(http_server, client):
    url = http_server.url
    families = {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in ("parrot_queue_wait_seconds", "parrot_time_to_first_token_seconds", "parrot_inter_token_latency_seconds",
                 "parrot_e2e_request_latency_seconds", "parrot_requests", "parrot_prompt_tokens",
                 "parrot_completion_tokens", "parrot_drafted_tokens", "parrot_accepted_tokens", "parrot_forward_passes",
                 "parrot_requests_running", "parrot_requests_waiting"):
        assert name in families, name
    before = {n: _metric(url, n) for n in ("parrot_completion_tokens_total", "parrot_prompt_tokens_total",
                                           "parrot_forward_passes_total", "parrot_time_to_first_token_seconds_count")}
    requests_before = _metric(url, "parrot_requests_total", endpoint="/v1/chat/completions", status="200")
    r = _chat(client, messages=QUESTION, temperature=0, max_tokens=8)
    after = {n: _metric(url, n) for n in before}
    assert after["parrot_completion_tokens_total"] - before["parrot_completion_tokens_total"] == r.usage.completion_tokens
    assert after["parrot_prompt_tokens_total"] - before["parrot_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["parrot_forward_passes_total"] > before["parrot_forward_passes_total"]
    assert after["parrot_time_to_first_token_seconds_count"] == before["parrot_time_to_first_token_seconds_count"] + 1
    assert _metric(url, "parrot_requests_total", endpoint="/v1/chat/completions", status="200") == requests_before + 1
    # A stream and a refused request are counted too, each under its route and status.
    bad_before = _metric(url, "parrot_requests_total", endpoint="/v1/chat/completions", status="400")
    assert len(list(_chat(client, messages=QUESTION, max_tokens=4, stream=True))) > 0
    assert httpx.post(url + "/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": -1}).status_code == 400
    assert _metric(url, "parrot_requests_total", endpoint="/v1/chat/completions", status="200") == requests_before + 2
    assert _metric(url, "parrot_requests_total", endpoint="/v1/chat/completions", status="400") == bad_before + 1


def test_metrics_give_the_draft_policy_pass_cost_curve(http_server, embedded_engine):
    costs = {int(s.labels["tokens"]): s.value for f in text_string_to_metric_families(httpx.get(http_server.url + "/metrics").text)
             for s in f.samples if s.name == "parrot_pass_cost_seconds"}
    last = len(embedded_engine.policy.cost) - 1
    assert sorted(costs) == [1, 2, 4, 8, 16, last]
    assert all(costs[t] == pytest.approx(embedded_engine.policy.cost[t]) for t in costs)


def test_inference_gateway_metrics_follow_a_running_request(http_server):
    """The model-server protocol's gauges (parrot/server/metrics.py): queued and running requests, and
    the KV positions held over max_running context windows, while a stream runs and after."""
    url = http_server.url
    types = {f.name: f.type for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in ("parrot:num_requests_waiting", "parrot:num_requests_running", "parrot:kv_cache_usage_perc"):
        assert types.get(name) == "gauge", name
    capacity = 8 * 8192  # server.max_running of the default config, the embedded model's window
    prompt = "Count from one to a thousand:"
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        chunks = 0
        for line in r.iter_lines():  # read while the stream is open (leaving the loop closes it)
            chunks += line.startswith("data:")
            if chunks == 4:
                running = _metric(url, "parrot:num_requests_running")
                positions = _metric(url, "parrot:kv_cache_usage_perc") * capacity
                waiting = _metric(url, "parrot:num_requests_waiting")
                break
    assert running == 1 and waiting == 0
    assert 4 <= positions <= 2000 + 20, positions  # the prompt and what was generated so far
    for _ in range(100):  # the client left: the engine drops the request at its next step
        if _metric(url, "parrot:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert _metric(url, "parrot:num_requests_running") == 0
    assert _metric(url, "parrot:kv_cache_usage_perc") == 0


def test_disconnected_stream_frees_its_generation(http_server):
    url = http_server.url
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "Count from one to a thousand:", "max_tokens": 2000, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first chunk
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _metric(url, "parrot_requests_running") > 0:
        time.sleep(0.2)
    assert _metric(url, "parrot_requests_running") == 0
    assert http_server.app.state.parrot.scheduler.running == 0


def test_task_apis_summarize_and_correct(http_server):
    r = httpx.post(http_server.url + "/v1/summarize", json={"text": DOC, "max_tokens": 48}, timeout=120).json()
    assert r["summary"] and r["usage"]["completion_tokens"] <= 48 and r["truncation"]["truncated"] is False
    b = httpx.post(http_server.url + "/v1/summarize", json={"text": DOC, "max_tokens": 48, "style": "bullets",
                                                            "max_input_tokens": 60}, timeout=120).json()
    assert b["truncation"]["truncated"] is True and b["usage"]["prompt_tokens"] <= 60
    assert DOC.startswith(DOC[: b["truncation"]["kept_characters"]])
    text = "She go to school every days and she like it very much."
    c = httpx.post(http_server.url + "/v1/correct", json={"text": text}, timeout=120).json()
    assert c["corrected"]
    assert apply_edits(text, c["edits"]) == c["corrected"]
    assert c["usage"]["speculation"]["accepted_tokens"] > 0  # the input is the drafting context


def test_queue_full_gets_429_with_retry_after_and_timeouts_get_504(embedded_engine):
    small = start_server(embedded_engine, max_running=1, max_queue=1, request_timeout_s=60)
    try:
        body = {"prompt": "Count to one hundred:", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        statuses: list[int] = []
        headers: list[httpx.Headers] = []

        def post() -> None:
            r = httpx.post(small.url + "/v1/completions", json=body, timeout=120)
            statuses.append(r.status_code)
            headers.append(r.headers)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert 429 in statuses and 200 in statuses
        assert all(h.get("retry-after") for s, h in zip(statuses, headers) if s == 429)
    finally:
        small.stop()
    slow = start_server(embedded_engine, request_timeout_s=0.3)
    try:
        r = httpx.post(slow.url + "/v1/completions", json={"prompt": "Count:", "max_tokens": 500, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and slow.app.state.parrot.scheduler.running:
            time.sleep(0.1)
        assert slow.app.state.parrot.scheduler.running == 0  # the timed-out generation was freed
    finally:
        slow.stop()
