"""Task APIs where the user's document is the drafting context: /v1/summarize, /v1/correct.

Both decode greedily (a task endpoint should give the same answer twice). The document is part
of the prompt, so the n-gram drafter indexes it and drafts the phrases the output copies; for
/v1/correct the input text is also given as the expected output (Predicted Outputs), since a
correction is mostly a copy.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from parrot.engine.engine import GenerationRequest
from parrot.engine.interface import CacheScope
from parrot.engine.backend import LoadedModel
from parrot.engine.sampling import SamplingParams
from parrot.server.errors import APIError
from parrot.server.routes.generation import (
    budget_is_explicit,
    cache_salt,
    check_context,
    check_model,
    collect,
    speculation_params,
    usage,
)
from parrot.server.schemas import CorrectRequest, SummarizeRequest
from parrot.server.state import state_of
from parrot.server.textdiff import char_edits

router = APIRouter()

SUMMARIZE_INSTRUCTIONS = {
    "sentences": "Summarize the following text in a few sentences.",
    "bullets": "Summarize the following text as a short list of bullet points, one per line, each starting with '- '.",
}
CORRECT_INSTRUCTION = (
    "Correct the grammar and spelling errors in the following text. Reply with only the corrected text."
)


def _messages(instruction: str, text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{instruction}\n\n{text}"}]


def fit_document(loaded: LoadedModel, instruction: str, text: str, max_input_tokens: int) -> tuple[str, list[int], dict[str, Any]]:
    """Cut ``text`` at a character boundary so that the whole prompt has <= max_input_tokens tokens."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_chat(_messages(instruction, text))
    info: dict[str, Any] = {"truncated": False, "original_characters": len(text), "kept_characters": len(text)}
    if len(ids) <= max_input_tokens:
        return text, ids, info
    overhead = len(tokenizer.encode_chat(_messages(instruction, "")))
    if overhead >= max_input_tokens:
        raise APIError(400, f"max_input_tokens ({max_input_tokens}) is smaller than the prompt without the text "
                            f"({overhead} tokens)", param="max_input_tokens", code="invalid_value")
    budget = tokenizer.budget
    allowance = max_input_tokens - overhead
    # The text's own count is exact; where it meets the instruction, BPE may merge or split one
    # token differently, so check the whole prompt and give back a token if needed.
    while allowance > 0:
        kept = budget.truncate(text, allowance, side="right")
        ids = tokenizer.encode_chat(_messages(instruction, kept.text))
        if len(ids) <= max_input_tokens:
            info.update(truncated=True, kept_characters=kept.offset)
            return kept.text, ids, info
        allowance -= 1
    raise APIError(400, "max_input_tokens leaves no room for the text", param="max_input_tokens", code="invalid_value")


async def _run(request: Request, loaded: LoadedModel, ids: list[int], max_tokens: int | None, body: Any,
               draft_context: list[list[int]], tag: str) -> tuple[str, dict[str, Any]]:
    """Generate greedily from ``ids``; ``max_tokens`` is the request's ``token_limit``."""
    state = state_of(request)
    limit = check_context(loaded, len(ids), max_tokens, "text", state.config.server.max_completion_tokens,
                          budget_is_explicit(body))
    generation = GenerationRequest(ids, SamplingParams(max_tokens=limit, temperature=0.0),
                                   speculation_params(body.speculation), draft_context,
                                   cache_scope=CacheScope(cache_salt(request), state.shared_prefix_tokens(ids)))
    choices = await collect(state, request, [generation], tag)
    return choices[0].text.strip(), usage(len(ids), choices, None) | {"finish_reason": choices[0].finish_reason}


@router.post("/v1/summarize")
async def summarize(body: SummarizeRequest, request: Request) -> dict[str, Any]:
    loaded, _ = state_of(request).require_ready()
    check_model(loaded, body.model)
    instruction = SUMMARIZE_INSTRUCTIONS[body.style]
    if body.max_input_tokens is not None:
        _, ids, truncation = fit_document(loaded, instruction, body.text, body.max_input_tokens)
    else:
        ids = loaded.tokenizer.encode_chat(_messages(instruction, body.text))
        truncation = {"truncated": False, "original_characters": len(body.text), "kept_characters": len(body.text)}
    summary, use = await _run(request, loaded, ids, body.token_limit(), body, [], "/v1/summarize")
    return {"summary": summary, "model": loaded.name, "usage": use, "truncation": truncation}


@router.post("/v1/correct")
async def correct(body: CorrectRequest, request: Request) -> dict[str, Any]:
    loaded, _ = state_of(request).require_ready()
    check_model(loaded, body.model)
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_chat(_messages(CORRECT_INSTRUCTION, body.text))
    text_ids = tokenizer.encode(body.text)
    max_tokens = body.token_limit(len(text_ids), loaded.context_window - len(ids))
    corrected, use = await _run(request, loaded, ids, max_tokens, body, [text_ids], "/v1/correct")
    return {"corrected": corrected, "edits": char_edits(body.text, corrected), "model": loaded.name, "usage": use}
