"""Token endpoints: exact counts for the served model, so that clients can budget before they send.

- ``POST /v1/tokenize`` and ``POST /v1/detokenize`` in vLLM's shapes (also served at vLLM's paths
  ``/tokenize`` and ``/detokenize``). ``tokens`` are the ids the model receives for that prompt
  (``/v1/completions``) or those messages (``/v1/chat/completions``).
- ``POST /v1/tokens/count``, ``/v1/tokens/truncate`` and ``/v1/tokens/chunk`` over one text, with
  character offsets (Python string indices, i.e. code points). Counts are exact: they equal the
  length of the text's own encoding (``Tokenizer.encode(text[start:end])``), which is not a slice
  of the whole text's tokens, since BPE merges across any cut. A cut never splits a code point.

Characters whose bytes have no token in the vocabulary (such as ``'\\x04'``) reach the model as
nothing, or merge their neighbours: every response says where they are (``lost_characters``,
offsets into the request's text; for ``messages``, ``[message index, offset in its content]``
pairs), so that no text vanishes silently. The work runs on a worker thread: a megabyte of text
never blocks the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from parrot.engine.backend import LoadedModel
from parrot.server.errors import APIError
from parrot.server.routes.generation import check_model
from parrot.server.schemas import ChatCompletionRequest, valid_unicode
from parrot.server.schemas_tokens import (
    ChunkRequest,
    CountRequest,
    DetokenizeRequest,
    TokenizeRequest,
    TruncateRequest,
)
from parrot.server.state import state_of
from parrot.tokenizer import TokenBudget, Tokenizer

router = APIRouter()

T = TypeVar("T")


def _loaded(request: Request, model: str | None) -> LoadedModel:
    loaded, _ = state_of(request).require_ready()
    check_model(loaded, model)
    return loaded


async def _off_loop(work: Callable[[], T]) -> T:
    """Run tokenizer work on a worker thread (the budget and the tokenizer are shared safely)."""
    return await asyncio.to_thread(work)


# -- vLLM's tokenize / detokenize -------------------------------------------------------------


@router.post("/v1/tokenize")
@router.post("/tokenize", include_in_schema=False)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """``{"prompt"}`` or ``{"messages", "add_generation_prompt"?}`` -> ``{"count", "max_model_len",
    "tokens", "token_strs", "lost_characters"}``."""
    loaded = _loaded(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either 'prompt' or 'messages'", param="prompt" if body.prompt is None else "messages",
                       code="invalid_value")
    if body.continue_final_message:
        raise APIError(400, "Parrot does not support 'continue_final_message'", param="continue_final_message",
                       code="unsupported_parameter")
    tokenizer = loaded.tokenizer
    encode = _prompt_encoder(body, tokenizer) if body.prompt is not None else _chat_encoder(body, tokenizer)

    def work() -> dict[str, Any]:
        ids, lost = encode()
        return {
            "count": len(ids),
            "max_model_len": loaded.context_window,
            "tokens": ids,
            "token_strs": tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None,
            "lost_characters": lost,
        }

    return await _off_loop(work)


Encoder = Callable[[], tuple[list[int], list[Any]]]


def _prompt_encoder(body: TokenizeRequest, tokenizer: Tokenizer) -> Encoder:
    """The ids /v1/completions feeds the model for this prompt, and the lost characters' offsets."""
    prompt = body.prompt
    assert prompt is not None
    if body.add_generation_prompt is not None:
        raise APIError(400, "'add_generation_prompt' applies to 'messages', not to 'prompt'",
                       param="add_generation_prompt", code="invalid_value")
    add_special = True if body.add_special_tokens is None else body.add_special_tokens

    def encode() -> tuple[list[int], list[Any]]:
        ids = list(tokenizer.hf.encode(prompt, add_special_tokens=add_special))
        return ids, tokenizer.lost_characters(prompt)

    return encode


