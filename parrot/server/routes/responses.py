"""OpenAI's Responses API, ``POST /v1/responses``: the chat machinery with Responses' shapes.

The request becomes a chat request (``ResponsesRequest.as_chat``), so prompts, budgets,
structured output, tool grammars and speculation are chat's. The answer is one response object
whose ``output`` holds a ``message`` item (``output_text``) or ``function_call`` items; streamed,
it is Responses' typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.delta`` ... ``response.completed``), each an SSE ``event:``
line and a ``data:`` line with a ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from parrot.engine.engine import StepOutput
from parrot.server.errors import APIError
from parrot.server.routes.generation import (
    Choice,
    Constraint,
    cache_salt,
    collect,
    new_id,
    remember,
    session_of,
    stream_outputs,
    usage,
)
from parrot.server.routes.openai_api import (
    chat_prompt,
    generation_requests,
    ready,
    truncate_prompt,
)
from parrot.server.schemas import ChatCompletionRequest
from parrot.server.schemas_responses import ResponsesRequest
from parrot.server.sessions import tenant_key
from parrot.server.state import state_of
from parrot.constrain.tools import ToolCall, ToolCallReader, calls_complete, read_tool_calls

router = APIRouter()

PATH = "/v1/responses"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _Response:
    """The response object of one request, filled in as the answer comes."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int, constraint: Constraint | None,
                 store: bool) -> None:
        self.body = body
        self.store = store
        self.constraint = constraint  # a JSON schema's check of the finished answer goes in ``schema_check``
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = new_id("resp").replace("-", "_")
        self.created = int(time.time())

    def object(self, status: str, output: list[dict[str, Any]], choice: Choice | None) -> dict[str, Any]:
        body = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": self.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": {"type": "text"}} if body.text is None or body.text.format is None
            else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": "auto" if body.tool_choice is None else (
                body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
            "usage": None if choice is None else self.usage(choice),
            **(self.constraint.report([choice]) if self.constraint is not None and choice is not None else {}),
        }

    def usage(self, choice: Choice) -> dict[str, Any]:
        counts = usage(self.prompt_tokens, [choice], None)
        return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": counts["prompt_tokens_details"],
                "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counts["total_tokens"], "speculation": counts["speculation"]}


def _conversation(chat: ChatCompletionRequest, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a request's conversation, without its instructions (which a request
    continuing it does not inherit)."""
    messages = [m.as_dict() for m in chat.messages]
    return messages[1:] if body.instructions else messages


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages that render them: the message's text, or one assistant
    turn with every function call (under the call ids the client was given)."""
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": "", "tool_calls": calls}]
    text = "".join(part.get("text", "") for item in output if item["type"] == "message" for part in item["content"])
    return [{"role": "assistant", "content": text}]


def _status(choice: Choice, calls: list[ToolCall] | None = None) -> str:
    """incomplete when max_output_tokens ran out, unless the answer is calls that are all complete
    (a later call it cut off is left out: ``ToolCallReader``)."""
    if choice.finish_reason == "length" and not calls_complete(calls or []):
        return "incomplete"
    return "completed"


def _output(choice: Choice, tools: bool) -> tuple[str, list[dict[str, Any]]]:
    """The status and output items of a finished answer: its tool calls, or one message."""
    content, calls = read_tool_calls(choice.text) if tools else (choice.text, [])
    status = _status(choice, calls)
    if calls:
        return status, [_function_call(_item_id("fc"), _item_id("call"), c.name, c.arguments,
                                       "completed" if c.complete else "incomplete") for c in calls]
    return status, [_message(_item_id("msg"), content or "", status)]


