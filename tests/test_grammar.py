"""Grammar-constrained output: validity, canonical fast-forward, exactness with speculation."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from parrot.engine.engine import GenerationRequest, SpeculationParams
from parrot.engine.sampling import SamplingParams
from parrot.constrain.grammar import GrammarCompiler, GrammarError, canonical_prefix

pytestmark = pytest.mark.real_model

ARTICLE = (
    "Marie Curie and Pierre Curie shared the 1903 Nobel Prize in Physics with Henri Becquerel. "
    "The prize was announced in Stockholm. Marie Curie later won the 1911 Nobel Prize in Chemistry "
    "in Paris, becoming the first person to win two Nobel Prizes."
)

# 32 schemas: nested objects, arrays with min/max items, enums, bounded numbers and integers,
# string patterns, optional and required fields. Every number is bounded (maximum, multipleOf):
# an unbounded JSON number lets this 135M model write "1000000..." until max_tokens, greedy or
# sampled (valid so far, but unfinished), which is the model's failure, not the grammar's.
S = {"type": "string", "maxLength": 40}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1800, "maximum": 2100}}, "required": ["year"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}, "required": ["score"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"kind": {"enum": ["physics", "chemistry", "peace"]}}, "required": ["kind"]},
    {"type": "object", "properties": {"people": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["people"]},
    {"type": "object", "properties": {"years": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3000}, "minItems": 2, "maxItems": 2}},
     "required": ["years"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": S, "last": S},
                                                 "required": ["first", "last"], "additionalProperties": False}},
     "required": ["person"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"name": S, "nickname": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 10}, "unit": {"enum": ["people", "prizes"]}},
     "required": ["count", "unit"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1900, "maximum": 1950}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["Marie", "Pierre", "Henri"]}, "minItems": 2, "maxItems": 3},
    {"enum": ["yes", "no", "unknown"]},
    {"type": "string", "maxLength": 30},
    {"type": "integer", "minimum": 1, "maximum": 5},
    {"type": "boolean"},
    {"type": "object", "properties": {"prizes": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"year": {"type": "integer", "minimum": 0, "maximum": 3000}, "field": {"enum": ["Physics", "Chemistry"]}},
        "required": ["year", "field"], "additionalProperties": False}}}, "required": ["prizes"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 3000}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"title": S, "tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                                          "maxItems": 3}}, "required": ["title", "tags"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.001},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.001}}, "required": ["lat", "lon"]},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Stockholm", "Warsaw"]}, "country": S},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3000}, {"type": "string", "maxLength": 10}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"first_prize": {"type": "integer", "minimum": 1900, "maximum": 1910},
                                      "second_prize": {"type": "integer", "minimum": 1910, "maximum": 1920}},
     "required": ["first_prize", "second_prize"], "additionalProperties": False},
    {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 80}, "people_count": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["summary", "people_count"]},
    {"type": "object", "properties": {"names": {"type": "array", "items": S, "maxItems": 2}, "total": {"type": "integer", "minimum": 0, "maximum": 3000}},
     "required": ["names"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 0.1}}, "required": ["ratio"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["status", "items"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": S, "born": {"type": "integer", "minimum": 0, "maximum": 3000}},
                                                 "required": ["name"]}, "prize": {"enum": ["Nobel"]}},
     "required": ["person", "prize"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}, "n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 1000}},
     "required": ["id", "n"]},
]


@pytest.fixture(scope="module")
def compiler(embedded_transformers):
    tokenizer, _ = embedded_transformers
    return GrammarCompiler(tokenizer)


def _request(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _extract_messages(schema: dict) -> list[dict]:
    # The keys are the grammar's business (it forces them); the prompt only asks for JSON.
    return [{"role": "user", "content": f"Answer in JSON about this text.\n\n{ARTICLE}"}]


def _closed(schema):
    """Objects without extra keys (OpenAI's strict mode): otherwise a small model may go on
    inventing keys until max_tokens, a valid but unfinished output."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object":
        out.setdefault("additionalProperties", False)
    return out


def test_thirty_json_schemas_greedy_and_sampled_outputs_validate(http_server):
    assert len(SCHEMAS) >= 30
    forced = 0
    for i, schema in enumerate(map(_closed, SCHEMAS)):
        jsonschema.Draft202012Validator.check_schema(schema)
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
            body = {"messages": _extract_messages(schema), "max_tokens": 256, **sampling,
                    "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
            r = _request(http_server.url, body)
            text = r["choices"][0]["message"]["content"]
            assert r["choices"][0]["finish_reason"] == "stop", (i, sampling, text)
            jsonschema.validate(json.loads(text), schema)
            forced += r["usage"]["speculation"]["forced_tokens"]
    assert forced > 0


def test_json_object_regex_and_choice_constraints(http_server):
    # A free-form object: greedy, the embedded model may invent keys until max_tokens (a valid
    # prefix, finish_reason "length"); the frequency penalty users reach for lets it finish.
    r = _request(http_server.url, {"messages": _extract_messages({"type": "object"}), "temperature": 0, "max_tokens": 200,
                                   "frequency_penalty": 0.5, "response_format": {"type": "json_object"}})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = _request(http_server.url, {"messages": [{"role": "user", "content": "When was Marie Curie born?"}],
                                       "guided_regex": pattern, "max_tokens": 20, **sampling})
        assert re.fullmatch(pattern, r["choices"][0]["message"]["content"])
        r = _request(http_server.url, {"messages": [{"role": "user", "content": "Which field? " + ARTICLE}],
                                       "guided_choice": ["Physics", "Chemistry", "Peace"], "max_tokens": 10, **sampling})
        assert r["choices"][0]["message"]["content"] in ("Physics", "Chemistry", "Peace")
    r = httpx.post(http_server.url + "/v1/completions", json={
        "prompt": "The answer is", "max_tokens": 10, "temperature": 0,
        "guided_grammar": 'start: ("yes" | "no") "!"'}, timeout=60).json()
    assert r["choices"][0]["text"] in ("yes!", "no!")


def test_invalid_constraints_get_400_quoting_the_grammar_engine(http_server):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, "response_format"),
        ({"guided_regex": "[a-z"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]
    for extra, param in cases:
        r = httpx.post(http_server.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
    r = httpx.post(http_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "guided_regex": "[a-z"}, timeout=60)
    assert "unclosed character class" in r.json()["error"]["message"]


def test_greedy_constrained_output_identical_with_and_without_drafting_and_fast_forward(embedded_engine, compiler):
    tokenizer = embedded_engine.tokenizer
    schema = {"type": "object", "properties": {
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 160}}, "required": ["people", "places", "summary"],
        "additionalProperties": False}
    text = compiler.compile("json_schema", schema)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Extract people, places and a summary as JSON.\n\n" + ARTICLE}])
    outputs, stats = {}, {}
    for drafting in (False, True):
        for fast_forward in (False, True):
            spec = SpeculationParams(enabled=drafting, fast_forward=fast_forward)
            result = embedded_engine.generate(GenerationRequest(
                ids, SamplingParams(max_tokens=200), spec, grammar=compiler.new_state(text, fast_forward)))
            outputs[drafting, fast_forward] = result.token_ids
            stats[drafting, fast_forward] = result.stats
    assert len(set(map(tuple, outputs.values()))) == 1
    jsonschema.validate(json.loads(tokenizer.decode(outputs[True, True])), schema)
    # Not vacuous: forced tokens and n-gram drafts were both used and accepted.
    assert stats[False, True].forced_tokens > 0 and stats[True, True].forced_tokens > 0
    assert stats[True, True].accepted_tokens > 0 and stats[True, False].accepted_tokens > 0
    assert stats[True, True].forward_passes < stats[False, False].forward_passes


def test_eight_concurrent_constrained_requests_with_speculation(http_server):
    # Closed and bounded, so that every sampled output ends well within max_tokens.
    schema = {**SCHEMAS[5], "additionalProperties": False}

    def one(i: int) -> httpx.Response:
        return httpx.post(http_server.url + "/v1/chat/completions", json={
            "messages": _extract_messages(schema), "max_tokens": 200, "temperature": 0.7, "seed": i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": schema}}}, timeout=300)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    for r in responses:
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


# Forced strings whose end falls inside a longer token of this vocabulary: forcing their last
# token would make a tokenization the model never saw in training.
def test_forced_tokens_back_off_when_the_forced_text_ends_mid_token(compiler):
    tokenizer = compiler.tokenizer
    # " wor" is not how " world" is tokenized: forcing "Hello wor" must stop before " wor".
    grammar = compiler.new_state(compiler.compile("regex", "Hello wor[a-z]+"))
    forced = grammar.forced_tokens()
    assert tokenizer.decode(forced) == "Hello"
    assert tokenizer.encode("Hello world")[: len(forced)] == forced
    # The full forced bytes re-encode differently from a naive tokenization of them.
    index = compiler.index
    naive = tokenizer.encode("Hello wor")
    assert canonical_prefix(naive, b"Hello wor", index) == forced


@pytest.mark.parametrize("pattern, sample", [
    (r'\{"name":"[a-z]+"\}', '{"name":"bob"}'),
    (r"The answer is: (yes|no)", "The answer is: yes"),
    (r"user_id=[0-9]+;", "user_id=12345;"),
    (r"https://example\.com/[a-z]+", "https://example.com/index"),
    (r"SELECT \* FROM [a-z]+ WHERE id = [0-9]+;", "SELECT * FROM users WHERE id = 7;"),
])
def test_every_forced_sequence_re_encodes_to_itself(compiler, pattern, sample):
    """Walk the grammar along the canonical encoding of a matching text: every forced sequence
    re-encodes to itself and agrees with how the tokenizer encodes the whole text."""
    tokenizer = compiler.tokenizer
    grammar = compiler.new_state(compiler.compile("regex", pattern))
    ids = tokenizer.encode(sample)
    i = forced_total = 0
    while i < len(ids):
        forced = grammar.forced_tokens()
        if forced:
            assert tokenizer.encode(tokenizer.decode(forced)) == forced
            assert ids[i : i + len(forced)] == forced, (tokenizer.decode(ids[i:]), tokenizer.decode(forced))
            grammar.consume(forced)
            i += len(forced)
            forced_total += len(forced)
        else:
            assert grammar.validate([ids[i]]) == 1
            grammar.consume([ids[i]])
            i += 1
    assert grammar.accepting
    assert forced_total > 0


def test_grammar_compiler_caches_and_rejects(compiler):
    a = compiler.compile("json_schema", SCHEMAS[0])
    assert compiler.compile("json_schema", json.dumps(SCHEMAS[0])) == a
    with pytest.raises(GrammarError, match="unclosed"):
        compiler.compile("regex", "(")


# Forced bytes that the canonical back-off leaves out are drafted, spelled the model's way.
TWO_KEYS = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10}, "b": {"type": "string", "maxLength": 10}},
            "required": ["a", "b"], "additionalProperties": False}


