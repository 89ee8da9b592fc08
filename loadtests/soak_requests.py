"""The soak's requests: a pool of valid request bodies, the malformed ones, and the fixed mix.

A *pool entry* is one valid generation request (chat or completions, one of the five tasks of
``../shared/data`` or a JSON schema of ``schemas.jsonl``, constrained or not, greedy or seeded,
drafting on or off) without its ``stream`` fields. The soak sends each entry alone first (its
sequential reference), then many times under load, streamed or not, and every answer must equal
that reference: greedy decoding and seeded sampling are deterministic whatever else shares the
forward pass.

Request ``i`` of the soak is drawn from a generator seeded by ``(seed, i)``, so the plan does not
depend on timing: a malformed request (``MALFORMED``), a pool entry cancelled mid-stream (the
client closes the connection after a few text chunks) or before its answer (non-streamed), or a
pool entry run to the end, streamed or not.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loadtests.load_workload import TASKS, load_prompts

Constraint = Literal["none", "json_schema", "json_object", "choice", "regex"]
Action = Literal["complete", "cancel_stream", "cancel_wait", "malformed"]

# Choice lists and regexes for constrained requests on the task prompts. The regexes use only
# syntax that Python's re and llguidance read alike, so the soak can check finished outputs.
CHOICES = (["yes", "no"], ["positive", "negative", "neutral"], ["A", "B", "C", "D"],
           ["correct", "incorrect", "unsure"], ["short answer", "long answer"])
REGEXES = (r"[A-Z][a-z]+( [a-z]+){2,8}\.", r"\d{4}-\d{2}-\d{2}", r"(yes|no), because [a-z ]{5,60}\.",
           r"[A-Za-z ,.']{10,160}", r"- [a-z]+(\n- [a-z]+){1,4}")


@dataclass(frozen=True)
class PoolEntry:
    """One valid request body (without ``stream``), compared against its sequential answer."""

    key: str
    task: str  # one of TASKS, or "schema" for the JSON schemas of schemas.jsonl
    endpoint: Literal["chat", "completions"]
    constraint: Constraint
    sampling: Literal["greedy", "seeded"]
    drafting: bool
    body: dict[str, Any] = field(hash=False)
    check: Any = field(default=None, hash=False)  # the choice list or the regex, to check outputs by

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass(frozen=True)
class Malformed:
    """A request that must be refused with a 4xx in OpenAI's error shape."""

    name: str
    path: str
    content: bytes
    method: str = "POST"
    content_type: str = "application/json"


