"""Request schemas (pydantic v2) of the OpenAI-compatible and task endpoints.

Unknown fields are rejected (``extra="forbid"``): a parameter Parrot does not know gets a 400
that names it, never silent ignoring. OpenAI parameters Parrot knows but does not implement are
accepted by the schema only to be rejected by ``unsupported()`` with a clearer message, unless
they carry their neutral value (``tools: []``, ``store: false``, ...).

``max_tokens``: every request's ``token_limit`` is the one place that gives its default, and
returns None for "no limit but the context window" (which ``check_context`` in
:mod:`parrot.server.routes.generation` turns into the room left after the prompt). Left out, it is 16
for /v1/completions (OpenAI's default; an explicit null there means no limit, and 0, with
``echo``, the prompt only), no limit for
/v1/chat/completions (OpenAI's), 256 for /v1/summarize, and room for a copy of the text for
/v1/correct.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from parrot.server.errors import APIError


# Marks the fields that bound a completion's tokens in the OpenAPI schema, where the server's
# ``server.max_completion_tokens`` (when set) becomes their ``maximum`` (``parrot.server.app``).
COMPLETION_BUDGET: dict[str, Any] = {"x-completion-budget": True}


def valid_unicode(value: str) -> str:
    """``value`` unchanged, or ValueError naming the first lone surrogate (JSON allows "\\ud800",
    UTF-8 does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"lone surrogate U+{ord(value[exc.start]):04X} at offset {exc.start} has no UTF-8 encoding; "
            "send valid Unicode text"
        ) from None
    return value