def _chat_encoder(body: TokenizeRequest, tokenizer: Tokenizer) -> Encoder:
    """The ids /v1/chat/completions feeds the model for these messages, and [message, offset] pairs
    of the lost characters."""
    assert body.messages is not None
    # The same conversion as /v1/chat/completions (roles, content parts), so the ids are the same.
    chat = ChatCompletionRequest.model_construct(messages=body.messages).chat()
    for i, m in enumerate(chat):
        try:
            valid_unicode(m["content"])
        except ValueError as exc:
            raise APIError(400, f"invalid value for 'messages[{i}].content': {exc}", param=f"messages[{i}].content",
                           code="invalid_value") from None
    add_generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt

    def encode() -> tuple[list[int], list[Any]]:
        try:
            rendered = tokenizer.render_chat(chat, add_generation_prompt)
        except Exception as exc:  # the template raised: say what it said
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages",
                           code="invalid_value") from None
        ids = list(tokenizer.hf.encode(rendered, add_special_tokens=bool(body.add_special_tokens)))
        lost = [[i, offset] for i, m in enumerate(chat) for offset in tokenizer.lost_characters(m["content"])]
        return ids, lost

    return encode


@router.post("/v1/detokenize")
@router.post("/detokenize", include_in_schema=False)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """``{"tokens"}`` -> ``{"prompt"}``: the text of those ids, special tokens written out (so that
    detokenizing what /v1/tokenize gave for messages yields the rendered chat prompt)."""
    loaded = _loaded(request, body.model)
    tokenizer = loaded.tokenizer
    vocab = tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise APIError(400, f"token id {token} at tokens[{i}] is outside the vocabulary (0..{vocab - 1})",
                           param="tokens", code="invalid_value")
    text = await _off_loop(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
    return {"prompt": text}


# -- exact budgeting over one text ------------------------------------------------------------


def _budget(request: Request, model: str | None) -> TokenBudget:
    return _loaded(request, model).tokenizer.budget


@router.post("/v1/tokens/count")
async def count_tokens(body: CountRequest, request: Request) -> dict[str, Any]:
    """``{"text", "ranges"?}`` -> ``{"count", "ranges": [{"start", "end", "count"}], "lost_characters"}``;
    each range's count is that of ``text[start:end]`` encoded on its own."""
    budget = _budget(request, body.model)
    text, ranges = body.text, body.ranges or []
    for i, (start, end) in enumerate(ranges):
        if not 0 <= start <= end <= len(text):
            why = "start > end" if start > end else f"outside the text (length {len(text)})"
            raise APIError(400, f"range [{start}, {end}] at ranges[{i}] is {why}", param=f"ranges[{i}]",
                           code="invalid_value")

    def work() -> dict[str, Any]:
        if not ranges:
            return {"count": budget.count(text), "ranges": [], "lost_characters": budget.lost_characters(text)}
        counter = budget.interval_counter(text)
        return {
            "count": counter.total,
            "ranges": [{"start": s, "end": e, "count": counter.count(s, e)} for s, e in ranges],
            "lost_characters": budget.lost_characters(text),
        }

    return await _off_loop(work)


@router.post("/v1/tokens/truncate")
async def truncate_text(body: TruncateRequest, request: Request) -> dict[str, Any]:
    """``{"text", "max_tokens", "side"?}`` -> the longest part of the text within ``max_tokens``
    (``side`` is the side cut: "right" keeps ``text[:offset]``, "left" keeps ``text[offset:]``):
    ``{"text", "count", "offset", "side", "truncated", "original_characters", "kept_characters",
    "lost_characters"}``; ``count`` is the kept text's exact token count."""
    budget = _budget(request, body.model)
    text = body.text

    def work() -> dict[str, Any]:
        kept = budget.truncate(text, body.max_tokens, side=body.side)
        return {
            "text": kept.text,
            "count": kept.count,
            "offset": kept.offset,
            "side": kept.side,
            "truncated": kept.truncated,
            "original_characters": len(text),
            "kept_characters": len(kept.text),
            "lost_characters": budget.lost_characters(text),
        }

    return await _off_loop(work)


@router.post("/v1/tokens/chunk")
async def chunk_text(body: ChunkRequest, request: Request) -> dict[str, Any]:
    """``{"text", "max_tokens"}`` -> ``{"chunks": [{"start", "end", "count", "text"}], "lost_characters"}``:
    consecutive pieces covering the text exactly, each the longest that fits in ``max_tokens``."""
    budget = _budget(request, body.model)
    text = body.text

    def work() -> dict[str, Any]:
        try:
            chunks = budget.chunk(text, body.max_tokens)
        except ValueError as exc:  # one character needs more tokens than max_tokens
            raise APIError(400, f"invalid value for 'max_tokens': {exc}", param="max_tokens",
                           code="invalid_value") from None
        return {
            "chunks": [{"start": c.start, "end": c.end, "count": c.count, "text": c.text} for c in chunks],
            "lost_characters": budget.lost_characters(text),
        }

    return await _off_loop(work)
