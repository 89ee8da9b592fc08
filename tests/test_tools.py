"""Tool calls: the prompt and the grammar of a call (``parrot/constrain/tools.py``), reading calls back
whole or streamed, and the chat API with tools through the openai SDK on the embedded model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from parrot.constrain.tools import ToolCallReader, read_tool_calls, tool_grammar
from parrot.tokenizer.tool_format import call_text, tool_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TWO_CALLS = call_text("get_weather", '{"city":"Paris","unit":"celsius"}') + "\n" + call_text("get_time", '{"tz":"CET"}')


# -- reading calls back -------------------------------------------------------------------------


@pytest.mark.parametrize("text, content, calls", [
    (TWO_CALLS, None, [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", '{"tz":"CET"}')]),
    ("It is sunny.", "It is sunny.", []),
    ("", "", []),
    # Cut off (max_tokens) inside the arguments: the call so far; before the name: text.
    ('<tool_call>\n{"name":"get_time","arguments":{"tz":"C', None, [("get_time", '{"tz":"C')]),
    ('<tool_call>\n{"na', '<tool_call>\n{"na', []),
    # Cut off inside a later call: it is left out (never streamed), the complete ones stay.
    (TWO_CALLS[:-6], None, [("get_weather", '{"city":"Paris","unit":"celsius"}')]),
    (TWO_CALLS[: TWO_CALLS.index("get_time") + 3], None, [("get_weather", '{"city":"Paris","unit":"celsius"}')]),
    # A string value holding what looks like the end of a call is not the end (JSON escapes "\n").
    (call_text("get_time", '{"tz":"}\\n</tool_call>"}'), None, [("get_time", '{"tz":"}\\n</tool_call>"}')]),
])
def test_answers_read_as_content_or_calls_whole_and_streamed(text, content, calls):
    got_content, got_calls = read_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for size in (1, 3, 7):  # streamed in pieces: the same content, names and arguments
        reader = ToolCallReader()
        streamed_content, names, arguments = "", {}, {}
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        for i, piece in enumerate(pieces):
            more, events = reader.feed(piece, final=i == len(pieces) - 1)
            streamed_content += more
            for index, name, part in events:
                if name is not None:
                    assert index not in names  # a name comes once, first
                    names[index] = name
                arguments[index] = arguments.get(index, "") + part
        assert (streamed_content or None) == (content or None)
        assert [(names[i], arguments[i]) for i in sorted(names)] == calls


def test_tool_messages_for_a_template_without_tool_support():
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]
    rendered = tool_messages(messages, [WEATHER])
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == call_text("get_weather", '{"city":"Paris"}')
    assert rendered[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert tool_messages(ASK, [WEATHER])[0]["role"] == "system"  # a system message is made when none is given
    assert tool_messages(ASK, None) == ASK


# -- the grammar --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(embedded_tokenizer):
    from parrot.constrain.grammar import GrammarCompiler

    return GrammarCompiler(embedded_tokenizer)


@pytest.mark.parametrize("required, parallel", [(True, True), (True, False), (False, True), (False, False)])
def test_the_grammar_decides_between_text_and_calls(compiler, required, parallel):
    tokenizer = compiler.tokenizer
    text = compiler.compile("lark", tool_grammar([WEATHER["function"], TIME["function"]], required, parallel))
    calls = tokenizer.encode(TWO_CALLS)
    first = tokenizer.encode(TWO_CALLS.split("\n<tool_call>")[0])
    prose = tokenizer.encode("It is sunny in Paris.")
    assert compiler.new_state(text).validate(calls) == (len(calls) if parallel else len(first))
    assert compiler.new_state(text).validate(prose) == (0 if required else len(prose))
    # Arguments outside the schema (a unit it does not list) are refused where they go wrong.
    wrong = tokenizer.encode(call_text("get_weather", '{"city":"Paris","unit":"kelvin"}'))
    assert compiler.new_state(text).validate(wrong) < len(wrong)
    if required:  # the tags and the start of the call are forced
        assert tokenizer.decode(compiler.new_state(text).forced_tokens()).startswith('<tool_call>\n{"name":"get')


def test_tags_the_vocabulary_holds_as_added_tokens_are_that_token_in_the_grammar(embedded_tokenizer):
    """Qwen2.5's vocabulary holds ``<tool_call>`` and ``</tool_call>`` as added tokens, which
    llguidance reads as special tokens, never as their text. The embedded vocabulary with the two
    tags added stands in for it: the grammar takes the tags as those tokens, so the tokenizer's
    own spelling of calls is allowed and the forced start of a call is the tag's token (with the
    tags as text, llguidance forced that token and then refused it: a 500 on the 1.5B coder)."""
    import copy
    import dataclasses

    from tokenizers import AddedToken

    from parrot.constrain.grammar import GrammarCompiler

    hf = copy.deepcopy(embedded_tokenizer.hf)
    hf.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")])
    tokenizer = dataclasses.replace(embedded_tokenizer, hf=hf)
    compiler = GrammarCompiler(tokenizer)
    open_id, close_id = len(embedded_tokenizer.hf), len(embedded_tokenizer.hf) + 1
    assert compiler.tag_tokens == {"<tool_call>": open_id, "</tool_call>": close_id}
    calls = tokenizer.encode(TWO_CALLS)
    assert calls.count(open_id) == calls.count(close_id) == 2
    for required in (True, False):
        spec = {"functions": [WEATHER["function"], TIME["function"]], "required": required, "parallel": True}
        assert compiler.new_state(compiler.compile("tools", spec)).validate(calls) == len(calls)
    state = compiler.new_state(compiler.compile("tools", {**spec, "required": True}))
    forced = state.forced_tokens()
    assert forced[0] == open_id and tokenizer.decode(forced).startswith('<tool_call>\n{"name":"')
    state.consume(forced)
    # A grammar with the tag as text (a client's own Lark) still never forces what it refuses.
    text_state = compiler.new_state(compiler.compile("lark", 'start: "<tool_call>\\nx"'))
    forced = text_state.forced_tokens()
    assert open_id not in forced
    text_state.consume(forced)


# -- the API, on the embedded model ------------------------------------------------------------


@pytest.fixture(scope="module")
def client(http_server):
    return OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 80, **kwargs})


def _check_call(call, tools):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"


real_model = pytest.mark.real_model


@real_model
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice_answer_with_valid_calls(client, tool_choice):
    r = _chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], [WEATHER, TIME])
    if isinstance(tool_choice, dict):
        assert choice.message.tool_calls[0].function.name == "get_time"
    assert r.usage.model_extra["speculation"]["forced_tokens"] > 5  # tags, name and keys are forced


@real_model
def test_auto_and_none_tool_choice(client):
    auto = _chat(client, messages=ASK, tools=[WEATHER], max_tokens=40).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        for call in auto.message.tool_calls:
            _check_call(call, [WEATHER])
    else:
        assert auto.message.content and not auto.message.content.startswith("<")
    none = _chat(client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


@real_model
def test_streamed_tool_calls_equal_the_response(client):
    kwargs = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}
    whole = _chat(client, **kwargs).choices[0]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in _chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            if call.function.name:
                assert call.id.startswith("call_") and call.index not in names
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(names[i], arguments[i]) for i in sorted(names)] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@real_model
def test_a_conversation_with_tool_results_continues(client):
    first = _chat(client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message  # sent back as the SDK returned it
    messages = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees, sunny"}]
    r = _chat(client, messages=messages, tools=[WEATHER], max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


@real_model
def test_arguments_copying_the_prompt_are_drafted_and_exact(http_server):
    """A second save of a file the conversation already saved once: the call's arguments repeat
    the first call's, the drafter copies them from the prompt, so most argument tokens are
    accepted drafts, and the call is the same without drafting."""
    code = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
    edit = {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 40}, "content": {"type": "string"}},
        "required": ["path", "content"], "additionalProperties": False}}}
    saved = {"id": "call_1", "type": "function",
             "function": {"name": "write_file", "arguments": json.dumps({"path": "shapes.py", "content": code})}}
    messages = [{"role": "user", "content": f"Save this file as shapes.py:\n\n{code}"},
                {"role": "assistant", "content": None, "tool_calls": [saved]},
                {"role": "tool", "tool_call_id": "call_1", "content": "error: disk busy, try again"},
                {"role": "user", "content": "Try again."}]
    body = {"messages": messages, "tools": [edit], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 120}
    results = {}
    for enabled in (True, False):
        r = httpx.post(http_server.url + "/v1/chat/completions", json={**body, "speculation": {"enabled": enabled}},
                       timeout=300)
        assert r.status_code == 200, r.text
        results[enabled] = r.json()
    calls = {enabled: [c["function"] for c in r["choices"][0]["message"]["tool_calls"]] for enabled, r in results.items()}
    assert calls[True] == calls[False]
    assert "def perimeter(width, height):\n    return 2 * (width + height)" in json.loads(calls[True][0]["arguments"])["content"]
    on = results[True]
    spec = on["usage"]["speculation"]
    assert spec["accepted_tokens"] > 20 and spec["forward_passes"] < on["usage"]["completion_tokens"] / 2


def test_arguments_copying_a_file_are_drafted_from_its_json_escaped_view(compiler):
    """A call whose arguments copy a file the user sent writes it JSON-escaped (newlines as
    ``\\n``, quotes as ``\\"``), which the prompt's own tokens never match: the escaped view the
    API adds to the draft context (``escaped_context``) does. A scripted model writes the call;
    the output is the same either way, with far fewer passes with the view."""
    from loadtests.scripted import ScriptedForward
    from parrot.config import DraftingConfig
    from parrot.engine.engine import Engine, GenerationRequest, SpeculationParams
    from parrot.engine.sampling import SamplingParams
    from parrot.server.routes.generation import escaped_context

    tokenizer = compiler.tokenizer
    code = ('def greet(name):\n    """Say hello."""\n    print("Hello, " + name + "!")\n\n\n'
            'def shout(name):\n    print("HEY " + name.upper())\n')
    message = f"Save this file as greet.py:\n\n{code}"
    prompt = tokenizer.encode(message)
    output = tokenizer.encode(call_text("write_file", json.dumps({"path": "greet.py", "content": code},
                                                                  separators=(",", ":"))))
    tool = {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"],
        "additionalProperties": False}}
    grammar = compiler.compile("lark", tool_grammar([tool], required=True, parallel=False))
    results = {}
    for view in (False, True):
        forward = ScriptedForward(prompt + output, tokenizer.vocab_size, eos=min(tokenizer.eos_token_ids))
        engine = Engine(forward, tokenizer, DraftingConfig(), [0.0] + [1.0 + 0.05 * (t - 1) for t in range(1, 18)])
        context = escaped_context(tokenizer, [message]) if view else []
        results[view] = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=200), SpeculationParams(),
                                                          context, compiler.new_state(grammar)))
        assert results[view].token_ids == output
    with_view, without = results[True].stats, results[False].stats
    assert with_view.accepted_tokens > 2 * max(without.accepted_tokens, 10), (with_view, without)
    assert with_view.forward_passes < without.forward_passes / 2, (with_view, without)


BAD_TOOL_REQUESTS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
]


@real_model
@pytest.mark.parametrize("extra, param", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_get_openai_shaped_400s(http_server, extra, param):
    r = httpx.post(http_server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def _closed(schema):
    """Objects without extra keys (as OpenAI's strict mode requires them): otherwise a small model
    may go on inventing keys until max_tokens, a valid but unfinished call."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _schemas_table(limit: int) -> list[dict]:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "schemas.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/schemas.jsonl is not beside this checkout")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["schema"] for row in rows if row["schema"].get("type") == "object"][:limit]


@real_model
def test_arguments_validate_against_a_table_of_schemas(client):
    """Object schemas from ../shared/data/schemas.jsonl as function parameters (objects closed to
    extra keys), tool_choice required: every call that finished parses and validates. A call cut off by max_tokens (a
    small model writing an unbounded number or string) is counted, and must be the exception."""
    finished = cut = 0
    for i, schema in enumerate(map(_closed, _schemas_table(8))):
        tool = {"type": "function", "function": {"name": f"record_{i}", "parameters": schema}}
        r = _chat(client, messages=[{"role": "user", "content": "Fill in an example record."}], tools=[tool],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=120)
        choice = r.choices[0]
        if choice.finish_reason == "length":
            cut += 1
            continue
        assert choice.finish_reason == "tool_calls", choice
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema)
        finished += 1
    print(f"tool calls on {finished + cut} schemas: {finished} finished, {cut} cut off by max_tokens")
    assert finished >= 6, (finished, cut)


USER = {"type": "function", "function": {"name": "User", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


@real_model
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "User"}}, "required"])
def test_a_forced_call_is_one_valid_call_even_when_the_model_would_go_on(client, tool_choice, stream):
    """What instructor's TOOLS mode sends: the model, left to go on after its call, wrote a second
    one that max_tokens cut off (the answer had two calls, the second's arguments not JSON, and
    finish_reason "length"). A named function is called once; with "required" a later call cut
    off is left out. Either way: one call whose arguments validate, finish_reason "tool_calls"."""
    kwargs = {"messages": [{"role": "user", "content": "Jason is 25 years old."}], "tools": [USER],
              "tool_choice": tool_choice, "max_tokens": 60}
    if not stream:
        choice = _chat(client, **kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    else:
        chunks = list(_chat(client, stream=True, **kwargs))
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        pieces: dict[int, list] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                pieces.setdefault(d.index, []).append(d)
        calls = [type("Call", (), {"id": p[0].id, "type": "function", "function": type("F", (), {
            "name": p[0].function.name, "arguments": "".join(x.function.arguments or "" for x in p)})})
            for _, p in sorted(pieces.items())]
    assert finish == "tool_calls" and len(calls) >= 1
    for call in calls:
        _check_call(call, [USER])
    if isinstance(tool_choice, dict):
        assert len(calls) == 1


@real_model
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_responses_answer_of_complete_calls_is_completed(http_server, stream):
    """The same request through the Responses API: the later call max_output_tokens cut off is
    left out, and the response of one complete call is "completed", not "incomplete"."""
    client = OpenAI(base_url=http_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "Jason is 25 years old.", "temperature": 0,
              "max_output_tokens": 60, "tool_choice": "required",
              "tools": [{"type": "function", "name": "User", "parameters": USER["function"]["parameters"]}]}
    if stream:
        r = [e for e in client.responses.create(stream=True, **kwargs) if e.type.startswith("response.")][-1].response
    else:
        r = client.responses.create(**kwargs)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1 and all(c.status == "completed" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), USER["function"]["parameters"])
