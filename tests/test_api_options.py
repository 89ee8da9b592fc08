"""Sampling options through the HTTP API, on a real uvicorn server running the tiny deterministic
model (its tokenizer reads letters: token i is the i-th letter, 1..26): penalties and logit_bias."""

from __future__ import annotations

import httpx
import pytest

from server.config import DraftingConfig
from tests.conftest import start_server
from tests.tiny import tiny_engine

PROMPT = [3, 1, 2, 3, 1, 2, 3, 1]  # token ids


@pytest.fixture(scope="module")
def url():
    running = start_server(tiny_engine("native", DraftingConfig(adaptive=False, max_draft=8)), loaded_name="tiny")
    yield running.url
    running.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_logit_bias_and_penalties_change_the_output_on_both_endpoints(url):
    base = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    biased = _post(url, "/v1/completions", {**base, "prompt": PROMPT, "logit_bias": {"5": 100}})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] == "eeeeee"
    # Chat: the tiny chat template is the messages' letters, so this prompt is PROMPT.
    messages = [{"role": "user", "content": "cabcabca"}]
    base["max_tokens"] = 32  # long enough for the output to repeat itself
    plain = _post(url, "/v1/chat/completions", {**base, "messages": messages}).json()["choices"][0]["message"]["content"]
    for options in ({"presence_penalty": 2}, {"frequency_penalty": 2}, {"repetition_penalty": 5.0},
                    {"logit_bias": {"5": 100}}):
        r = _post(url, "/v1/chat/completions", {**base, "messages": messages, **options})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] != plain, options
    # Neutral values change nothing.
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {}}
    r = _post(url, "/v1/chat/completions", {**base, "messages": messages, **neutral})
    assert r.json()["choices"][0]["message"]["content"] == plain


BAD_OPTIONS = [
    # (options, param): each is a 400 in OpenAI's error shape naming the parameter
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"64": 1}}, "logit_bias"),  # the tiny vocabulary is 0..63
    ({"logit_bias": {"5": "high"}}, "logit_bias[5]"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("options, param", BAD_OPTIONS)
def test_bad_sampling_options_get_openai_shaped_400s(url, path, options, param):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "abc"}]}
    r = _post(url, path, {**body, "max_tokens": 2, **options})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_seeded_choices_differ_and_each_reproduces_with_and_without_drafting(url):
    body = {"messages": [{"role": "user", "content": "cabcabca"}], "temperature": 1.0, "max_tokens": 16,
            "ignore_eos": True, "n": 3, "seed": 11}

    def texts(**extra):
        r = _post(url, "/v1/chat/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]], r.json()["usage"]["speculation"]

    first, _ = texts()
    assert len(set(first)) == 3
    again, spec = texts()
    assert again == first and spec["drafted_tokens"] > 0
    off, spec = texts(speculation={"enabled": False})
    assert off == first and spec["drafted_tokens"] == 0
    other, _ = texts(seed=12)
    assert other != first
