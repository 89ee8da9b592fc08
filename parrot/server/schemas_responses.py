"""Request schema of OpenAI's Responses API (``POST /v1/responses``), as a chat request.

Parrot serves what ``client.responses.create`` sends for text, structured output and function
tools: ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items),
after the conversation of ``previous_response_id`` when given (responses are stored unless
``store`` is false; ``parrot/server/routes/responses.py``). ``as_chat`` turns the request into the
equivalent ``ChatCompletionRequest``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from parrot.server.errors import APIError, validation_error_of
from parrot.server.schemas import COMPLETION_BUDGET, ChatCompletionRequest, SpeculationOptions, _Strict


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, json_schema_extra=COMPLETION_BUDGET)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    speculation: SpeculationOptions | None = None  # Parrot's extension, as on chat
    cache_salt: str | None = Field(default=None, max_length=1024)  # vLLM's, as on chat

    def as_chat(self, previous: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat request that asks for the same answer; 400 for what Parrot cannot serve.
        ``previous``: the chat messages of the conversation ``previous_response_id`` names (its
        instructions are not carried over, as OpenAI does)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [dict(m) for m in previous or []]
        for item in [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not messages:
            raise APIError(400, "'input' must not be empty", param="input", code="invalid_value")
        fields: dict[str, Any] = {
            "messages": messages, "model": self.model, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user, "metadata": self.metadata, "speculation": self.speculation, "cache_salt": self.cache_salt,
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif text_format is not None and text_format.type == "json_schema":
            if text_format.json_schema is None:
                raise APIError(400, "text.format of type json_schema needs a 'schema'", param="text.format.schema",
                               code="missing_required_parameter")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name or "response", "schema": text_format.json_schema,
                "strict": text_format.strict}}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:  # the same checks as chat's, said about this request
            raise validation_error_of(exc.errors()) from None
