"""The speculative decoding engine: one step = draft -> one forward pass -> accept -> commit.

``Engine.step(sequences)`` advances every running sequence by one forward pass:

1. plan: a sequence still prefilling feeds its next prompt chunk; otherwise it feeds the token
   not yet in its KV cache (``pending``) followed by a draft from its n-gram drafter, cut to the
   length the cost model says pays off;
2. one forward pass over all sequences' tokens (the KV caches grow by what was fed);
3. accept: the verification rule keeps a prefix of the draft plus one token of the model's own
   (recovered or bonus), see ``sampling.py``;
4. commit: crop each KV cache back to what was accepted, feed the accepted tokens to the drafter
   and the acceptance statistics, apply stops (EOS, stop strings, max_tokens), emit text.

A request's output does not depend on drafting: greedy output is the argmax chain either way,
and sampling draws position t's token with randomness keyed by (seed, t).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from drafting import GRAMMAR_BUCKET, AcceptanceStats, DraftLengthPolicy, NGramDrafter, SuffixDrafter, match_bucket
from server.config import DraftingConfig
from server.engine.sampling import Sampler, SamplingParams
from server.engine.textout import TextAssembler
from tokenizer import Tokenizer
from tokenizer.grammar import Grammar

TokenId = int
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request control of drafting (the ``speculation`` extension field of the API)."""

    enabled: bool = True
    max_draft: int | None = None  # None: the server's drafting.max_draft
    fast_forward: bool = True  # force the tokens a grammar leaves no choice about


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


@dataclass
class TokenLogprob:
    token: TokenId
    logprob: float
    top: list[tuple[TokenId, float]]


@dataclass
class StepOutput:
    """What one step produced for one sequence: new tokens and the text now safe to send."""

    token_ids: list[TokenId]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool


@dataclass
class SequenceStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    forward_passes: int = 0  # passes that produced output tokens (each yields at least one)
    prefill_chunks: int = 0  # earlier passes over a long prompt that produced nothing yet
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0  # grammar fast-forward tokens (never verified: the grammar allows nothing else)
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


@dataclass
class _Plan:
    tokens: list[TokenId]  # fed to the model this step: pending + forced (+ draft, once sized)
    num_logits: int  # logits needed (0 while prefilling)
    draft: list[TokenId]
    bucket: int
    forced: list[TokenId] = field(default_factory=list)
    masks: list[bytes] | None = None  # grammar bitmask at each verified position


class Generation:
    """One request in flight: KV cache, drafter, sampler, text, stats."""

    def __init__(self, request: GenerationRequest, engine: "Engine") -> None:
        params = request.params
        self.request = request
        self.params = params
        self.cache = engine.forward.new_cache(len(request.prompt_ids) + min(params.max_tokens, 512) + engine.max_draft + 1)
        self.pending: list[TokenId] = list(request.prompt_ids)
        self.output_ids: list[TokenId] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else engine.tokenizer.eos_token_ids
        )
        self.sampler = Sampler(params)
        self.text = TextAssembler(engine.tokenizer, params.stop)
        self.acceptance = AcceptanceStats()
        self.stats = SequenceStats(prompt_tokens=len(request.prompt_ids), started_at=time.perf_counter())
        self.finish_reason: FinishReason | None = None
        self.grammar = request.grammar
        spec = request.speculation
        self.max_draft = 0 if not (spec.enabled and engine.drafting.enabled) else min(
            engine.max_draft, spec.max_draft if spec.max_draft is not None else engine.max_draft
        )
        self.drafter: SuffixDrafter | NGramDrafter | None = None
        if self.max_draft > 0:
            self.drafter = engine.new_drafter(self.stop_token_ids)
            for doc in request.draft_context:
                self.drafter.add_context(doc)
            self.drafter.extend(request.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        if not self.finished:
            self.finish("cancelled")

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.stats.finished_at = time.perf_counter()
        # Free the KV cache now; the sequence object may outlive the request's bookkeeping.
        self.cache = None  # type: ignore[assignment]
        self.drafter = None
        self.grammar = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[TokenId]
    finish_reason: FinishReason
    stats: SequenceStats
    logprobs: list[TokenLogprob] | None


def _unpack_masks(masks: list[bytes], width: int) -> torch.Tensor:
    """Grammar bitmasks (bit i of byte i // 8 = token i) as a bool tensor ``[len(masks), width]``."""
    bits = np.unpackbits(np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :width].astype(np.bool_))
    if allowed.shape[1] < width:  # logits wider than the tokenizer's vocabulary: padding ids
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    return allowed


