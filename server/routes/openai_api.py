"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

``truncate_prompt_tokens`` (vLLM's semantics: keep the last k prompt tokens) is reported by a
top-level ``truncation`` object, named and shaped like /v1/summarize's but counted in tokens:
``{"truncated", "side": "left", "original_tokens", "kept_tokens"}`` (for a batch of prompts, sums
over the prompts; ``kept_tokens`` equals ``usage.prompt_tokens``). It is present whenever the
request set ``truncate_prompt_tokens``: in the response, or in the usage chunk of a stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.engine.engine import GenerationRequest, TokenLogprob
from server.engine.loader import LoadedModel
from server.engine.sampling import SamplingParams
from server.errors import APIError
from server.routes.generation import (
    Choice,
    check_context,
    check_model,
    collect,
    compile_constraint,
    grammar_state,
    new_id,
    speculation_params,
    state_of,
    stream_outputs,
    usage,
)
from server.schemas import ChatCompletionRequest, CompletionRequest, _GenerationFields
from tokenizer import Tokenizer

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    loaded, _ = state.require_ready()
    return {
        "object": "list",
        "data": [
            {
                "id": loaded.name,
                "object": "model",
                "created": int(state.started_at),
                "owned_by": "parrot",
                "max_model_len": loaded.context_window,
            }
        ],
    }


def sampling_params(
    req: _GenerationFields, max_tokens: int, logprobs: int | None, tokenizer: Tokenizer
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop_list(),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def _prepare(req: _GenerationFields, loaded: LoadedModel) -> None:
    req.unsupported()
    check_model(loaded, req.model)


def _prediction_ids(req: _GenerationFields, tokenizer: Tokenizer) -> list[int] | None:
    return tokenizer.encode(req.prediction.text()) if req.prediction is not None else None


def _truncate(ids: list[int], req: _GenerationFields) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last k prompt tokens."""
    k = req.truncate_prompt_tokens
    return ids[-k:] if k is not None and len(ids) > k else ids


def _truncation(req: _GenerationFields, original_tokens: int, kept_tokens: int) -> dict[str, Any]:
    """``{"truncation": ...}`` when the request set ``truncate_prompt_tokens``, else nothing."""
    if req.truncate_prompt_tokens is None:
        return {}
    return {"truncation": {"truncated": kept_tokens < original_tokens, "side": "left",
                           "original_tokens": original_tokens, "kept_tokens": kept_tokens}}


# -- token strings for logprobs ---------------------------------------------------------------


@lru_cache(maxsize=4)
def _byte_decoder() -> dict[str, int]:
    from tokenizer.bpe import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    piece = tokenizer.hf.convert_ids_to_tokens(token)
    decoder = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    return tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")


def _token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for e in entries:
        item = _token_entry(tokenizer, e.token, e.logprob)
        item["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in e.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], start_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start_offset
    for e in entries:
        text = token_bytes(tokenizer, e.token).decode("utf-8", errors="replace")
        tokens.append(text)
        token_logprobs.append(e.logprob)
        top.append({token_bytes(tokenizer, t).decode("utf-8", errors="replace"): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# -- /v1/completions --------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = state_of(request)
    loaded, _ = state.require_ready()
    _prepare(body, loaded)
    tokenizer = loaded.tokenizer
    prompts: list[list[int]] = []
    original_tokens = 0
    for p in body.prompts():
        if isinstance(p, str):
            ids = tokenizer.encode(p)
        else:
            bad = [t for t in p if not 0 <= t < loaded.forward.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{loaded.forward.vocab_size - 1})",
                               param="prompt", code="invalid_value")
            ids = list(p)
        original_tokens += len(ids)
        ids = _truncate(ids, body)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        prompts.append(ids)
    prediction = _prediction_ids(body, tokenizer)
    spec = speculation_params(body.speculation)
    grammar = await compile_constraint(state, body)
    requests = []
    for ids in prompts:
        max_tokens = check_context(loaded, len(ids), body.max_tokens, "prompt")
        params = sampling_params(body, max_tokens, body.logprobs, tokenizer)
        for _ in range(body.n):
            requests.append(GenerationRequest(ids, params, spec, [prediction] if prediction else [],
                                              grammar_state(state, grammar, spec)))
    prompt_tokens = sum(len(ids) for ids in prompts)
    truncation = _truncation(body, original_tokens, prompt_tokens)
    response_id, created = new_id("cmpl"), int(time.time())

    def choice_body(c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": completion_logprobs(tokenizer, c.logprobs) if body.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }

    if not body.stream:
        choices = await collect(state, request, requests, "/v1/completions")
        _count_prediction(state, prediction, choices)
        return JSONResponse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": loaded.name,
                "choices": [choice_body(c) for c in choices],
                "usage": usage(prompt_tokens, choices, prediction),
                **truncation,
            }
        )

    choices, outputs = await stream_outputs(state, requests, "/v1/completions")

    async def events() -> AsyncIterator[str]:
        async for choice, out in outputs:
            if not out.text and not out.finished:
                continue
            chunk = {
                "index": choice.index,
                "text": out.text,
                "logprobs": completion_logprobs(tokenizer, out.logprobs or []) if body.logprobs is not None else None,
                "finish_reason": choice.finish_reason if out.finished else None,
            }
            yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": loaded.name,
                        "choices": [chunk]})
        if body.stream_options is not None and body.stream_options.include_usage:
            _count_prediction(state, prediction, choices)
            yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": loaded.name,
                        "choices": [], "usage": usage(prompt_tokens, choices, prediction), **truncation})
        yield "data: [DONE]\n\n"

    return StreamingResponse(_guard(events()), media_type="text/event-stream")


# -- /v1/chat/completions ---------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = state_of(request)
    loaded, _ = state.require_ready()
    _prepare(body, loaded)
    tokenizer = loaded.tokenizer
    try:
        ids = tokenizer.encode_chat(body.chat())
    except Exception as exc:  # the template raised: say what it said
        raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages",
                       code="invalid_value") from None
    original_tokens = len(ids)
    ids = _truncate(ids, body)
    truncation = _truncation(body, original_tokens, len(ids))
    max_tokens = check_context(loaded, len(ids), body.token_limit(), "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, tokenizer)
    prediction = _prediction_ids(body, tokenizer)
    spec = speculation_params(body.speculation)
    grammar = await compile_constraint(state, body)
    requests = [
        GenerationRequest(ids, params, spec, [prediction] if prediction else [], grammar_state(state, grammar, spec))
        for _ in range(body.n)
    ]
    response_id, created = new_id("chatcmpl"), int(time.time())

    if not body.stream:
        choices = await collect(state, request, requests, "/v1/chat/completions")
        _count_prediction(state, prediction, choices)
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": loaded.name,
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(tokenizer, c.logprobs) if body.logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
                "usage": usage(len(ids), choices, prediction),
                **truncation,
            }
        )

    choices, outputs = await stream_outputs(state, requests, "/v1/chat/completions")

    def chunk(choices_body: list[dict[str, Any]], **extra: Any) -> str:
        return _sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": loaded.name,
                     "choices": choices_body, **extra})

    async def events() -> AsyncIterator[str]:
        for c in choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for choice, out in outputs:
            if not out.text and not out.finished:
                continue
            delta = {"content": out.text} if out.text else {}
            yield chunk([{
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(tokenizer, out.logprobs or []) if body.logprobs else None,
                "finish_reason": choice.finish_reason if out.finished else None,
            }])
        if body.stream_options is not None and body.stream_options.include_usage:
            _count_prediction(state, prediction, choices)
            yield chunk([], usage=usage(len(ids), choices, prediction), **truncation)
        yield "data: [DONE]\n\n"

    return StreamingResponse(_guard(events()), media_type="text/event-stream")


def _count_prediction(state: Any, prediction: list[int] | None, choices: list[Choice]) -> None:
    if prediction is None:
        return
    details = usage(0, choices, prediction)["completion_tokens_details"]
    state.metrics.predicted.labels(result="accepted").inc(details["accepted_prediction_tokens"])
    state.metrics.predicted.labels(result="rejected").inc(details["rejected_prediction_tokens"])


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the stream started cannot change the status: send them as an error event."""
    try:
        async for item in events:
            yield item
    except APIError as exc:
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"
