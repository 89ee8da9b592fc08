"""Sampling options through the HTTP API, on a real uvicorn server running the tiny deterministic
model (its tokenizer reads letters: token i is the i-th letter, 1..26): penalties and logit_bias,
seeded choices, echo and prompt logprobs."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from openai import OpenAI

from parrot.config import DraftingConfig
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


def _reference_prompt_logprobs(prompt: list[int]) -> list[float]:
    """The logprob of each prompt token after the first, from one pass of the same tiny model."""
    forward = tiny_engine("native").forward
    logits = forward.forward([(forward.new_cache(len(prompt)), prompt, len(prompt))])[0]
    logp = torch.log_softmax(logits[:-1], -1)
    return [float(logp[i, token]) for i, token in enumerate(prompt[1:])]


def test_echo_with_max_tokens_zero_scores_the_prompt_in_openai_legacy_shape(url):
    """What lm-eval-harness sends for loglikelihoods, through the openai SDK."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == "cabcabca" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    lp = choice.logprobs
    assert lp.tokens == list("cabcabca") and lp.text_offset == list(range(len(PROMPT)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_reference_prompt_logprobs(PROMPT), abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(url):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = _post(url, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    echoed = _post(url, "/v1/completions", body).json()["choices"][0]
    assert echoed["text"] == "cabcabca" + plain["text"]
    lp = echoed["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 5 and "".join(lp["tokens"]) == echoed["text"]
    assert lp["token_logprobs"][len(PROMPT):] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith("cabcabca")
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    # Without logprobs, echo is the text alone; a prompt of one token has nothing to score.
    one = _post(url, "/v1/completions", {"prompt": [5], "echo": True, "logprobs": 0, "max_tokens": 0}).json()["choices"][0]
    assert one["text"] == "e" and one["logprobs"]["token_logprobs"] == [None]


def test_vllm_prompt_logprobs_on_completions_and_chat(url):
    expected = _reference_prompt_logprobs(PROMPT)
    choice = _post(url, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}).json()["choices"][0]
    chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "cabcabca"}], "prompt_logprobs": 0,
                                              "max_tokens": 1, "n": 2}).json()
    for entries, top in ((choice["prompt_logprobs"], 2), (chat["prompt_logprobs"], 0)):
        assert entries[0] is None and len(entries) == len(PROMPT)
        for entry, token, logprob in zip(entries[1:], PROMPT[1:], expected):
            assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
            assert entry[str(token)]["decoded_token"] == "abc"[token - 1]
            ranks = sorted(v["rank"] for v in entry.values())
            assert len(entry) in (top, top + 1) and ranks[: top] == list(range(1, top + 1))


BAD_PROMPT_OPTIONS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "prompt_logprobs": -1}, "prompt_logprobs"),
]


@pytest.mark.parametrize("path, body, param", BAD_PROMPT_OPTIONS)
def test_bad_prompt_logprob_requests_get_openai_shaped_400s(url, path, body, param):
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