class Engine:
    """Speculative decoding over a loaded model. Not thread-safe: one thread drives ``step``."""

    def __init__(
        self,
        forward: Any,
        tokenizer: Tokenizer,
        drafting: DraftingConfig,
        cost_curve: Sequence[float] | None = None,
        prefill_chunk: int = 512,
        prefill_chunk_busy: int = 128,
    ) -> None:
        self.forward = forward
        self.tokenizer = tokenizer
        self.drafting = drafting
        self.max_draft = drafting.max_draft if drafting.enabled else 0
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_busy = min(prefill_chunk_busy, prefill_chunk)
        self.policy: DraftLengthPolicy | None = None
        if drafting.adaptive and self.max_draft > 0:
            if cost_curve is None:
                raise ValueError("adaptive drafting needs a measured cost curve")
            self.policy = DraftLengthPolicy(cost_curve)
            self.max_draft = min(self.max_draft, self.policy.max_draft)

    def new_drafter(self, stop_token_ids: frozenset[TokenId]) -> SuffixDrafter | NGramDrafter:
        d = self.drafting
        if d.method == "ngram":
            return NGramDrafter(n=d.max_n, threshold=d.threshold, stop_token_ids=stop_token_ids)
        return SuffixDrafter(min_n=d.min_n, max_n=d.max_n, stop_token_ids=stop_token_ids)

    def start(self, request: GenerationRequest) -> Generation:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        total = len(request.prompt_ids) + request.params.max_tokens
        if total > self.forward.max_positions:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.params.max_tokens}) = {total} "
                f"exceeds the context window of {self.forward.max_positions} tokens"
            )
        return Generation(request, self)

    # -- one step -------------------------------------------------------------------------------

    def step(self, sequences: Sequence[Generation]) -> list[StepOutput | None]:
        """Advance each unfinished sequence by one forward pass (all in the same pass)."""
        running = [s for s in sequences if not s.finished]
        # 1. Plan: prompt chunk, or pending token + forced tokens + draft. While others decode,
        #    a prompt is read in smaller chunks so that their next tokens are not held up long.
        decoding = sum(len(s.pending) == 1 for s in running)
        chunk = self.prefill_chunk_busy if decoding else self.prefill_chunk
        plans = [self._plan(s, chunk) for s in running]
        self._size_drafts(running, plans)
        # 2. One forward pass over everything.
        logits = self.forward.forward([(s.cache, p.tokens, p.num_logits) for s, p in zip(running, plans)])
        # 3-4. Accept, commit, emit.
        outputs = {id(s): self._commit(s, p, lg) for s, p, lg in zip(running, plans, logits)}
        return [outputs.get(id(s)) for s in sequences]

    def _plan(self, seq: Generation, chunk: int) -> _Plan:
        """What ``seq`` feeds this step, with its longest possible draft (sized later)."""
        if len(seq.pending) > chunk:
            return _Plan(seq.pending[:chunk], 0, [], 0)
        room = seq.params.max_tokens - len(seq.output_ids)
        forced: list[TokenId] = []
        if seq.grammar is not None:
            # Forced tokens are certain: the grammar state moves past them now.
            forced = seq.grammar.forced_tokens()[:room] if seq.request.speculation.fast_forward else []
            seq.grammar.consume(forced)
        budget = room - len(forced) - 1
        draft, bucket = self._propose(seq, forced, budget)
        if seq.grammar is not None:
            draft = draft[: seq.grammar.validate(draft)]  # the longest prefix the grammar allows
            if not draft:
                draft, bucket = self._spell_forced(seq, seq.grammar, forced, budget)
        return _Plan(seq.pending + forced, len(forced) + 1, draft, bucket, forced)

    def _propose(self, seq: Generation, forced: list[TokenId], budget: int) -> tuple[list[TokenId], int]:
        """The n-gram draft that continues after the forced tokens (the pass itself yields one more)."""
        if seq.drafter is None or budget <= 0:
            return [], 0
        proposal = seq.drafter.propose(min(seq.max_draft, budget), after=forced)
        if not proposal:
            return [], 0
        return proposal, match_bucket(seq.drafter.last_match_length)

    def _spell_forced(self, seq: Generation, grammar: Grammar, forced: list[TokenId], budget: int) -> tuple[list[TokenId], int]:
        """A draft for when the grammar allows none of the n-gram's: the forced bytes that the
        canonical back-off held back (the ``"`` that opens a value, say), then the n-gram's
        continuation after them."""
        if seq.drafter is None or budget <= 0:
            return [], 0
        budget = min(seq.max_draft, budget)
        spelled = grammar.spelled_forced()[:budget]
        if not spelled:
            return [], 0
        more, _ = self._propose(seq, forced + spelled, budget - len(spelled))
        draft = spelled + more
        return draft[: grammar.validate(draft)], GRAMMAR_BUCKET

    def _size_drafts(self, running: Sequence[Generation], plans: list[_Plan]) -> None:
        """Cut every draft to the length that pays in this pass, then finish the plans.

        The policy sizes the drafts of all requests together (``DraftLengthPolicy.allocate``):
        alone, a request drafts what its acceptance and the cost curve pay for; in a batch, a
        draft token must pay for its own row in a pass that already has one per request.
        """
        if self.policy is not None and any(p.draft for p in plans):
            # Prompt chunks in the pass are left out: they run through the float32 GEMM, not the
            # rows the curve measures, and drafting more because a chunk makes the pass slow
            # anyway would make that prompt's first token later still. A request reading the last
            # chunk of its prompt counts like one feeding a single token.
            sizing = [(s, p) for s, p in zip(running, plans) if p.num_logits > 0]
            lengths = self.policy.allocate([
                (1 + len(p.forced), p.num_logits, s.acceptance.first_accept(p.bucket), s.acceptance.next_accept(p.bucket), len(p.draft))
                for s, p in sizing
            ])
            for (_, p), k in zip(sizing, lengths):
                p.draft = p.draft[:k]
        for seq, p in zip(running, plans):
            if p.num_logits == 0:
                continue
            if seq.params.stop and p.draft:
                p.draft = self._cut_at_stop_string(seq, p.forced, p.draft)
            if seq.grammar is not None:
                p.masks = seq.grammar.masks(p.draft)
            p.tokens = p.tokens + p.draft
            p.num_logits += len(p.draft)

    def _cut_at_stop_string(self, seq: Generation, forced: list[TokenId], draft: list[TokenId]) -> list[TokenId]:
        """Never draft past a stop string: end the draft at the token that completes one."""
        context = (seq.output_ids + forced)[-16:]
        base = len(self.tokenizer.decode(context))
        for i in range(1, len(draft) + 1):
            text = self.tokenizer.decode(context + draft[:i])
            window = text[max(base - max(len(s) for s in seq.params.stop), 0) :]
            if any(stop in window for stop in seq.params.stop):
                return draft[:i]
        return draft

    def _commit(self, seq: Generation, plan: _Plan, logits: torch.Tensor) -> StepOutput | None:
        if plan.num_logits == 0:  # a prefill chunk: nothing to accept yet
            seq.pending = seq.pending[len(plan.tokens) :]
            seq.stats.prefill_chunks += 1
            return None
        now = time.perf_counter()
        seq.stats.forward_passes += 1
        forced, draft = plan.forced, plan.draft
        masks = None if plan.masks is None else _unpack_masks(plan.masks, logits.shape[-1])
        verified, num_accepted = seq.sampler.verify(logits[len(forced) :], draft, len(seq.output_ids) + len(forced), masks)
        tokens = forced + verified
        # Rejected drafts leave the cache; the last emitted token is fed next step.
        seq.cache.crop(seq.cache.length - (len(draft) - num_accepted))
        seq.stats.drafted_tokens += len(draft)
        seq.stats.accepted_tokens += num_accepted
        seq.stats.forced_tokens += len(forced)
        seq.acceptance.observe(plan.bucket, len(draft), num_accepted)

        # Stops that end on a token: a completed grammar, EOS / stop token ids, then max_tokens.
        finish: FinishReason | None = None
        if seq.grammar is not None:
            # Once the grammar is complete nothing but EOS may follow: the output ends there, with
            # or without drafts (an accepted draft can complete it mid-pass, before the EOS after it).
            consumed = 0
            for token in verified:
                if seq.grammar.stopped or token in seq.stop_token_ids:
                    break
                seq.grammar.consume([token])
                consumed += 1
            if seq.grammar.stopped:
                tokens, finish = tokens[: len(forced) + consumed], "stop"
        if finish is None:
            for i, token in enumerate(tokens):
                if token in seq.stop_token_ids:
                    tokens, finish = tokens[: i + 1], "stop"
                    break
        room = seq.params.max_tokens - len(seq.output_ids)
        if len(tokens) >= room:
            tokens = tokens[:room]
            finish = finish or "length"
        emitted = [t for t in tokens if t not in seq.stop_token_ids]
        kept, text = seq.text.add(emitted)
        if kept < len(emitted):  # a stop string ended generation inside these tokens
            tokens = emitted[:kept]
        if seq.text.stopped is not None:
            finish = "stop"
        logprobs = self._logprobs(seq, logits, tokens)
        seq.output_ids.extend(tokens)
        seq.stats.output_tokens = len(seq.output_ids)
        if seq.stats.first_token_at is None:
            seq.stats.first_token_at = now
        if finish is not None:
            text += seq.text.flush()
            seq.finish(finish)
        else:
            seq.pending = [tokens[-1]]
            if seq.drafter is not None:
                seq.drafter.extend(tokens)
        return StepOutput(token_ids=tokens, text=text, logprobs=logprobs, finished=finish is not None)

    def _logprobs(self, seq: Generation, logits: torch.Tensor, tokens: list[TokenId]) -> list[TokenLogprob] | None:
        if seq.logprobs is None or not tokens:
            return None
        top_n = seq.params.logprobs or 0
        logp = torch.log_softmax(logits[: len(tokens)], dim=-1)  # [tokens, vocab]
        chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        top_values, top_ids = (logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], logp[:, :0].long()))
        result = [
            TokenLogprob(token, lp, list(zip(ids, values)))
            for token, lp, ids, values in zip(tokens, chosen, top_ids.tolist(), top_values.tolist())
        ]
        seq.logprobs.extend(result)
        return result

    # -- convenience ----------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, on_output: Callable[[StepOutput], None] | None = None) -> GenerationResult:
        """Run one request to the end on the calling thread."""
        seq = self.start(request)
        pieces = []
        while not seq.finished:
            out = self.step([seq])[0]
            if out is not None:
                pieces.append(out.text)
                if on_output is not None:
                    on_output(out)
        return GenerationResult(
            text="".join(pieces),
            token_ids=seq.output_ids,
            finish_reason=seq.finish_reason or "error",
            stats=seq.stats,
            logprobs=seq.logprobs,
        )