@router.post(PATH, response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | StreamingResponse:
    stored = state_of(request).responses
    assert stored is not None
    owner = tenant_key(request.headers.get("authorization", ""), None) or ""  # the API key's hash
    previous = None
    if body.previous_response_id is not None:
        previous = stored.get(body.previous_response_id, owner)
        if previous is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
    chat = body.as_chat(previous)
    state, loaded = ready(request, chat)
    store = body.store is not False and state.config.server.stored_responses > 0

    def keep(output: list[dict[str, Any]]) -> None:
        """Store the conversation with this answer, for a later previous_response_id."""
        if store:
            stored.put(response.id, owner, _conversation(chat, body) + _as_messages(output))

    ids, tools = chat_prompt(loaded, chat)
    ids = truncate_prompt(ids, chat)
    tenant = session_of(state, request, chat)
    session = state.sessions.context(tenant) if tenant is not None and state.sessions is not None else []
    requests, _, constraint = await generation_requests(state, loaded, chat, [ids], "input", None, None, session,
                                                        cache_salt(request, chat.user, chat.cache_salt))
    response = _Response(body, loaded.name, len(ids), constraint, store)
    headers = constraint.headers() if constraint is not None else {}
    if not body.stream:
        choice = (await collect(state, request, requests, PATH))[0]
        remember(state, tenant, [ids], [choice])
        status, output = _output(choice, tools)
        keep(output)
        return JSONResponse(response.object(status, output, choice), headers=headers)
    choices, outputs = await stream_outputs(state, requests, PATH)
    events = _Events(response, tools)

    async def stream() -> AsyncIterator[str]:
        try:
            for event in events.start():
                yield event
            async for choice, out in outputs:
                for event in events.add(choice, out):
                    yield event
            remember(state, tenant, [ids], choices)
            keep(events.output)
        except APIError as exc:  # after the stream started: an error event, as chat sends one
            yield _sse("error", {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param})

    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def _sse(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Events:
    """Responses' stream events for one answer, from the engine's outputs."""

    def __init__(self, response: _Response, tools: bool) -> None:
        self.response = response
        self.reader = ToolCallReader() if tools else None
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items, completed or in progress
        self.text = ""  # of the message item, once there is one

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _sse(kind, payload)

    def start(self) -> Iterator[str]:
        opening = self.response.object("in_progress", [], None)
        yield self._event("response.created", response=opening)
        yield self._event("response.in_progress", response=opening)

    def add(self, choice: Choice, out: StepOutput) -> Iterator[str]:
        if self.reader is None:
            yield from self._text(out.text)
        else:
            content, calls = self.reader.feed(out.text, final=out.finished)
            yield from self._text(content)
            for index, name, piece in calls:
                yield from self._call(index, name, piece)
        if out.finished:
            yield from self._finish(choice)

    def _open_message(self) -> Iterator[str]:
        item = _message(_item_id("msg"), "", "in_progress")
        item["content"] = []
        self.output.append(item)
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _text(self, text: str) -> Iterator[str]:
        if not text:
            return
        if not self.output:
            yield from self._open_message()
        self.text += text
        yield self._event("response.output_text.delta", item_id=self.output[0]["id"], output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def _call(self, index: int, name: str | None, piece: str) -> Iterator[str]:
        if name is not None:  # a new call: the one before it is complete
            if self.output:
                yield from self._call_done(len(self.output) - 1, "completed")
            item = _function_call(_item_id("fc"), _item_id("call"), name, "", "in_progress")
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=index, item=item)
        if piece:
            item = self.output[index]
            item["arguments"] += piece
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=piece)

    def _call_done(self, index: int, status: str) -> Iterator[str]:
        item = self.output[index]
        item["status"] = status
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _finish(self, choice: Choice) -> Iterator[str]:
        status = _status(choice, self.reader.calls if self.reader is not None else None)
        if not self.output:  # an empty answer is still a message
            yield from self._open_message()
        last = self.output[-1]
        if last["type"] == "function_call":
            yield from self._call_done(len(self.output) - 1, status)
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            last.update(status=status, content=[part])
            yield self._event("response.output_text.done", item_id=last["id"], output_index=0, content_index=0,
                              text=self.text, logprobs=[])
            yield self._event("response.content_part.done", item_id=last["id"], output_index=0, content_index=0,
                              part=part)
            yield self._event("response.output_item.done", output_index=0, item=last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=self.response.object(status, self.output, choice))
