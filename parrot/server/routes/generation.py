"""What every generating route shares: model check, budgets, submission, collection, usage."""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from parrot.engine.engine import (
    GenerationRequest,
    SpeculationParams,
    StepOutput,
    TokenLogprob,
)
from parrot.engine.errors import ContextWindowExceeded, EngineRequestError, EngineStopped
from parrot.engine.interface import SPECULATION_COUNTERS
from parrot.engine.backend import LoadedModel
from parrot.engine.scheduler import EngineError, QueueFull, RequestHandle, Scheduler
from parrot.server.errors import APIError
from parrot.constrain.schema_check import SchemaCheck
from parrot.server.schemas import SpeculationOptions, _GenerationFields
from parrot.server.sessions import tenant_of
from parrot.server.state import ServerState
from parrot.tokenizer import Tokenizer
from parrot.constrain.grammar import Grammar, GrammarError

log = logging.getLogger("parrot.http")


def check_model(loaded: LoadedModel, requested: str | None) -> None:
    if requested is None or requested in (loaded.name, "parrot", "default"):
        return
    raise APIError(
        404,
        f"The model '{requested}' does not exist; this server serves '{loaded.name}'",
        param="model",
        code="model_not_found",
    )


def check_context(loaded: LoadedModel, prompt_tokens: int, max_tokens: int | None, param: str, cap: int = 0,
                  explicit: bool = True) -> int:
    """The completion budget: ``max_tokens``, or all the room left; 400 with exact counts if none.
    ``cap``: the server's ``max_completion_tokens`` (0: none), a 400 when the request itself
    (``explicit``) asks for more, the most it gets when its budget is a default."""
    window = loaded.context_window
    if cap and max_tokens is not None and max_tokens > cap:
        if explicit:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's limit of {cap} tokens per completion",
                           param="max_tokens", code="invalid_value")
        max_tokens = cap
    if max_tokens is None:
        if prompt_tokens >= window:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, your {param} has "
                f"{prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        return min(window - prompt_tokens, cap) if cap else window - prompt_tokens
    if prompt_tokens + max_tokens > window:
        raise APIError(
            400,
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def budget_is_explicit(body: Any) -> bool:
    """Whether the request set its completion budget itself (rather than leaving the default)."""
    return any(name in body.model_fields_set and getattr(body, name) is not None
               for name in ("max_tokens", "max_completion_tokens"))


def session_of(state: ServerState, http: Request, body: _GenerationFields) -> str | None:
    """The tenant whose earlier texts this request drafts from (and joins), or None: it did not
    ask (``speculation.session``). 400 when it asks but the server has it off or it has no tenant."""
    if body.speculation is None or not body.speculation.session:
        return None
    if state.sessions is None:
        raise APIError(400, "session drafting is off on this server (server.session_drafting)",
                       param="speculation.session", code="invalid_value")
    tenant = tenant_of(http, body.user)
    if tenant is None:
        raise APIError(400, "session drafting needs a tenant: send an API key or 'user'", param="speculation.session",
                       code="invalid_value")
    return tenant


def cache_salt(http: Request, user: str | None = None, salt: str | None = None) -> str:
    """The prefix cache's scope of a request (``CacheScope.salt``): its tenant, as session
    drafting names it (API key and ``user``; anonymous requests are one tenant), and its
    ``cache_salt``."""
    return f"{tenant_of(http, user) or ''}\n{salt or ''}"


def remember(state: ServerState, tenant: str | None, prompts: list[list[int]], choices: list[Choice]) -> None:
    """Add a finished request's prompts and outputs to its tenant's session (each prompt once,
    with its first choice; ``choices`` hold the n choices of each prompt in turn)."""
    if tenant is None or state.sessions is None:
        return
    n = len(choices) // len(prompts)
    for i, choice in enumerate(choices):
        state.sessions.add(tenant, (prompts[i // n] if i % n == 0 else []) + choice.token_ids)


def speculation_params(options: SpeculationOptions | None) -> SpeculationParams:
    if options is None:
        return SpeculationParams()
    return SpeculationParams(enabled=options.enabled, max_draft=options.max_draft, fast_forward=options.fast_forward)


@dataclass(frozen=True)
class Constraint:
    """A request's compiled output constraint. For a JSON schema: ``check``, the validator every
    finished output is checked against (the whole schema), and ``unenforced``, what the grammar
    left out of it, in llguidance's words (empty unless the schema was compiled leniently)."""

    param: str
    grammar: str
    check: SchemaCheck | None = None
    unenforced: tuple[str, ...] = ()

    def headers(self) -> dict[str, str]:
        """``X-Parrot-Schema-Unenforced``: the unenforced keywords, when there are any."""
        if not self.unenforced:
            return {}
        text = "; ".join(" ".join(w.split()) for w in self.unenforced)
        return {"X-Parrot-Schema-Unenforced": text.encode("ascii", "backslashreplace").decode()}

    def report(self, choices: list[Choice]) -> dict[str, Any]:
        """``{"schema_check": ...}`` for a JSON schema: the unenforced keywords and, per choice,
        whether its output validated against the whole schema (null when it did not finish)."""
        if self.check is None:
            return {}
        rows = []
        for c in choices:
            if c.finish_reason != "stop":
                rows.append({"index": c.index, "valid": None, "error": f"not finished ({c.finish_reason})"})
                continue
            error = self.check.check(c.text)
            rows.append({"index": c.index, "valid": error is None, "error": error})
            if error is not None:
                log.warning("%s: output %d does not validate against the schema: %s", self.param, c.index, error)
        return {"schema_check": {"unenforced": list(self.unenforced), "choices": rows}}


async def compile_constraint(state: ServerState, req: _GenerationFields) -> Constraint | None:
    """The request's validated grammar (cached by the compiler), or None; 400 quoting llguidance.

    A JSON schema compiles leniently (keywords the grammar cannot enforce are left out, then
    checked after generation), with ``strict: true`` too (what the openai SDK's ``parse()`` sends
    for every schema: refusing it refused most real-world schemas), unless the server has
    ``strict_schemas`` on: then they are refused. An invalid schema is a 400 with its reason."""
    constraint = req.constraint()
    if constraint is None:
        return None
    param, kind, spec = constraint
    check = None
    if kind == "json_schema":
        try:
            check = SchemaCheck(spec)
        except ValueError as exc:
            raise APIError(400, f"invalid {param}: {exc}", param=param, code="invalid_schema") from None
    lenient = check is not None and not state.config.server.strict_schemas
    compiler = state.grammar_compiler()
    try:
        grammar = await asyncio.to_thread(compiler.compile, kind, spec, lenient)
    except GrammarError as exc:
        refused = ""
        if check is not None and not lenient:
            refused = " (this server, server.strict_schemas, refuses keywords the grammar cannot enforce)"
        raise APIError(400, f"invalid {param}: {exc}{refused}", param=param, code="invalid_grammar") from None
    unenforced = tuple(compiler.unenforced(grammar)) if lenient else ()
    if unenforced:
        log.warning("%s: schema served without enforcing: %s", param, "; ".join(unenforced))
    return Constraint(param, grammar, check, unenforced)


def escaped_context(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Draft context for JSON output: each text holding characters JSON escapes (newlines,
    quotes, backslashes, tabs) as it reads inside a JSON string. A tool call whose arguments copy
    a file the prompt holds writes it escaped (``\\n``, ``\\"``), so the prompt's own tokens
    never match it; these do."""
    return [tokenizer.encode(json.dumps(text, ensure_ascii=False)[1:-1]) for text in texts
            if len(text) >= 32 and any(ch in text for ch in '\n"\\\t')]


def grammar_state(state: ServerState, constraint: Constraint | None, spec: SpeculationParams) -> Grammar | None:
    if constraint is None:
        return None
    return state.grammar_compiler().new_state(constraint.grammar, fast_forward=spec.fast_forward)


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    handle: RequestHandle | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def submit_all(scheduler: Scheduler, requests: list[GenerationRequest], tag: str) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for r in requests:
            handles.append(scheduler.submit(r, tag))
    except QueueFull:
        for h in handles:
            h.cancel()
        raise APIError(
            429,
            f"the server is at capacity ({scheduler.max_queue} requests waiting); retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except EngineError as exc:  # the engine stopped (a fault of its loop, or shutting down)
        for h in handles:
            h.cancel()
        raise APIError(503, str(exc), code="server_shutting_down" if isinstance(exc, EngineStopped) else None) from None
    return handles


async def _watch_disconnect(request: Request) -> None:
    """Return when the client closes the connection. The body has been read, so the next message
    is ``http.disconnect`` (Starlette's StreamingResponse listens the same way). Polling
    ``is_disconnected()`` never saw it: behind a ``BaseHTTPMiddleware`` its cancelled receive
    drops the message, and a client that gave up left its request generating to the end."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # nothing else is expected; never spin on it


async def collect(state: ServerState, http: Request, requests: list[GenerationRequest], tag: str) -> list[Choice]:
    """Run requests to the end; cancel them if the client leaves or the timeout passes."""
    _, scheduler = state.require_ready()
    handles = submit_all(scheduler, requests, tag)
    choices = [Choice(index=i, handle=h) for i, h in enumerate(handles)]

    async def drain(choice: Choice) -> None:
        assert choice.handle is not None
        async for out in choice.handle.events():
            add_output(choice, out)

    work: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(drain(c) for c in choices)))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_watch_disconnect(http))
    try:
        done, _ = await asyncio.wait(
            {work, watcher}, timeout=state.config.server.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if work in done:
            work.result()  # raises EngineError if generation failed
            return choices
        if watcher in done:  # the client left: nobody reads this answer
            raise APIError(499, "client closed the request", code="client_closed_request")
        raise APIError(504, f"generation timed out after {state.config.server.request_timeout_s:g} s", code="timeout")
    except EngineError as exc:
        raise _engine_error(exc) from None
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        # A cancelled gather is handed a CancelledError once its drains end, and an engine error
        # can lose the race to a disconnect: retrieve either, or asyncio logs it as never retrieved.
        work.add_done_callback(_retrieve)
        for h in handles:
            h.cancel()  # no-op for finished requests; frees the KV cache of the others


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, ContextWindowExceeded):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, EngineRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc), code="server_shutting_down")
    return APIError(500, str(exc))


async def stream_outputs(
    state: ServerState, requests: list[GenerationRequest], tag: str
) -> tuple[list[Choice], AsyncIterator[tuple[Choice, StepOutput]]]:
    """Submit now (so queue-full is a 429 before any byte is sent), then iterate outputs as they come."""
    _, scheduler = state.require_ready()
    handles = submit_all(scheduler, requests, tag)
    choices = [Choice(index=i, handle=h) for i, h in enumerate(handles)]

    async def iterate() -> AsyncIterator[tuple[Choice, StepOutput]]:
        merged: asyncio.Queue[tuple[Choice, StepOutput | None | EngineError]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            assert choice.handle is not None
            try:
                async for out in choice.handle.events():
                    await merged.put((choice, out))
                await merged.put((choice, None))
            except EngineError as exc:
                await merged.put((choice, exc))

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        deadline = time.monotonic() + state.config.server.request_timeout_s
        remaining = len(choices)
        try:
            while remaining:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise APIError(504, f"generation timed out after {state.config.server.request_timeout_s:g} s", code="timeout")
                try:
                    choice, item = await asyncio.wait_for(merged.get(), timeout)
                except asyncio.TimeoutError:
                    continue
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, EngineError):
                    raise _engine_error(item)
                add_output(choice, item)
                yield choice, item
        finally:
            for p in pumps:
                p.cancel()
            for h in handles:
                h.cancel()

    return choices, iterate()


def add_output(choice: Choice, out: StepOutput) -> None:
    choice.text += out.text
    choice.token_ids.extend(out.token_ids)
    if out.logprobs:
        choice.logprobs.extend(out.logprobs)
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        choice.finish_reason = out.finish_reason if out.finish_reason in ("stop", "length") else "stop"


def usage(prompt_tokens: int, choices: list[Choice], prediction_ids: list[int] | None, n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of a request whose ``choices`` are ``n`` per prompt, prompt after prompt.
    ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came from the prefix cache,
    counted like ``prompt_tokens``, once per prompt (its first choice's)."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.handle.stats.cached_tokens for c in choices[::n] if c.handle is not None and c.handle.stats is not None)
    spec = dict.fromkeys(SPECULATION_COUNTERS, 0)
    for c in choices:
        stats = c.handle.stats if c.handle else None  # the snapshot of its last output
        if stats is not None:
            for name, value in stats.counters().items():
                spec[name] += value
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if prediction_ids is not None:
        accepted = sum(prediction_overlap(prediction_ids, c.token_ids) for c in choices)
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(prediction_ids) * len(choices) - accepted,
        }
    body["speculation"] = spec
    return body


def prediction_overlap(prediction: list[int], completion: list[int]) -> int:
    """Prediction tokens that appear in the completion, in order (OpenAI's accepted prediction tokens)."""
    matcher = difflib.SequenceMatcher(None, prediction, completion, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())