def test_held_back_forced_bytes_are_spelled_as_the_model_began_them_before(compiler):
    tokenizer = compiler.tokenizer
    grammar = compiler.new_state(compiler.compile("json_schema", TWO_KEYS))
    grammar.consume(grammar.forced_tokens())  # {"a
    # What is left of the forced bytes, in the tokenizer's spelling: one token.
    assert [tokenizer.decode([t]) for t in grammar.spelled_forced()] == ['":"']
    # Masks over a draft are not the model's choice: nothing is learned from them.
    grammar.masks(tokenizer.encode('":"'))
    # The model begins them with '":' (then '"'): next time the same bytes are spelled so.
    for piece in ['":', '"', "xyz", '",']:
        grammar.consume(tokenizer.encode(piece))
    grammar.consume(grammar.forced_tokens())  # "b
    assert [tokenizer.decode([t]) for t in grammar.spelled_forced()] == ['":', '"']


def _scripted_engine(tokenizer, prompt: str, output_pieces: list[str], drafting: bool = True):
    from parrot.config import DraftingConfig
    from parrot.engine.engine import Engine
    from loadtests.scripted import ScriptedForward

    prompt_ids = tokenizer.encode(prompt)
    output = [t for piece in output_pieces for t in tokenizer.encode(piece)]
    forward = ScriptedForward(prompt_ids + output, tokenizer.vocab_size, eos=min(tokenizer.eos_token_ids))
    cost = [0.0] + [1.0 + 0.05 * (t - 1) for t in range(1, 18)]
    return Engine(forward, tokenizer, DraftingConfig(enabled=drafting), cost), prompt_ids, output


