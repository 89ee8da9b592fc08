"""Real-world JSON schemas are served, not refused: what the grammar cannot enforce is left out
(llguidance's lenient mode), every finished output is checked against the whole schema, and the
client is told both, ``strict: true`` or not; ``server.strict_schemas`` refuses such schemas."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from parrot.constrain.schema_check import SchemaCheck
from tests.conftest import start_server
from parrot.constrain.grammar import GrammarCompiler, GrammarError

SCHEMAS_FILE = Path(__file__).resolve().parents[2] / "shared" / "data" / "schemas.jsonl"

# Three keywords no grammar enforces, and an unknown format: served, then checked.
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3,
                 "uniqueItems": True},
        "name": {"type": "string", "maxLength": 12, "format": "vendor-name", "not": {"const": "x"}},
    },
    "required": ["tags", "name"],
    "additionalProperties": False,
}


def _chat(url: str, body: dict, **kwargs) -> httpx.Response:
    base = {"messages": [{"role": "user", "content": "Give two colour tags and a name, as JSON."}],
            "max_tokens": 60, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json={**base, **body}, timeout=120, **kwargs)


def _schema_format(schema: dict, strict: bool | None = None) -> dict:
    spec = {"name": "x", "schema": schema} if strict is None else {"name": "x", "schema": schema, "strict": strict}
    return {"type": "json_schema", "json_schema": spec}


def test_schema_check_validates_outputs_and_never_fetches_remote_refs():
    check = SchemaCheck(TAGS)
    assert check.check('{"tags":["red","blue"],"name":"ada"}') is None
    assert "non-unique" in check.check('{"tags":["red","red"],"name":"ada"}')
    assert "should not be valid" in check.check('{"tags":["red","blue"],"name":"x"}')
    assert check.check('{"tags":').startswith("not JSON")
    remote = SchemaCheck({"$ref": "https://example.invalid/schema.json"})
    assert "could not check" in remote.check("{}")
    with pytest.raises(ValueError, match="invalid at"):
        SchemaCheck({"type": "object", "properties": {"a": {"type": "wat"}}})
    with pytest.raises(ValueError, match="not JSON"):
        SchemaCheck("{nope")


@pytest.mark.real_model
def test_lenient_compilation_names_what_it_leaves_out(embedded_transformers):
    compiler = GrammarCompiler(embedded_transformers[0])
    with pytest.raises(GrammarError, match="uniqueItems"):
        compiler.compile("json_schema", TAGS)
    grammar = compiler.compile("json_schema", TAGS, lenient=True)
    unenforced = " ".join(compiler.unenforced(grammar))
    assert "uniqueItems" in unenforced and "not" in unenforced and "vendor-name" in unenforced
    strict = compiler.compile("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, lenient=True)
    assert compiler.unenforced(strict) == []


@pytest.mark.real_model
def test_a_schema_with_unenforceable_keywords_is_served_checked_and_reported(http_server):
    r = _chat(http_server.url, {"response_format": _schema_format(TAGS)})
    assert r.status_code == 200, r.text
    assert "uniqueItems" in r.headers["x-parrot-schema-unenforced"]
    body = r.json()
    report = body["schema_check"]
    assert any("uniqueItems" in w for w in report["unenforced"])
    [row] = report["choices"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the grammar bounds this output
    # The row says what a validator says of the output, whichever way it went.
    assert row["valid"] == (SchemaCheck(TAGS).check(choice["message"]["content"]) is None)
    assert row["valid"] or row["error"]


@pytest.mark.real_model
def test_streamed_answers_end_with_the_schema_check(http_server):
    with httpx.stream("POST", http_server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Give two colour tags and a name, as JSON."}],
            "max_tokens": 60, "temperature": 0, "stream": True, "response_format": _schema_format(TAGS)}) as r:
        assert r.status_code == 200 and "uniqueItems" in r.headers["x-parrot-schema-unenforced"]
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    [report] = [c["schema_check"] for c in chunks if "schema_check" in c]
    assert report["choices"][0]["valid"] == (SchemaCheck(TAGS).check(text) is None)


@pytest.mark.real_model
def test_strict_requests_are_served_and_strict_servers_refuse_what_cannot_be_enforced(http_server, embedded_engine):
    # strict: true (what the openai SDK's parse() sends) is served like any schema: the rest
    # enforced, the whole checked, what was not enforced said.
    r = _chat(http_server.url, {"response_format": _schema_format(TAGS, strict=True)})
    assert r.status_code == 200 and "uniqueItems" in r.headers["x-parrot-schema-unenforced"]
    assert any("uniqueItems" in keyword for keyword in r.json()["schema_check"]["unenforced"])
    # Unicode property classes in a pattern: enforced by the grammar, read by the check.
    letters = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^\\p{Lu}\\p{Ll}{1,8}$"}},
               "required": ["word"], "additionalProperties": False}
    r = _chat(http_server.url, {"response_format": _schema_format(letters, strict=True)})
    assert r.status_code == 200 and r.json()["schema_check"]["unenforced"] == [], r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert r.json()["schema_check"]["choices"][0]["valid"] is True
    # A schema the grammar enforces whole passes strict mode and reports nothing left out.
    whole = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = _chat(http_server.url, {"response_format": _schema_format(whole, strict=True)})
    assert r.status_code == 200 and "x-parrot-schema-unenforced" not in r.headers
    assert r.json()["schema_check"] == {"unenforced": [], "choices": [{"index": 0, "valid": True, "error": None}]}
    strict_server = start_server(embedded_engine, strict_schemas=True)
    try:
        r = _chat(strict_server.url, {"response_format": _schema_format(TAGS)})
        assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
        assert "server.strict_schemas" in r.json()["error"]["message"]
    finally:
        strict_server.stop()


@pytest.mark.real_model
def test_json_object_with_a_schema_uses_the_schema(http_server):
    """instructor's JSON_SCHEMA mode sends the schema inside a json_object response_format."""
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = _chat(http_server.url, {"messages": [{"role": "user", "content": "Jason is 25 years old."}],
                                "response_format": {"type": "json_object", "schema": person}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"name", "age"}
    assert r.json()["schema_check"]["choices"][0]["valid"] is True
    bad = _chat(http_server.url, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema"


@pytest.mark.real_model
@pytest.mark.skipif(not SCHEMAS_FILE.exists(), reason=f"{SCHEMAS_FILE} is not beside this work tree")
def test_every_real_world_schema_is_served_or_refused_with_a_400_never_a_5xx(http_server):
    """The 300 schemas of ``shared/data/schemas.jsonl`` through the API (a few tokens each: this
    is about compiling and answering, loadtests/schemas_survey.py runs them to the end)."""
    rows = [json.loads(line) for line in SCHEMAS_FILE.read_text().splitlines() if line.strip()]

    def send(row: dict) -> tuple[str, int, dict]:
        r = _chat(http_server.url, {"response_format": _schema_format(row["schema"]), "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "Answer in JSON."}]})
        return row["id"], r.status_code, r.json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, rows))
    statuses = {status for _, status, _ in results}
    assert statuses <= {200, 400}, [(i, s, b) for i, s, b in results if s not in (200, 400)]
    refused = [(i, b["error"]["message"]) for i, s, b in results if s == 400]
    assert all(b["error"]["code"] == "invalid_grammar" for _, s, b in results if s == 400), refused
    served = len(results) - len(refused)
    assert served >= 0.95 * len(rows), refused
    assert sum(bool(b["schema_check"]["unenforced"]) for _, s, b in results if s == 200) >= 30


@pytest.mark.parametrize("strict", [True, None])
def test_kubernetes_and_schemastore_schemas_are_served_strict_or_not(http_server, strict):
    """A second real-world set the project had not used (loadtests/package_schemas.py: the 84
    Kubernetes API objects of kubernetes-validate and the 26 SchemaStore schemas check-jsonschema
    vendors, up to 1.4 MB each) through the API, a few tokens each: 95% served, with
    ``strict: true`` (what the openai SDK's parse() sends) and without; never a 5xx.
    ``make survey-schemas SURVEY_ARGS="--set packages --strict absent,true"`` runs them to the end."""
    from loadtests.package_schemas import package_schemas

    rows = package_schemas()
    assert len(rows) >= 100, "kubernetes-validate and check-jsonschema are test dependencies"

    def send(row: dict) -> tuple[str, int, dict]:
        r = _chat(http_server.url, {"response_format": _schema_format(row["schema"], strict), "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "Answer in JSON."}]})
        return row["id"], r.status_code, r.json()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, rows))
    assert {status for _, status, _ in results} <= {200, 400}, [(i, s, b) for i, s, b in results if s not in (200, 400)]
    refused = [(i, b["error"]["message"][:200]) for i, s, b in results if s == 400]
    assert len(rows) - len(refused) >= 0.95 * len(rows), refused
