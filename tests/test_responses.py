"""The Responses API (``POST /v1/responses``) through the openai SDK: text on the tiny model
(shapes, streaming events, the same answer as chat), and structured output and function tools on
the embedded model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from parrot.config import DraftingConfig
from tests.conftest import start_server
from tests.tiny import tiny_engine


@pytest.fixture(scope="module")
def tiny():
    running = start_server(tiny_engine("native", DraftingConfig(adaptive=False, max_draft=8)), loaded_name="tiny")
    yield running
    running.stop()


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_text_response_is_the_chat_answer(tiny):
    client = _client(tiny.url)
    kwargs = {"temperature": 0, "max_output_tokens": 12}
    r = client.responses.create(model="tiny", input="cabcabca", instructions="ab", **kwargs)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "ab"}, {"role": "user", "content": "cabcabca"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.store is True
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # Message items as input: the same conversation, the same answer.
    items = client.responses.create(model="tiny", instructions="ab", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "cabcabca"}]}], **kwargs)
    assert items.output_text == r.output_text


def test_streamed_events_build_the_same_response(tiny):
    client = _client(tiny.url)
    kwargs = {"model": "tiny", "input": "cabcabca", "temperature": 0, "max_output_tokens": 16}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_continued_response_is_its_conversation_and_belongs_to_its_key(tiny):
    client = _client(tiny.url)
    kwargs = {"model": "tiny", "temperature": 0, "max_output_tokens": 6}
    first = client.responses.create(input="cabcab", instructions="ab", **kwargs)
    second = client.responses.create(input="bcabca", previous_response_id=first.id, **kwargs)
    assert second.previous_response_id == first.id
    whole = client.chat.completions.create(model="tiny", temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": "cabcab"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "bcabca"}])  # the instructions are not carried over
    assert second.output_text == whole.choices[0].message.content
    assert second.usage.input_tokens == whole.usage.prompt_tokens
    # Another API key, an unknown id, or a response stored with store=false: 404 in OpenAI's shape.
    unstored = client.responses.create(input="abc", store=False, **kwargs)
    assert unstored.store is False
    for key, rid in (("other", first.id), ("unused", "resp_unknown"), ("unused", unstored.id)):
        r = httpx.post(tiny.url + "/v1/responses", json={"input": "a", "previous_response_id": rid},
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": "abc", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "abc", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "abc", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "abc", "reasoning": {"effort": "high"}}, "reasoning"),
])
def test_bad_responses_requests_get_openai_shaped_400s(tiny, body, param):
    r = httpx.post(tiny.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


# -- on the embedded model: grammars --------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.mark.real_model
def test_function_calls_and_their_outputs(http_server):
    client = _client(http_server.url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {"model": "SmolLM2-135M-Instruct", "tools": [WEATHER], "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60}
    r = client.responses.create(input=ask, **kwargs)
    assert [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # Streamed: the call's arguments in deltas, the same call.
    events = list(client.responses.create(input=ask, stream=True, **kwargs))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert arguments == call.arguments and [(d.name, d.arguments) for d in done] == [(call.name, call.arguments)]
    # The conversation goes on with the call and its output as input items.
    follow = client.responses.create(input=[*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                                   "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 degrees, sunny"}],
                                     model="SmolLM2-135M-Instruct", tools=[WEATHER], temperature=0, max_output_tokens=24)
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.real_model
def test_json_schema_text_format(http_server):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = _client(http_server.url).responses.create(
        model="SmolLM2-135M-Instruct", input="Which city is the capital of France?", temperature=0,
        max_output_tokens=40, text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
