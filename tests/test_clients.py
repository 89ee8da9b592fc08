"""Third-party clients against a real server: what users' code sends, not what our tests would."""

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