def _check_unicode(value: Any) -> None:
    """Reject lone surrogates anywhere in a value."""
    if isinstance(value, str):
        valid_unicode(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


class SpeculationOptions(_Strict):
    """Parrot extension: per-request control of speculative decoding."""

    enabled: bool = True
    max_draft: int | None = Field(default=None, ge=0, le=64)
    fast_forward: bool = True
    session: bool = False  # draft from the tenant's earlier requests too (server.session_drafting)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type '{value}' are not supported: the served model reads text only")
        return value


class Prediction(_Strict):
    """OpenAI Predicted Outputs: text the output is expected to resemble (drafting context)."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# OpenAI parameters Parrot does not implement, with the value that means "not used".
_NEUTRAL: dict[str, Any] = {
    "functions": [],
    "function_call": "none",
    "audio": None,
    "modalities": ["text"],
    "reasoning_effort": None,
    "web_search_options": None,
    "store": False,
    "suffix": None,
    "service_tier": None,
}


class _GenerationFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's: requests share cached prompt blocks only with requests of the same salt (and tenant).
    cache_salt: str | None = Field(default=None, max_length=1024)
    metadata: dict[str, str] | None = None
    ignore_eos: bool = False
    speculation: SpeculationOptions | None = None
    prediction: Prediction | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # Structured output (grammar-constrained decoding).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Penalties (OpenAI's, and vLLM's repetition_penalty) and logit_bias: see SamplingParams.
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # vLLM: the logprob and rank of each prompt token after the first, and the top k there.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Known OpenAI parameters that Parrot does not implement (see _NEUTRAL).
    service_tier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Token ids (as strings, as JSON keys must be) to biases in [-100, 100], as OpenAI
        takes them; whether each id is in the vocabulary is checked against the model."""
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"invalid key {key!r}: logit_bias keys are token ids, like \"1234\"")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is {bias:g}; biases must be in [-100, 100]")
        return value

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token, bias) pairs; 400 for a token id outside the vocabulary."""
        pairs = tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())
        for token, _ in pairs:
            if token >= vocab_size:
                raise APIError(400, f"logit_bias names token {token}, outside the vocabulary (0..{vocab_size - 1})",
                               param="logit_bias", code="invalid_value")
        return pairs

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    def constraint(self) -> tuple[str, str, Any] | None:
        """(parameter, kind, spec) of the one output constraint, if any: json_schema, regex, choice, lark."""
        found: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                # Some clients send the schema along (instructor's JSON_SCHEMA mode): it is used.
                schema = rf.get("schema", {"type": "object"})
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format json_object's 'schema' must be an object",
                                   param="response_format", code="invalid_value")
                found.append(("response_format", "json_schema", schema))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(400, "response_format json_schema needs {'json_schema': {'name', 'schema'}}",
                                   param="response_format", code="invalid_value")
                found.append(("response_format", "json_schema", spec["schema"]))
            elif kind != "text":
                raise APIError(400, f"response_format type must be text, json_object or json_schema, not {kind!r}",
                               param="response_format", code="invalid_value")
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "lark")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, kind, value))
        if len(found) > 1:
            raise APIError(400, f"give one output constraint, not {len(found)} ({', '.join(f[0] for f in found)})",
                           param=found[1][0], code="invalid_value")
        return found[0] if found else None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> None:
        """Reject OpenAI parameters Parrot does not implement when they would change the output."""
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name, None)
            if value is None or value == neutral or (isinstance(value, (list, dict)) and not value):
                continue
            raise APIError(400, f"Parrot does not support '{name}'", param=name, code="unsupported_parameter")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "'prompt_logprobs' is not available when streaming (as in vLLM)", param="prompt_logprobs",
                           code="invalid_value")


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, json_schema_extra=COMPLETION_BUDGET)  # 0 only with echo: see unsupported()
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    # vLLM's: the tokenizer's own special tokens around a text prompt (the BOS of Llama 2, Mistral
    # and DeepSeek vocabularies, as llama.cpp adds it too; SmolLM2's adds none)
    add_special_tokens: bool = True

    def token_limit(self) -> int | None:
        """``max_tokens``: 16 when left out (OpenAI's default), no limit when null."""
        return self.max_tokens

    def unsupported(self) -> None:
        super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "Parrot does not support 'best_of' other than n", param="best_of", code="unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            # As vLLM: 0 is for scoring a prompt (echo with logprobs), and generates nothing.
            raise APIError(400, "'max_tokens' must be at least 1, or 0 with 'echo': true (the prompt only)",
                           param="max_tokens", code="invalid_value")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a string, token ids, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # arguments always follow the schema (a grammar constrains them)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What clients send back when they append an assistant message as they received it.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """role and content, and the tool fields when set, for the chat template."""
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra=COMPLETION_BUDGET)
    max_completion_tokens: int | None = Field(default=None, ge=1, json_schema_extra=COMPLETION_BUDGET)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    store: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs", code="invalid_value")

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name), else ``max_tokens``, else no limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_use(self) -> tuple[list[FunctionDefinition], bool] | None:
        """(the functions the answer may call, whether it must call one), or None when it may
        not call any: no tools, or ``tool_choice: "none"`` (the prompt then shows no tools).
        400 for a ``tool_choice`` that names no tool given."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
            return None
        functions = [t.function for t in self.tools]
        names = [f.name for f in functions]
        if len(set(names)) < len(names):
            raise APIError(400, "tool function names must be unique", param="tools", code="invalid_value")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in 'tools'",
                               param="tool_choice", code="invalid_value")
            return [f for f in functions if f.name == choice.function.name], True
        return functions, choice == "required"

    def constraint(self) -> tuple[str, str, Any] | None:
        """The one output constraint: tool calls (see ``parrot.constrain.tools``), or the parent's."""
        found = super().constraint()
        use = self.tool_use()
        if use is None:
            return found
        if found is not None:
            raise APIError(400, f"give tools or an output constraint, not both ({found[0]})", param=found[0],
                           code="invalid_value")
        functions, required = use
        # A named function is called once (as OpenAI does); otherwise parallel_tool_calls says.
        named = isinstance(self.tool_choice, NamedToolChoice)
        parallel = self.parallel_tool_calls is not False and not named
        functions_spec = [f.model_dump(exclude_none=True) for f in functions]
        return ("tools", "tools", {"functions": functions_spec, "required": required, "parallel": parallel})


class SummarizeRequest(_Strict):
    text: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra=COMPLETION_BUDGET)
    style: Literal["sentences", "bullets"] = "sentences"
    max_input_tokens: int | None = Field(default=None, ge=1)
    model: str | None = None
    speculation: SpeculationOptions | None = None

    def token_limit(self) -> int:
        """``max_tokens``, or 256 when it is left out or null."""
        return self.max_tokens if self.max_tokens is not None else 256


class CorrectRequest(_Strict):
    text: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra=COMPLETION_BUDGET)
    model: str | None = None
    speculation: SpeculationOptions | None = None

    def token_limit(self, text_tokens: int, room: int) -> int | None:
        """``max_tokens``, or else room for a copy of the text (a correction is about as long as
        its input: twice its ``text_tokens`` plus 32) within the ``room`` the context window has
        left; no limit when no room is left (``check_context`` then says so)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return min(2 * text_tokens + 32, room) if room > 0 else None
