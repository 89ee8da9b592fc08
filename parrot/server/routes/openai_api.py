"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

The two generating endpoints differ in how they turn a request into prompt token ids and in the
shape of their choices (:class:`_Completions`, :class:`_Chat`); checking budgets, submitting,
responding and streaming is one path, :func:`_serve`.

``truncate_prompt_tokens`` (vLLM's semantics: keep the last k prompt tokens) is reported by a
top-level ``truncation`` object, named and shaped like /v1/summarize's but counted in tokens:
``{"truncated", "side": "left", "original_tokens", "kept_tokens"}`` (for a batch of prompts, sums
over the prompts; ``kept_tokens`` equals ``usage.prompt_tokens``). It is present whenever the
request set ``truncate_prompt_tokens``: in the response, or in the usage chunk of a stream.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from parrot.engine.engine import GenerationRequest, StepOutput, TokenLogprob
from parrot.engine.interface import CacheScope
from parrot.engine.backend import LoadedModel
from parrot.engine.sampling import SamplingParams
from parrot.server.errors import APIError
from parrot.server.routes.generation import (
    Choice,
    Constraint,
    budget_is_explicit,
    cache_salt,
    check_context,
    check_model,
    collect,
    compile_constraint,
    escaped_context,
    grammar_state,
    new_id,
    remember,
    session_of,
    speculation_params,
    stream_outputs,
    usage,
)
from parrot.server.schemas import ChatCompletionRequest, CompletionRequest, _GenerationFields
from parrot.server.state import ServerState, state_of
from parrot.tokenizer import Tokenizer
from parrot.constrain.tools import ToolCall, ToolCallReader, calls_complete, read_tool_calls

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


def sampling_params(req: _GenerationFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    vocab_size: int) -> SamplingParams:
    logit_bias = req.logit_bias_pairs(vocab_size)
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
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def truncate_prompt(ids: list[int], req: _GenerationFields) -> list[int]:
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
    from parrot.tokenizer.bpe import bytes_to_unicode

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


def _token_text(tokenizer: Tokenizer, token: int) -> str:
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], start_offset: int = 0,
                        first_token: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs. ``first_token``: an echoed prompt's first token, which nothing
    predicts: it opens the lists with a null logprob and null top logprobs."""
    rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(e.token, e.logprob, e.top) for e in entries]
    if first_token is not None:
        rows.insert(0, (first_token, None, None))
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start_offset
    for token, logprob, top_pairs in rows:
        text = _token_text(tokenizer, token)
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(None if top_pairs is None else {_token_text(tokenizer, t): lp for t, lp in top_pairs})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each later one a map
    from token id (a string) to ``{"logprob", "rank", "decoded_token"}`` holding the top
    ``top_n`` tokens and the prompt's own token (so ``top_n`` or ``top_n + 1`` entries)."""
    result: list[dict[str, Any] | None] = [None]
    for e in entries:
        item = {str(t): {"logprob": lp, "rank": rank, "decoded_token": _token_text(tokenizer, t)}
                for rank, (t, lp) in enumerate(e.top[:top_n], 1)}
        item[str(e.token)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": _token_text(tokenizer, e.token)}
        result.append(item)
    return result


# -- the two endpoints' shapes ------------------------------------------------------------------


class _Format(ABC):
    """How one endpoint names its responses and shapes a choice; the rest is :func:`_serve`."""

    path: str
    id_prefix: str
    response_object: str
    chunk_object: str

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, prompt_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # whether choices carry logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs: the top n at each prompt token
        self.prompts: list[list[int]] = []  # the prompt token ids of each choice, by index

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        """The chunk that opens a streamed choice, if the endpoint sends one."""
        return None

    def extra(self, choices: list[Choice]) -> dict[str, Any]:
        """Top-level fields of a (non-streamed) response beyond choices and usage."""
        return {}

    @abstractmethod
    def choice(self, choice: Choice) -> dict[str, Any]:
        """A finished choice of a response."""

    @abstractmethod
    def delta(self, choice: Choice, out: StepOutput) -> dict[str, Any] | None:
        """One engine output of a choice, as a streamed chunk's choice (None: nothing to send)."""


class _Completions(_Format):
    """Choices of /v1/completions. With ``echo``, a choice's text starts with its prompt, and its
    logprobs with the prompt's (the first token's null); streamed, both come in its first chunk."""

    path = "/v1/completions"
    id_prefix = "cmpl"
    response_object = chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, logprobs: int | None, prompt_logprobs: int | None, echo: bool) -> None:
        super().__init__(tokenizer, logprobs is not None, prompt_logprobs)
        self.top_logprobs = logprobs or 0
        self.echo = echo
        self.started: set[int] = set()  # indices of the streamed choices whose first chunk was sent

    def choice(self, choice: Choice) -> dict[str, Any]:
        body = {"index": choice.index, "text": self._echo_text(choice, self.echo) + choice.text,
                "logprobs": self._logprobs(choice, choice.logprobs, self.echo), "finish_reason": choice.finish_reason}
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, choice.prompt_logprobs or [], self.prompt_logprobs)
        return body

    def delta(self, choice: Choice, out: StepOutput) -> dict[str, Any] | None:
        echo = self.echo and choice.index not in self.started
        # A step whose tokens make no text yet (part of a character) still carries its logprobs.
        if not (out.text or out.finished or echo or (self.logprobs and out.logprobs)):
            return None
        self.started.add(choice.index)
        return {"index": choice.index, "text": self._echo_text(choice, echo) + out.text,
                "logprobs": self._logprobs(choice, out.logprobs or [], echo),
                "finish_reason": choice.finish_reason if out.finished else None}

    def _echo_text(self, choice: Choice, echo: bool) -> str:
        return self.tokenizer.decode(self.prompts[choice.index], skip_special_tokens=False) if echo else ""

    def _logprobs(self, choice: Choice, entries: list[TokenLogprob], echo: bool) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if not echo:
            return completion_logprobs(self.tokenizer, entries)
        # The engine computed the prompt's top logprobs for the larger of logprobs and prompt_logprobs.
        prompt = [TokenLogprob(e.token, e.logprob, e.top[: self.top_logprobs]) for e in choice.prompt_logprobs or []]
        return completion_logprobs(self.tokenizer, prompt + entries, first_token=self.prompts[choice.index][0])


