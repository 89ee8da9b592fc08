"""A short ``make fuzz``: schemathesis over the OpenAPI schema of a real server on loopback (the
embedded model), valid and invalid requests, a few per operation. No response may be a 5xx and
no request may hang; bad input gets a 4xx. The server bounds every completion
(``server.max_completion_tokens``), which its OpenAPI schema states, so every case ends."""

from __future__ import annotations

import httpx
import pytest

from loadtests.fuzz import run_schemathesis
from tests.conftest import start_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def bounded_server(embedded_engine):
    server = start_server(embedded_engine, max_completion_tokens=8, request_timeout_s=60)
    yield server
    server.stop()


def test_the_openapi_schema_bounds_every_completion_budget(bounded_server):
    schemas = httpx.get(bounded_server.url + "/openapi.json").json()["components"]["schemas"]
    budgets = {(name, field) for name, schema in schemas.items() for field, prop in schema.get("properties", {}).items()
               if prop.get("x-completion-budget")}
    assert budgets == {("ChatCompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens"),
                       ("CompletionRequest", "max_tokens"), ("ResponsesRequest", "max_output_tokens"),
                       ("SummarizeRequest", "max_tokens"), ("CorrectRequest", "max_tokens")}
    for name, field in budgets:
        integer = [b for b in schemas[name]["properties"][field].get("anyOf", []) if b.get("type") == "integer"]
        assert integer and integer[0]["maximum"] == 8, (name, field)
    # Enforced: above the limit is a 400 naming max_tokens; no budget at all gets the limit.
    over = httpx.post(bounded_server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    unbounded = httpx.post(bounded_server.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "Count to fifty."}], "temperature": 0,
                                 "ignore_eos": True}, timeout=60)
    assert unbounded.status_code == 200 and unbounded.json()["usage"]["completion_tokens"] == 8
    summary = httpx.post(bounded_server.url + "/v1/summarize", json={"text": "A long text. " * 20}, timeout=60)
    assert summary.status_code == 200 and summary.json()["usage"]["completion_tokens"] <= 8


def test_schemathesis_finds_no_server_error_and_no_hang(bounded_server, tmp_path):
    report = run_schemathesis(bounded_server.url, tmp_path / "fuzz.json", max_examples=3, phases="examples,fuzzing",
                              request_timeout=60, seed=20261125, timeout=600, quiet=True)
    assert report["exit_code"] == 0 and not report["failures"] and not report["errors"], report.get("output")
    assert report["operations"]["tested"] == report["operations"]["selected"] >= 14
    assert report["test_cases"]["generated"] >= 2 * report["operations"]["tested"]  # not vacuous
