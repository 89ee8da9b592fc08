"""Tool calls: the grammar of a call and reading calls back.

The format calls are written in (tags around compact JSON, name first) is
:mod:`parrot.tokenizer.tool_format`'s, which also renders tools for chat templates without tool
support. ``tool_grammar`` makes that format a grammar (llguidance Lark with an inline JSON schema
for each function's arguments), so arguments always parse and validate against their function's
schema, and the tokens the grammar leaves no choice about (the tags, the name after its first
letters, keys) are forced. With ``tool_choice: "auto"`` the grammar itself decides between text
and calls: an answer either starts with ``<tool_call>`` or is text whose first character is not
``<``. ``ToolCallReader`` reads the generated text back as content or calls, incrementally (for
streaming) or at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from parrot.tokenizer.tool_format import CLOSE, CLOSE_TAG, OPEN, OPEN_TAG


def tool_grammar(functions: list[dict[str, Any]], required: bool, parallel: bool,
                 tag_tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance Lark grammar of the answer: calls of ``functions`` (OpenAI function objects:
    name, parameters), one or (``parallel``) more; unless ``required``, text instead.

    Each function's parameters stay the root of their own inline JSON schema (``%json``), so that
    the schema's own references (``#/definitions/...``) resolve as written. ``tag_tokens``: the
    tags the vocabulary holds as one added token (Qwen2.5's ``<tool_call>`` is token 151657), by
    id (``GrammarCompiler.tag_tokens``). llguidance reads an added token as a special token, never
    as its text, so a tag written as text would refuse the model's own token for it (and force
    one the grammar then rejects)."""
    tags = tag_tokens or {}

    def tag(text: str) -> str:
        return f"<[{tags[text]}]>" if text in tags else json.dumps(text)

    rules = []
    for i, f in enumerate(functions):
        # Compact JSON: more of each call is forced, and a small model cannot wander off in
        # whitespace.
        schema = {**(f.get("parameters") or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
        head = f'{OPEN.removeprefix(OPEN_TAG)}{{"name":{json.dumps(f["name"])},"arguments":'
        tail = "}" + CLOSE.removesuffix(CLOSE_TAG)
        rules.append(f"call_{i}: {tag(OPEN_TAG)} {json.dumps(head)} %json {json.dumps(schema)} {json.dumps(tail)} "
                     f"{tag(CLOSE_TAG)}")
    lines = [
        "start: calls" if required else 'start: calls | TEXT | ""',
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        *rules,
    ]
    if not required:
        lines.append(r"TEXT: /[^<](.|\n)*/")
    return "\n".join(lines)


_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')
_TAIL = "}" + CLOSE


@dataclass
class ToolCall:
    name: str
    arguments: str = ""  # JSON text, as generated
    complete: bool = False


@dataclass
class ToolCallReader:
    """Reads generated text as content or tool calls. ``feed`` appends text and returns what it
    made sure of: (content, [(call index, name or None, arguments text)]) where a name comes
    once, when its call starts, and arguments in pieces. Text held back: up to the end of a
    call's arguments (which ``finish`` releases).

    Only the first call streams as it is written. A later one (parallel calls) is held back
    until it is complete, and one that the output ends inside (``max_tokens``) is left out:
    every call a client is given then parses, except a first call cut off, which it gets as
    OpenAI gives it, with ``finish_reason`` "length" (``calls_complete``)."""

    text: str = ""
    is_calls: bool | None = None  # None: undecided until the first character
    calls: list[ToolCall] = field(default_factory=list)
    _pos: int = 0  # of ``text``: what is read
    _in_arguments: bool = False
    _held: list[tuple[int, str | None, str]] = field(default_factory=list)  # events of a later call

    def feed(self, new: str, final: bool = False) -> tuple[str, list[tuple[int, str | None, str]]]:
        self.text += new
        if self.is_calls is None:
            if self.text.startswith(OPEN):
                self.is_calls = True
            elif final or not OPEN.startswith(self.text):
                self.is_calls = False
            else:  # nothing yet, or the start of the tag
                return "", []
        if not self.is_calls:
            content, self._pos = self.text[self._pos :], len(self.text)
            return content, []
        events = self._release(self._read_calls(final), final)
        if final and not self.calls:  # cut off before the first call's name: it is text after all
            self.is_calls = False
            return self.text, []
        return "", events

    def _release(self, events: list[tuple[int, str | None, str]], final: bool) -> list[tuple[int, str | None, str]]:
        """The events to give out now: the first call's as they come, a later call's once it is
        complete; at the end, a later call still open is dropped."""
        out = []
        for event in events:
            if event[0] == 0:
                out.append(event)
                continue
            self._held.append(event)
            if self.calls[event[0]].complete:
                out += self._held
                self._held = []
        if final and self._held:
            self._held = []
            self.calls = [c for c in self.calls if c.complete or c is self.calls[0]]
        return out

    def _read_calls(self, final: bool) -> list[tuple[int, str | None, str]]:
        events: list[tuple[int, str | None, str]] = []
        while True:
            if not self._in_arguments:
                rest = self.text[self._pos :]
                start = rest.find(OPEN)
                if start < 0:
                    return events
                head = _HEAD.match(rest, start + len(OPEN))
                if head is None:
                    return events
                self.calls.append(ToolCall(json.loads(head.group(1))))
                events.append((len(self.calls) - 1, self.calls[-1].name, ""))
                self._pos += head.end()
                self._in_arguments = True
            call = self.calls[-1]
            end = self.text.find(_TAIL, self._pos)
            if end < 0:
                # The arguments' last characters may be the closing brace and tag: hold them back.
                upto = len(self.text) if final else max(self._pos, len(self.text) - len(_TAIL))
                piece, self._pos = self.text[self._pos : upto], upto
                call.arguments += piece
                if piece:
                    events.append((len(self.calls) - 1, None, piece))
                return events
            piece = self.text[self._pos : end]
            call.arguments += piece
            call.complete = True
            if piece:
                events.append((len(self.calls) - 1, None, piece))
            self._pos = end + len(_TAIL)
            self._in_arguments = False


def calls_complete(calls: list[ToolCall]) -> bool:
    """Whether an answer of ``calls`` is whole although the output may have run out of tokens:
    every call it gives is complete (a later call cut off is left out, by ``ToolCallReader``)."""
    return bool(calls) and all(call.complete for call in calls)


def read_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer: content is the text when it holds no calls (a later
    call cut off is left out, as ``ToolCallReader`` leaves it)."""
    reader = ToolCallReader()
    reader.feed(text, final=True)
    return (None, reader.calls) if reader.calls else (text, [])
