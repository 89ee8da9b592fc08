"""The engine's interface: a ``GenerationRequest`` goes in, ``StepOutput``s and a
``GenerationResult`` come out (with the ``errors.py`` exceptions when a request cannot run).

Outputs are values: ``StepOutput.stats`` and ``GenerationResult.stats`` are snapshots, so
another thread may keep and read them while the engine goes on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

from parrot.engine.sampling import SamplingParams
from parrot.constrain.grammar import Grammar

TokenId = int
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request control of drafting (the ``speculation`` extension field of the API)."""

    enabled: bool = True
    max_draft: int | None = None  # None: the server's drafting.max_draft
    fast_forward: bool = True  # force the tokens a grammar leaves no choice about


@dataclass(frozen=True)
class CacheScope:
    """Whose cached prefix blocks a request may reuse and add to (``prefix_cache.py``).

    ``salt``: the request's tenant and ``cache_salt``; blocks are shared only between requests
    with the same salt. ``shared_tokens``: how many leading prompt tokens are a prefix the
    server shares across tenants (a configured system prompt); their blocks take no salt."""

    salt: str = ""
    shared_tokens: int = 0


@dataclass
class GenerationRequest:
    prompt_ids: list[TokenId]
    params: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    # Extra drafting context, indexed by the drafter but never fed to the model (source
    # documents, OpenAI Predicted Outputs), as token ids.
    draft_context: list[list[TokenId]] = field(default_factory=list)
    # Grammar state of this request (constrained decoding), or None.
    grammar: Grammar | None = None
    cache_scope: CacheScope = field(default_factory=CacheScope)


@dataclass
class TokenLogprob:
    token: TokenId
    logprob: float
    top: list[tuple[TokenId, float]]
    rank: int | None = None  # of ``token`` among all tokens, from 1 (given for prompt tokens)


# The speculation counters of ``SequenceStats`` and what each counts: the one list behind the
# API's usage, /metrics, /v1/stats and the CLI's output.
SPECULATION_COUNTERS: dict[str, str] = {
    "forward_passes": "Forward passes that produced tokens",
    "drafted_tokens": "Draft tokens verified",
    "accepted_tokens": "Draft tokens accepted",
    "forced_tokens": "Tokens forced by a grammar (fast-forward)",
}


@dataclass
class SequenceStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    forward_passes: int = 0  # passes that produced output tokens (each yields at least one)
    prefill_chunks: int = 0  # earlier passes over a long prompt that produced nothing yet
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0  # grammar fast-forward tokens (never verified: the grammar allows nothing else)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (0: not looked up)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    started_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started_at

    def counters(self) -> dict[str, int]:
        """The ``SPECULATION_COUNTERS``, by name."""
        return {name: getattr(self, name) for name in SPECULATION_COUNTERS}

    def snapshot(self) -> SequenceStats:
        """A copy, for readers on other threads (the engine keeps updating the original)."""
        return dataclasses.replace(self)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sequence: new tokens, the text now safe to send, and
    the sequence's state after the step (the engine's whole answer; nothing else is read)."""

    token_ids: list[TokenId]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None  # None: the sequence goes on
    stats: SequenceStats  # a snapshot, taken after this step
    # With ``prompt_logprobs``, in the first output only: the prompt's tokens after the first.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[TokenId]
    finish_reason: FinishReason
    stats: SequenceStats  # a snapshot, taken at the end
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob] | None = None