class _Chat(_Format):
    """Choices of /v1/chat/completions. With tools, the answer is read as content or tool calls
    (``parrot.constrain.tools``): a choice that made calls has ``message.tool_calls``, no content, and
    ``finish_reason: "tool_calls"``; streamed, each call's id and name come first, then its
    arguments in pieces as they are generated."""

    path = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, prompt_logprobs: int | None, tools: bool) -> None:
        super().__init__(tokenizer, logprobs, prompt_logprobs)
        self.tools = tools
        self.readers: dict[int, ToolCallReader] = {}  # streamed choices' readers, by choice index

    def opening(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def choice(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish = choice.finish_reason
        if self.tools:
            content, calls = read_tool_calls(choice.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [
                    {"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]}
                finish = _calls_finish(finish, calls)
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": finish}

    def extra(self, choices: list[Choice]) -> dict[str, Any]:
        if self.prompt_logprobs is None:
            return {}
        # vLLM's place for them in a chat response: top level (every choice has the same prompt).
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, choices[0].prompt_logprobs or [], self.prompt_logprobs)}

    def delta(self, choice: Choice, out: StepOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"content": out.text} if out.text else {}
        finish = choice.finish_reason
        if self.tools:
            reader = self.readers.setdefault(choice.index, ToolCallReader())
            content, events = reader.feed(out.text, final=out.finished)
            delta = {"content": content} if content else {}
            if events:
                delta["tool_calls"] = _call_deltas(events)
            if reader.calls:
                finish = _calls_finish(finish, reader.calls)
        if not (delta or out.finished or (self.logprobs and out.logprobs)):
            return None  # a step with no text (part of a character, a held-back tag) and no logprobs asked
        return {"index": choice.index, "delta": delta, "logprobs": self._logprobs(out.logprobs or []),
                "finish_reason": finish if out.finished else None}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(self.tokenizer, entries) if self.logprobs else None


def _calls_finish(finish: str | None, calls: list[ToolCall]) -> str | None:
    """An answer of calls ends with "tool_calls", also when the budget ran out after complete
    calls (``calls_complete``); a first call cut off ends with "length"."""
    if finish == "stop" or (finish == "length" and calls_complete(calls)):
        return "tool_calls"
    return finish


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_deltas(events: list[tuple[int, str | None, str]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas: one per call that moved, its id and name when it starts."""
    deltas: dict[int, dict[str, Any]] = {}
    for index, name, piece in events:
        if index not in deltas:  # a call's name comes in its first event
            start = {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            deltas[index] = {"index": index, **(start if name is not None else {"function": {"arguments": ""}})}
        deltas[index]["function"]["arguments"] += piece
    return list(deltas.values())


# -- the endpoints ----------------------------------------------------------------------------


def ready(request: Request, body: _GenerationFields) -> tuple[ServerState, LoadedModel]:
    """The state and the loaded model, once the model is ready, the parameters are supported and
    the model named is the one served."""
    state = state_of(request)
    loaded, _ = state.require_ready()
    body.unsupported()
    check_model(loaded, body.model)
    return state, loaded


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state, loaded = ready(request, body)
    vocab_size = loaded.forward.vocab_size
    prompts: list[list[int]] = []
    for p in body.prompts():
        if isinstance(p, str):
            ids = loaded.tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
        else:
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                               param="prompt", code="invalid_value")
            ids = list(p)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        prompts.append(ids)
    # Echoed logprobs and vLLM's prompt_logprobs come from one computation, of the larger top n.
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    fmt = _Completions(loaded.tokenizer, body.logprobs, body.prompt_logprobs, body.echo)
    return await _serve(state, request, loaded, body, fmt, prompts, "prompt", body.logprobs, max(wanted, default=None))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state, loaded = ready(request, body)
    ids, tools = chat_prompt(loaded, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fmt = _Chat(loaded.tokenizer, body.logprobs, body.prompt_logprobs, tools=tools)
    return await _serve(state, request, loaded, body, fmt, [ids], "messages", logprobs, body.prompt_logprobs)


def chat_prompt(loaded: LoadedModel, body: ChatCompletionRequest) -> tuple[list[int], bool]:
    """The prompt ids of a chat request, and whether its answer may call tools."""
    tool_use = body.tool_use()
    # The prompt shows the tools unless the answer may not call them (tool_choice "none").
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if tool_use is not None else None
    try:
        return loaded.tokenizer.encode_chat(body.chat(), tools=tools), tool_use is not None
    except Exception as exc:  # the template raised: say what it said
        raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages",
                       code="invalid_value") from None


def prompt_texts(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """The texts a request sent: its messages' contents, or its string prompts."""
    if isinstance(body, ChatCompletionRequest):
        return [m.text() for m in body.messages]
    return [p for p in body.prompts() if isinstance(p, str)]


async def generation_requests(state: ServerState, loaded: LoadedModel, body: CompletionRequest | ChatCompletionRequest,
                              kept: list[list[int]], param: str, logprobs: int | None, prompt_logprobs: int | None,
                              session: list[list[int]], salt: str,
                              ) -> tuple[list[GenerationRequest], list[int] | None, Constraint | None]:
    """The engine requests of ``body.n`` choices for each prompt (ids after truncation), the
    prediction's ids (if any) and the output constraint (if any). ``session``: earlier texts of
    the tenant, to draft from; ``salt``: its prefix cache scope (``cache_salt``)."""
    vocab_size = loaded.forward.vocab_size
    cap = state.config.server.max_completion_tokens
    explicit = budget_is_explicit(body)
    params = [sampling_params(body, check_context(loaded, len(ids), body.token_limit(), param, cap, explicit), logprobs,
                              prompt_logprobs, vocab_size) for ids in kept]
    prediction = loaded.tokenizer.encode(body.prediction.text()) if body.prediction is not None else None
    spec = speculation_params(body.speculation)
    constraint = await compile_constraint(state, body)
    # Choice j of each prompt draws its own random numbers (with a seed: keyed by the seed and j).
    context = ([prediction] if prediction else []) + session
    if constraint is not None and (constraint.check is not None or constraint.param == "tools"):
        context += escaped_context(loaded.tokenizer, prompt_texts(body))  # JSON strings copy the prompt escaped
    requests = [
        GenerationRequest(ids, dataclasses.replace(prompt_params, choice=j), spec, context,
                          grammar_state(state, constraint, spec), CacheScope(salt, state.shared_prefix_tokens(ids)))
        for ids, prompt_params in zip(kept, params)
        for j in range(body.n)
    ]
    return requests, prediction, constraint


async def _serve(state: ServerState, http: Request, loaded: LoadedModel, body: CompletionRequest | ChatCompletionRequest,
                 fmt: _Format, prompts: list[list[int]], param: str, logprobs: int | None,
                 prompt_logprobs: int | None) -> JSONResponse | StreamingResponse:
    """Generate ``body.n`` choices for each prompt (token ids before ``truncate_prompt_tokens``),
    then answer in one response or as server-sent events, shaped by ``fmt``. ``logprobs`` and
    ``prompt_logprobs``: how many top tokens the engine reports at each output and prompt token."""
    kept = [truncate_prompt(ids, body) for ids in prompts]
    fmt.prompts = [ids for ids in kept for _ in range(body.n)]
    prompt_tokens = sum(len(ids) for ids in kept)
    truncation = _truncation(body, sum(len(ids) for ids in prompts), prompt_tokens)
    tenant = session_of(state, http, body)
    session = state.sessions.context(tenant) if tenant is not None and state.sessions is not None else []
    requests, prediction, constraint = await generation_requests(state, loaded, body, kept, param, logprobs,
                                                                  prompt_logprobs, session,
                                                                  cache_salt(http, body.user, body.cache_salt))
    checked = constraint.report if constraint is not None else lambda choices: {}
    headers = constraint.headers() if constraint is not None else {}
    response_id, created = new_id(fmt.id_prefix), int(time.time())

    def envelope(kind: str) -> dict[str, Any]:
        return {"id": response_id, "object": kind, "created": created, "model": loaded.name}

    if not body.stream:
        choices = await collect(state, http, requests, fmt.path)
        remember(state, tenant, kept, choices)
        _count_prediction(state, prediction, choices)
        return JSONResponse({**envelope(fmt.response_object), "choices": [fmt.choice(c) for c in choices],
                             "usage": usage(prompt_tokens, choices, prediction, body.n), **truncation, **fmt.extra(choices),
                             **checked(choices)}, headers=headers)

    choices, outputs = await stream_outputs(state, requests, fmt.path)

    def chunk(choices_body: list[dict[str, Any]], **extra: Any) -> str:
        return _sse({**envelope(fmt.chunk_object), "choices": choices_body, **extra})

    async def events() -> AsyncIterator[str]:
        for c in choices:
            opening = fmt.opening(c)
            if opening is not None:
                yield chunk([opening])
        async for choice, out in outputs:
            delta = fmt.delta(choice, out)
            if delta is not None:
                yield chunk([delta])
        remember(state, tenant, kept, choices)
        report = checked(choices)
        if report:  # after every choice finished: was each output valid against the whole schema
            yield chunk([], **report)
        if body.stream_options is not None and body.stream_options.include_usage:
            _count_prediction(state, prediction, choices)
            yield chunk([], usage=usage(prompt_tokens, choices, prediction, body.n), **truncation)
        yield "data: [DONE]\n\n"

    return StreamingResponse(_guard(events()), media_type="text/event-stream", headers=headers)


def _count_prediction(state: ServerState, prediction: list[int] | None, choices: list[Choice]) -> None:
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
