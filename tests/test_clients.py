"""Third-party clients against a real server: what users' code sends, not what our tests would.

The openai SDK (structured-output helpers, streamed tool calls), instructor, LangChain's ChatOpenAI
and LiteLLM (its openai/ and hosted_vllm/ providers); the SDK's tools and Responses calls are in
test_tools.py and test_responses.py."""

from __future__ import annotations

import instructor
import pytest
from openai import OpenAI
from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_returns_a_validated_model(http_server, mode):
    # JSON_SCHEMA sends response_format json_object with a schema (the body that once gave a 500),
    # which the grammar enforces; TOOLS a named function. (Mode.JSON only puts the schema in the
    # prompt: a plain json_object, which the embedded model fills with the wrong keys.)
    client = instructor.from_openai(OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0,
                                           timeout=120), mode=mode)
    person, completion = client.chat.completions.create_with_completion(
        model="SmolLM2-135M-Instruct", response_model=Person, max_retries=0, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Jason is 25 years old."}])
    assert isinstance(person, Person)
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")
    if mode == instructor.Mode.TOOLS:
        assert completion.choices[0].message.tool_calls[0].function.name == "Person"


def _openai(http_server) -> OpenAI:
    return OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def test_openai_sdk_parse_and_streamed_tool_calls(http_server):
    """The SDK's structured-output helpers (strict json_schema from a pydantic model) and its
    stream helper assembling tool-call deltas."""
    client = _openai(http_server)
    parsed = client.chat.completions.parse(model="SmolLM2-135M-Instruct", response_format=Person, temperature=0,
                                           max_tokens=60, messages=[{"role": "user", "content": "Jason is 25 years old."}])
    assert isinstance(parsed.choices[0].message.parsed, Person)
    response = client.responses.parse(model="SmolLM2-135M-Instruct", text_format=Person, temperature=0,
                                      max_output_tokens=60, input="Jason is 25 years old.")
    assert isinstance(response.output_parsed, Person)
    with client.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=ASK_WEATHER, tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_tokens=60) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments or {}, dict)
    assert final.choices[0].finish_reason == "tool_calls"


def test_langchain_tools_and_structured_output(http_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=http_server.url + "/v1", api_key="unused", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=60, max_retries=0, timeout=120)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Jason is 25 years old.")
        assert isinstance(person, Person), method


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_providers(http_server, provider, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map
    import litellm

    kwargs = {"model": f"{provider}/SmolLM2-135M-Instruct", "api_base": http_server.url + "/v1", "api_key": "unused",
              "temperature": 0, "max_tokens": 20, "timeout": 120, "num_retries": 0}
    reply = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **kwargs)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Say hello."}], stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    called = litellm.completion(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", **{**kwargs, "max_tokens": 60})
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"