@pytest.mark.parametrize("drafting", [False, True])
def test_spelled_forced_drafts_are_verified_and_accepted(compiler, drafting):
    """A model that writes '":' then '"' where the tokenizer would write '":"': the first spelled
    draft is rejected, the second (learned) one accepted; the output is the model's either way."""
    tokenizer = compiler.tokenizer
    engine, prompt, output = _scripted_engine(
        tokenizer, "Write JSON.", ['{"', "a", '":', '"', "xyz", '",', '"', "b", '":', '"', "uvw", '"}'], drafting)
    result = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=50), SpeculationParams(enabled=drafting),
                                               grammar=compiler.new_state(compiler.compile("json_schema", TWO_KEYS))))
    assert result.token_ids == output and result.finish_reason == "stop"
    assert result.stats.forced_tokens == 4  # {" a, then " b
    if drafting:
        assert result.stats.drafted_tokens >= 3 and result.stats.accepted_tokens >= 2
        assert result.stats.forward_passes < len(output) - result.stats.forced_tokens


def test_a_draft_that_completes_the_grammar_ends_the_output_there(compiler):
    """The prompt holds the answer, so one draft runs to the closing brace; the output stops at
    the grammar's end as in plain decoding, without the EOS the model is then made to write."""
    tokenizer = compiler.tokenizer
    answer = '{"a":"xyz","b":"uvw"}'
    results = {}
    for drafting in (False, True):
        engine, prompt, output = _scripted_engine(tokenizer, "Copy: " + answer, [answer], drafting)
        results[drafting] = engine.generate(GenerationRequest(
            prompt, SamplingParams(max_tokens=50), SpeculationParams(enabled=drafting),
            grammar=compiler.new_state(compiler.compile("json_schema", TWO_KEYS))))
        assert results[drafting].token_ids == output and results[drafting].finish_reason == "stop"
    # The first pass reads the prompt and yields the first token; the next drafts the rest.
    assert results[True].stats.accepted_tokens >= 3 and results[True].stats.forward_passes <= 3