def _chat(messages_text: str, **fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": messages_text}], "max_tokens": 8, **fields}).encode()


MALFORMED: tuple[Malformed, ...] = (
    Malformed("bad_json_truncated", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi'),
    Malformed("bad_json_trailing_comma", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}],}'),
    Malformed("body_not_object", "/v1/chat/completions", b"[1, 2, 3]"),
    Malformed("body_empty", "/v1/chat/completions", b""),
    Malformed("missing_messages", "/v1/chat/completions", b'{"max_tokens": 8}'),
    Malformed("messages_not_list", "/v1/chat/completions", b'{"messages": "hello", "max_tokens": 8}'),
    Malformed("max_tokens_string", "/v1/chat/completions", _chat("Hi", max_tokens="ten")),
    Malformed("max_tokens_negative", "/v1/chat/completions", _chat("Hi", max_tokens=-5)),
    Malformed("max_tokens_float", "/v1/chat/completions", _chat("Hi", max_tokens=7.5)),
    Malformed("temperature_string", "/v1/chat/completions", _chat("Hi", temperature="hot")),
    Malformed("temperature_out_of_range", "/v1/chat/completions", _chat("Hi", temperature=9)),
    Malformed("stream_not_bool", "/v1/chat/completions", _chat("Hi", stream="maybe")),
    Malformed("unknown_param", "/v1/chat/completions", _chat("Hi", frobnicate=True)),
    Malformed("unknown_nested_param", "/v1/chat/completions", _chat("Hi", speculation={"turbo": 1})),
    Malformed("unknown_role", "/v1/chat/completions",
              b'{"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 8}'),
    Malformed("unknown_model", "/v1/chat/completions", _chat("Hi", model="no-such-model")),
    Malformed("n_too_large", "/v1/chat/completions", _chat("Hi", n=1000)),
    Malformed("bad_regex", "/v1/chat/completions", _chat("Hi", guided_regex="([a-z")),
    Malformed("two_constraints", "/v1/chat/completions", _chat("Hi", guided_regex="[a-z]+", guided_choice=["a", "b"])),
    Malformed("guided_choice_not_list", "/v1/chat/completions", _chat("Hi", guided_choice="yes")),
    Malformed("invalid_schema", "/v1/chat/completions",
              _chat("Hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})),
    Malformed("response_format_unknown_type", "/v1/chat/completions", _chat("Hi", response_format={"type": "yaml"})),
    Malformed("logit_bias_bad_key", "/v1/chat/completions", _chat("Hi", logit_bias={"the": 5})),
    Malformed("stop_empty_string", "/v1/chat/completions", _chat("Hi", stop=[""])),
    Malformed("lone_surrogate", "/v1/chat/completions",
              b'{"messages": [{"role": "user", "content": "Hi \\ud800"}], "max_tokens": 8}'),
    Malformed("max_tokens_over_context", "/v1/chat/completions", _chat("Hi", max_tokens=10_000_000)),
    Malformed("completions_prompt_object", "/v1/completions", b'{"prompt": {"text": "Hi"}, "max_tokens": 8}'),
    Malformed("completions_token_out_of_vocab", "/v1/completions", b'{"prompt": [1, 2, 999999999], "max_tokens": 8}'),
    Malformed("unknown_endpoint", "/v1/chat/completion", _chat("Hi")),
    Malformed("wrong_method", "/v1/chat/completions", b"", method="GET"),
    Malformed("text_plain_body", "/v1/chat/completions", b"hello there", content_type="text/plain"),
)


def _schema_prompt(row: dict[str, Any]) -> str:
    schema = row["schema"]
    about = (schema.get("title") or schema.get("description") or row["id"]) if isinstance(schema, dict) else row["id"]
    return f"Write a realistic example JSON document: {str(about)[:200]}"


def candidate_entries(data_dir: Path, seed: int, max_tokens: int, max_prompt_chars: int) -> list[PoolEntry]:
    """An endless-enough, seeded list of candidate pool entries (the soak keeps the first ones
    that its server accepts: a schema refused with a 400 is not a valid request for this server).

    Mix of candidates: 60% a task prompt unconstrained (a fifth of them on /v1/completions), 12%
    a schema of schemas.jsonl as ``response_format`` json_schema, 6% ``json_object``, 11% a choice
    list, 11% a regex; 12% of all are seeded sampling (temperature 0.8, top_p 0.95) and 10% run
    with drafting off."""
    prompts = load_prompts(data_dir, list(TASKS), max_prompt_chars)
    schemas = [json.loads(line) for line in (data_dir / "schemas.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(f"soak-pool:{seed}")
    entries: list[PoolEntry] = []
    for index in range(2000):
        roll = rng.random()
        constraint: Constraint = ("none" if roll < 0.60 else "json_schema" if roll < 0.72 else
                                  "json_object" if roll < 0.78 else "choice" if roll < 0.89 else "regex")
        sampling = "seeded" if rng.random() < 0.12 else "greedy"
        drafting = rng.random() >= 0.10
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
        if sampling == "seeded":
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        if not drafting:
            body["speculation"] = {"enabled": False}
        check: Any = None
        if constraint == "json_schema":
            row = rng.choice(schemas)
            task, text = "schema", _schema_prompt(row)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": row["schema"]}}
        else:
            task = TASKS[rng.randrange(len(TASKS))]
            text = rng.choice(prompts[task]).text
            if constraint == "json_object":
                body["response_format"] = {"type": "json_object"}
            elif constraint == "choice":
                check = rng.choice(CHOICES)
                body["guided_choice"] = check
            elif constraint == "regex":
                check = rng.choice(REGEXES)
                body["guided_regex"] = check
        endpoint: Literal["chat", "completions"] = "completions" if constraint == "none" and rng.random() < 0.2 else "chat"
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        key = f"p{index}:{task}:{endpoint}:{constraint}:{sampling}{'' if drafting else ':nodraft'}"
        entries.append(PoolEntry(key, task, endpoint, constraint, sampling, drafting, body, check))
    return entries


@dataclass(frozen=True)
class Planned:
    """What request ``index`` of the soak does."""

    index: int
    action: Action
    entry: PoolEntry | None = None  # every action but "malformed"
    malformed: Malformed | None = None
    stream: bool = False
    cancel_after_chunks: int = 0  # cancel_stream: close the connection after this many text chunks
    cancel_after_s: float = 0.0  # cancel_wait: close the connection after this many seconds


def plan(index: int, pool: list[PoolEntry], seed: int) -> Planned:
    """Request ``index``: 12% malformed, 8% cancelled mid-stream, 3% cancelled before a
    non-streamed answer, the rest run to the end, half of them streamed."""
    rng = random.Random(f"soak:{seed}:{index}")
    roll = rng.random()
    if roll < 0.12:
        return Planned(index, "malformed", malformed=MALFORMED[rng.randrange(len(MALFORMED))])
    entry = pool[rng.randrange(len(pool))]
    if roll < 0.20:
        return Planned(index, "cancel_stream", entry, stream=True, cancel_after_chunks=rng.randint(1, 4))
    if roll < 0.23:
        return Planned(index, "cancel_wait", entry, cancel_after_s=rng.uniform(0.05, 1.5))
    return Planned(index, "complete", entry, stream=rng.random() < 0.5)
