"""Request schemas of the token endpoints (/v1/tokenize, /v1/detokenize, /v1/tokens/*).

Unknown fields are rejected (``extra="forbid"``), integers are strict (``true``, ``1.5`` and
``"10"`` are not token counts), budgets are at least 1, and texts must be valid Unicode: a JSON
string may escape a lone surrogate (``"\\ud800"``), which has no UTF-8 encoding and so no tokens;
it gets a 400 naming the field and the offset instead of failing deep in the tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict, field_validator

from parrot.server.schemas import ChatMessage, _Strict, valid_unicode

StrictInt = Annotated[int, Strict()]
Budget = Annotated[int, Strict(), Field(ge=1)]


class TokenizeRequest(_Strict):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: True for a prompt, False for messages (the chat template adds what the model
    # needs). The tokenizer's post-processor adds them; SmolLM2's adds none, so with either value the
    # ids are those /v1/completions (which never adds any) feeds the model.
    add_special_tokens: bool | None = None
    # vLLM: True; messages only.
    add_generation_prompt: bool | None = None
    # vLLM's prefill of the last assistant message: not implemented (400 when true).
    continue_final_message: bool = False
    return_token_strs: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_unicode(cls, value: str | None) -> str | None:
        return None if value is None else valid_unicode(value)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


class _Text(_Strict):
    model: str | None = None
    text: str

    @field_validator("text")
    @classmethod
    def _text_unicode(cls, value: str) -> str:
        return valid_unicode(value)


class CountRequest(_Text):
    # Character ranges [start, end) of `text` (Python string offsets: code points).
    ranges: list[tuple[StrictInt, StrictInt]] | None = None


class TruncateRequest(_Text):
    max_tokens: Budget
    # The side that is cut: "right" keeps the beginning, "left" keeps the end.
    side: Literal["left", "right"] = "right"


class ChunkRequest(_Text):
    max_tokens: Budget