def test_a_draft_never_carries_eos_past_the_end_of_the_grammar(compiler):
    """llguidance allows EOS where the grammar may end, but a complete grammar consumes nothing
    more: a draft that copies an answer and the EOS after it (a previous assistant turn, say)
    stops before the EOS, and the masks of its positions can be computed."""
    tokenizer = compiler.tokenizer
    eos = next(iter(tokenizer.eos_token_ids))
    answer = tokenizer.encode('{"a":"xyz","b":"uvw"}')
    grammar = compiler.new_state(compiler.compile("json_schema", TWO_KEYS))
    draft = answer + [eos]
    assert grammar.validate(draft) == len(answer)
    assert len(grammar.masks(answer)) == len(answer) + 1
    assert grammar.validate([eos]) == 0


@pytest.mark.parametrize("where", ["forced_tokens", "masks", "consume"])
def test_a_grammar_that_fails_mid_output_ends_its_request_alone(compiler, where):
    """llguidance can stop a parser mid-output (too complex, say). That request ends with an
    error of its own; another request in the same passes goes on to the same output as alone."""
    from parrot.constrain.grammar import GrammarError
    from parrot.engine.scheduler import Scheduler

    tokenizer = compiler.tokenizer
    engine, prompt, output = _scripted_engine(tokenizer, "Write JSON.", ['{"a":"xyz","b":"uvw"}'])
    grammar = compiler.new_state(compiler.compile("json_schema", TWO_KEYS))
    calls = {"n": 0}
    real = getattr(grammar, where)

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise GrammarError("Parser Error: too complex\n<state>...</state>")
        return real(*args)

    setattr(grammar, where, failing)
    failed = engine.start(GenerationRequest(prompt, SamplingParams(max_tokens=50), SpeculationParams(), grammar=grammar))
    other = engine.start(GenerationRequest(prompt, SamplingParams(max_tokens=50), SpeculationParams()))
    while not other.finished:
        engine.step([failed, other])
    assert calls["n"] >= 3
    assert failed.finish_reason == "error" and failed.cache is None
    assert str(failed.error) == "the output's grammar failed: Parser Error: too complex"
    assert other.output_ids == output + [min(tokenizer.eos_token_ids)] and other.finish_reason == "stop"

    # Served: the scheduler ends that request with its error and the other one as usual.
    engine, _, _ = _scripted_engine(tokenizer, "Write JSON.", ['{"a":"xyz","b":"uvw"}'])
    grammar = compiler.new_state(compiler.compile("json_schema", TWO_KEYS))
    calls["n"], real = 0, getattr(grammar, where)
    setattr(grammar, where, failing)
    scheduler = Scheduler(engine, max_running=2, max_queue=4)
    scheduler.start()

    async def both() -> tuple[Exception | None, list[int]]:
        bad = scheduler.submit(GenerationRequest(prompt, SamplingParams(max_tokens=50), SpeculationParams(), grammar=grammar))
        good = scheduler.submit(GenerationRequest(prompt, SamplingParams(max_tokens=50), SpeculationParams()))
        error, ids = None, []
        try:
            async for _ in bad.events():
                pass
        except Exception as exc:
            error = exc
        async for out in good.events():
            ids += out.token_ids
        return error, ids

    try:
        error, ids = asyncio.run(both())
    finally:
        scheduler.stop()
    assert str(error) == "the output's grammar failed: Parser Error: too complex"
    assert ids == output + [min(tokenizer.eos_token_ids)]
