"""The speculative decoding engine: one step = plan -> one forward pass -> accept -> stops -> emit.

``Engine.step(sequences)`` advances every running sequence by one forward pass:

0. reuse: with a prefix cache, a new sequence copies the KV of the longest cached prefix of
   its prompt into its cache and reads only the rest; one whose prompt another sequence is
   reading right now waits for it (a step or a few), then reuses what it stored;
1. plan: a sequence still prefilling feeds its next prompt chunk (asking for the logits at its
   tokens when the request wants prompt logprobs); otherwise it feeds the tokens not yet in its
   KV cache (``pending``: the prompt's last chunk, then one token), the tokens its grammar
   forces, and, after the first token, a draft from its drafter, cut to
   the length the draft sizer says pays off in this pass;
2. one forward pass over all sequences' tokens (the KV caches grow by what was fed);
3. accept: the verification rule keeps a prefix of the draft plus one token of the model's own
   (recovered or bonus), see ``sampling.py``; the KV cache is cropped back to what was accepted;
4. apply stops: a completed grammar, EOS / stop token ids, max_tokens, stop strings;
5. emit: the tokens go to the output, the drafter and the statistics, and the step returns a
   ``StepOutput`` per sequence, which is all that leaves the engine thread; the sequence's
   newly completed blocks go to the prefix cache.

A request whose grammar fails (llguidance can stop a parser mid-output) ends with an error of its
own (``Generation.error``); the other sequences of the step go on.

A request's output does not depend on drafting: greedy output is the argmax chain either way,
and sampling draws position t's token with randomness keyed by (seed, choice, t).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parrot.drafting import (
    GRAMMAR_BUCKET,
    AcceptanceStats,
    Drafter,
    DrafterSettings,
    DraftLengthPolicy,
    DraftSizer,
    DraftSlot,
    match_bucket,
    new_drafter,
)
from parrot.config import DraftingConfig
from parrot.engine.backend import Forward, KVCache, TensorKVCache
from parrot.engine.costmodel import wait_for
from parrot.engine.errors import ContextWindowExceeded, EmptyPrompt, EngineError
from parrot.engine.interface import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SequenceStats,
    SpeculationParams,
    StepOutput,
    TokenId,
    TokenLogprob,
)
from parrot.engine.prefix_cache import PrefixCache, block_keys
from parrot.engine.sampling import Sampler
from parrot.engine.textout import TextAssembler
from parrot.tokenizer import Tokenizer
from parrot.constrain.grammar import Grammar, GrammarError

# The request and output types live in interface.py; callers import them from here as well.
__all__ = ["Engine", "FinishReason", "Generation", "GenerationRequest", "GenerationResult", "SequenceStats",
           "SpeculationParams", "StepOutput", "TokenLogprob"]


@dataclass
class _Plan:
    tokens: list[TokenId]  # fed to the model this step: pending + forced (+ draft, once sized)
    num_logits: int  # logits needed (0 while prefilling)
    draft: list[TokenId]
    bucket: int
    forced: list[TokenId] = field(default_factory=list)
    masks: list[bytes] | None = None  # grammar bitmask at each verified position
    prompt_rows: int = 0  # logits before those, at prompt tokens, for prompt logprobs
    past_cut: TokenId | None = None  # the draft token after the sizer's cut, checked for free


class Generation:
    """One request in flight: KV cache, drafter, sampler, text, stats. Only the thread that
    drives the engine touches it; what others need leaves in ``StepOutput``s."""

    def __init__(self, request: GenerationRequest, engine: Engine) -> None:
        params = request.params
        self.request = request
        self.params = params
        self.cache: KVCache = engine.forward.new_cache(
            len(request.prompt_ids) + min(params.max_tokens, 512) + engine.max_draft + 1
        )
        self.pending: list[TokenId] = list(request.prompt_ids)
        self.output_ids: list[TokenId] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else engine.tokenizer.eos_token_ids
        )
        self.sampler = Sampler(params, prompt_ids=request.prompt_ids)
        self.text = TextAssembler(engine.tokenizer, params.stop)
        self.acceptance = AcceptanceStats()
        self.stats = SequenceStats(prompt_tokens=len(request.prompt_ids), started_at=time.perf_counter())
        self.finish_reason: FinishReason | None = None
        self.error: EngineError | None = None  # why it finished with "error"
        self.grammar = request.grammar
        spec = request.speculation
        drafting = engine.drafting
        self.max_draft = 0 if not (spec.enabled and drafting.enabled) else min(
            engine.max_draft, spec.max_draft if spec.max_draft is not None else engine.max_draft
        )
        self.drafter: Drafter | None = None
        if self.max_draft > 0:
            settings = DrafterSettings(drafting.min_n, drafting.max_n, drafting.threshold, self.stop_token_ids)
            self.drafter = new_drafter(drafting.method, settings)
            for doc in request.draft_context:
                self.drafter.add_context(doc)
            self.drafter.extend(request.prompt_ids)
        # Prefix cache (engine step 0): the keys of the sequence's full blocks as far as they are
        # known, how many of them are stored, and whether the cache was consulted yet.
        self.prefix_keys: list[bytes] = []
        self.stored_blocks = 0
        self.reused = engine.prefix_cache is None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        if not self.finished:
            self.finish("cancelled")

    def fail(self, error: GrammarError) -> None:
        """End with an error of this request alone (its grammar failed)."""
        first_line = (str(error).splitlines() or ["no message"])[0]  # llguidance appends its whole state
        self.error = EngineError(f"the output's grammar failed: {first_line}")
        self.finish("error")

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.stats.finished_at = time.perf_counter()
        # Free the KV cache now; the sequence object may outlive the request's bookkeeping.
        self.cache = None  # type: ignore[assignment]
        self.drafter = None
        self.grammar = None


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
        forward: Forward[Any],
        tokenizer: Tokenizer,
        drafting: DraftingConfig,
        cost_curve: Sequence[float] | None = None,
        prefill_chunk: int = 512,
        prefill_chunk_busy: int = 128,
        *,
        sizer: DraftSizer | None = None,
        prefix_cache: PrefixCache | None = None,
        track_cost: bool = False,
    ) -> None:
        """``cost_curve``: seconds of a pass over 1.. tokens (``costmodel.measure_cost_curve``);
        adaptive drafting needs it, and drafts never exceed what it measured. ``sizer`` cuts the
        drafts of each pass; by default the ``DraftLengthPolicy`` of the cost curve when
        drafting is adaptive, else none (every draft is verified whole). ``prefix_cache``: KV
        blocks to reuse across requests; the forward must have an exact ``kv_layout`` equal to
        the cache's. ``track_cost``: keep the policy's cost curve current from the times of the
        decoding passes (``DraftLengthPolicy.observe``); off, a given curve is used as it is (tests
        and benchmarks that fix one). ``build_engine`` sets it from ``drafting.track_cost``."""
        self.forward = forward
        self.track_cost = track_cost
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
        self.sizer = sizer if sizer is not None else (self.policy.size if self.policy is not None else None)
        if prefix_cache is not None and forward.kv_layout != prefix_cache.layout:
            raise ValueError(f"the prefix cache holds {prefix_cache.layout}, the forward's KV is {forward.kv_layout}")
        self.prefix_cache = prefix_cache

    def start(self, request: GenerationRequest) -> Generation:
        """A new sequence for ``request``; raises ``EmptyPrompt`` or ``ContextWindowExceeded``."""
        if not request.prompt_ids:
            raise EmptyPrompt()
        if len(request.prompt_ids) + request.params.max_tokens > self.forward.max_positions:
            raise ContextWindowExceeded(len(request.prompt_ids), request.params.max_tokens, self.forward.max_positions)
        return Generation(request, self)

    # -- one step -------------------------------------------------------------------------------

    def step(self, sequences: Sequence[Generation]) -> list[StepOutput | None]:
        """Advance each unfinished sequence by one forward pass (all in the same pass); None for
        a sequence that only read a prompt chunk (or was already finished)."""
        running = [s for s in sequences if not s.finished]
        if self.prefix_cache is not None:
            running = self._reuse_prefixes(running)  # 0. cached prefixes in; some may wait a step
            if not running:
                return [None] * len(sequences)
        plans = self._plan(running)  # 1. a prompt chunk, or pending + forced tokens + a sized draft
        running, plans = [s for s in running if not s.finished], [p for s, p in zip(running, plans) if not s.finished]
        if not running:  # every sequence's grammar failed
            return [None] * len(sequences)
        logits = self._forward(running, plans)  # 2. one pass: [num_logits, vocab] per sequence
        now = time.perf_counter()
        outputs: dict[int, StepOutput] = {}
        for seq, plan, seq_logits in zip(running, plans, logits):
            if plan.prompt_rows:
                self._prompt_logprobs(seq, seq_logits[: plan.prompt_rows])
                seq_logits = seq_logits[plan.prompt_rows :]
            if plan.num_logits == 0:  # a prompt chunk: nothing to accept yet
                seq.pending = seq.pending[len(plan.tokens) :]
                seq.stats.prefill_chunks += 1
                self._store_prefix(seq)
                continue
            try:
                verified = self._accept(seq, plan, seq_logits)  # 3. accepted drafts + recovered/bonus token
                tokens, text, finish = self._apply_stops(seq, plan.forced, verified)  # 4.
            except GrammarError as exc:
                seq.fail(exc)
                continue
            outputs[id(seq)] = self._emit(seq, seq_logits, tokens, text, finish, now)  # 5.
        return [outputs.get(id(s)) for s in sequences]

    # 0. Reuse cached prefixes --------------------------------------------------------------------

    def _reuse_prefixes(self, running: list[Generation]) -> list[Generation]:
        """Give each new sequence the cached KV of its prompt's longest cached prefix; the
        sequences that go into this step's pass (a new one waits while another sequence is
        reading a longer prefix of the same prompt, as ``n`` > 1 choices and parallel requests
        with one system prompt do: it reuses that prefix a few steps later instead of computing
        it twice)."""
        assert self.prefix_cache is not None
        ready = []
        for seq in running:
            if not seq.reused and not self._reuse_prefix(seq, running):
                continue
            ready.append(seq)
        return ready

    def _reuse_prefix(self, seq: Generation, running: list[Generation]) -> bool:
        """Look ``seq``'s prompt up and copy what is cached into its KV cache (never the last
        prompt token, whose logits give the first output token); False: wait instead."""
        cache = self.prefix_cache
        assert cache is not None
        prompt, scope = seq.request.prompt_ids, seq.request.cache_scope
        if not seq.prefix_keys:
            seq.prefix_keys = block_keys(prompt, cache.block_tokens, scope.salt, scope.shared_tokens)
        if seq.prompt_logprobs is not None:  # needs the logits at every prompt position
            seq.reused = True
            return True
        hit = cache.match(seq.prefix_keys)
        for other in running:
            if other is not seq and other.reused and other.stats.first_token_at is None and \
                    _common_prefix(other.prefix_keys, seq.prefix_keys) > hit:
                return False
        seq.reused = True
        seq.stats.prefix_query_tokens = len(prompt)
        positions = min(hit * cache.block_tokens, len(prompt) - 1)
        if positions > 0:
            kv = seq.cache
            assert isinstance(kv, TensorKVCache) and kv.length == 0
            kv.reserve(positions)
            cache.load(seq.prefix_keys[: -(-positions // cache.block_tokens)], positions, kv.k, kv.v)
            kv.length = positions  # type: ignore[misc]
            seq.pending = list(prompt[positions:])
            seq.stats.cached_tokens = positions
        return True

    def _store_prefix(self, seq: Generation) -> None:
        """Hand the sequence's newly completed blocks (prompt and output tokens in its cache) to
        the prefix cache."""
        cache = self.prefix_cache
        if cache is None or not seq.reused or seq.cache is None:
            return
        b = cache.block_tokens
        prompt = seq.request.prompt_ids
        full = min(seq.cache.length, len(prompt) + len(seq.output_ids)) // b
        if full <= seq.stored_blocks:
            return
        if full > len(seq.prefix_keys):  # the chain goes on into the output
            scope = seq.request.cache_scope
            tokens = (list(prompt) + seq.output_ids)[: full * b]
            parent = seq.prefix_keys[-1] if seq.prefix_keys else b""
            seq.prefix_keys += block_keys(tokens, b, scope.salt, scope.shared_tokens, len(seq.prefix_keys), parent)
        kv = seq.cache
        assert isinstance(kv, TensorKVCache)
        # From the first block if the last one stored has been evicted since (the chain to the
        # new ones would be cut), else from the first new one.
        first = seq.stored_blocks if seq.stored_blocks and seq.prefix_keys[seq.stored_blocks - 1] in cache else 0
        cache.store(seq.prefix_keys[:full], first, kv.k, kv.v)
        seq.stored_blocks = full

    # 1. Plan ------------------------------------------------------------------------------------

    def _plan(self, running: Sequence[Generation]) -> list[_Plan]:
        """What each sequence feeds: a prompt chunk, or pending + forced tokens + a sized draft.
        While others decode, a prompt is read in smaller chunks so that their next tokens are
        not held up long."""
        decoding = sum(len(s.pending) == 1 for s in running)
        chunk = self.prefill_chunk_busy if decoding else self.prefill_chunk
        plans = [self._planned(s, chunk) for s in running]
        self._size_drafts(running, plans)
        return plans

    def _planned(self, seq: Generation, chunk: int) -> _Plan:
        """``_plan_one``, or an empty plan for a sequence whose grammar failed (it is finished)."""
        try:
            return self._plan_one(seq, chunk)
        except GrammarError as exc:
            seq.fail(exc)
            return _Plan([], 0, [], 0)

    def _plan_one(self, seq: Generation, chunk: int) -> _Plan:
        """What ``seq`` feeds this step, with its longest possible draft (sized later)."""
        # Prompt logprobs need the logits at every prompt token but the last (whose logits are
        # those of the first output token, as always).
        reading_prompt = seq.prompt_logprobs is not None and seq.cache.length < len(seq.request.prompt_ids)
        if len(seq.pending) > chunk:
            return _Plan(seq.pending[:chunk], 0, [], 0, prompt_rows=chunk if reading_prompt else 0)
        room = seq.params.max_tokens - len(seq.output_ids)
        forced: list[TokenId] = []
        if seq.grammar is not None:
            # Forced tokens are certain: the grammar state moves past them now.
            forced = seq.grammar.forced_tokens()[:room] if seq.request.speculation.fast_forward else []
            seq.grammar.consume(forced)
        # No draft in the pass that reads the prompt's last tokens: it yields the first token, and
        # every drafted row would delay it (with a cached prefix, a turn's 20-200 new tokens and 16
        # drafts made the first token 1.1-1.3x later on the 1.5B coder). vLLM and llama.cpp start
        # drafting after the first token too.
        budget = room - len(forced) - 1 if len(seq.pending) == 1 else 0
        draft, bucket = self._propose(seq, forced, budget)
        if seq.grammar is not None:
            draft = draft[: seq.grammar.validate(draft)]  # the longest prefix the grammar allows
            if not draft:
                draft, bucket = self._spell_forced(seq, seq.grammar, forced, budget)
        prompt_rows = len(seq.pending) - 1 if reading_prompt else 0
        return _Plan(seq.pending + forced, len(forced) + 1, draft, bucket, forced, prompt_rows=prompt_rows)

    def _propose(self, seq: Generation, forced: list[TokenId], budget: int) -> tuple[list[TokenId], int]:
        """The drafter's draft after the forced tokens (the pass itself yields one more), and its bucket."""
        if seq.drafter is None or budget <= 0:
            return [], 0
        draft = seq.drafter.propose(min(seq.max_draft, budget), after=forced)
        return draft.tokens, match_bucket(draft.match_length)

    def _spell_forced(self, seq: Generation, grammar: Grammar, forced: list[TokenId], budget: int) -> tuple[list[TokenId], int]:
        """A draft for when the grammar allows none of the drafter's: the forced bytes that the
        canonical back-off held back (the ``"`` that opens a value, say), then the drafter's
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
        """Cut every draft to what the sizer says pays in this pass, then at a stop string;
        finish the plans (grammar masks, tokens fed, logits needed)."""
        decoding = [(s, p) for s, p in zip(running, plans) if p.num_logits > 0]
        if self.sizer is not None and any(p.draft for _, p in decoding):
            # Prompt chunks in the pass are left out: they run through the float32 GEMM, not the
            # rows the cost curve measures, and drafting more because a chunk makes the pass slow
            # anyway would make that prompt's first token later still. A request reading the last
            # chunk of its prompt counts like one feeding a single token.
            slots = [
                DraftSlot(rows=1 + len(p.forced), draft=p.draft, acceptance=s.acceptance, bucket=p.bucket,
                          position=len(s.request.prompt_ids) + len(s.output_ids) + len(p.forced))
                for s, p in decoding
            ]
            lengths = self.sizer(slots)
            assert len(lengths) == len(slots), "a draft sizer returns one length per slot"
            for (_, p), keep in zip(decoding, lengths):
                p.past_cut = p.draft[keep] if keep < len(p.draft) else None
                p.draft = p.draft[:keep]
        for seq, p in decoding:
            if seq.params.stop and p.draft:
                cut = self._cut_at_stop_string(seq, p.forced, p.draft)
                if len(cut) < len(p.draft):
                    p.draft, p.past_cut = cut, None  # the token after a stop string: nothing to learn
            if seq.grammar is not None:
                try:
                    p.masks = seq.grammar.masks(p.draft)
                except GrammarError as exc:
                    seq.fail(exc)
                    continue
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

    # 2. Forward ---------------------------------------------------------------------------------

    def _forward(self, running: Sequence[Generation], plans: list[_Plan]) -> list[torch.Tensor]:
        """One pass over every sequence's planned tokens: logits ``[num_logits, vocab]`` each."""
        cached = [seq.cache.length for seq in running]
        for seq, length in zip(running, cached):
            # Every token of the sequence is in its cache except the pending ones.
            assert length + len(seq.pending) == len(seq.request.prompt_ids) + len(seq.output_ids)
        begin = time.perf_counter()
        logits = self.forward.forward([(s.cache, p.tokens, p.prompt_rows + p.num_logits) for s, p in zip(running, plans)])
        wait_for(logits)  # a GPU's pass timed to its end (the next step would wait for it anyway)
        if self.track_cost and self.policy is not None and all(len(seq.pending) == 1 for seq in running):
            # A decoding pass (no prompt in it): its time keeps the drafting's cost curve current.
            self.policy.observe(sum(len(p.tokens) for p in plans), time.perf_counter() - begin)
        assert len(logits) == len(plans)
        for seq, plan, rows, before in zip(running, plans, logits, cached):
            expected = (plan.prompt_rows + plan.num_logits, self.forward.vocab_size)
            assert tuple(rows.shape) == expected, (tuple(rows.shape), expected)
            assert seq.cache.length == before + len(plan.tokens)
        return logits

    # 3. Accept ----------------------------------------------------------------------------------

    def _accept(self, seq: Generation, plan: _Plan, logits: torch.Tensor) -> list[TokenId]:
        """Verify the draft: the accepted drafts, then the model's own token (recovered or bonus).
        Rejected drafts leave the KV cache; the statistics count the pass."""
        forced, draft = plan.forced, plan.draft
        verify_logits = logits[len(forced) :]  # [len(draft) + 1, vocab]: the verified positions
        masks = None if plan.masks is None else _unpack_masks(plan.masks, logits.shape[-1])
        verified, num_accepted = seq.sampler.verify(verify_logits, draft, seq.output_ids + forced, masks)
        # Rejected drafts leave the cache. The last verified token was never fed: it is the
        # pending token of the next step.
        seq.cache.crop(seq.cache.length - (len(draft) - num_accepted))
        seq.stats.forward_passes += 1
        seq.stats.drafted_tokens += len(draft)
        seq.stats.accepted_tokens += num_accepted
        seq.stats.forced_tokens += len(forced)
        if num_accepted == len(draft) and plan.past_cut is not None:
            # The model's own token is the verdict on the draft token the sizer cut off: it would
            # have been accepted exactly when it equals it (greedy; sampled, with the probability
            # it would have been accepted with). Without this look a request verifying one draft
            # a pass never learns whether its copies run on, nor one verifying none whether its
            # drafts have become good (it only learns from what it verifies).
            seq.acceptance.observe(plan.bucket, len(draft) + 1, num_accepted + (verified[-1] == plan.past_cut))
        else:
            seq.acceptance.observe(plan.bucket, len(draft), num_accepted)
        return verified

    # 4. Apply stops -----------------------------------------------------------------------------

    def _apply_stops(
        self, seq: Generation, forced: list[TokenId], verified: list[TokenId]
    ) -> tuple[list[TokenId], str, FinishReason | None]:
        """The tokens this step emits, their text, and why the sequence ends (None: it goes on).
        Stops that end on a token come first, then stop strings, which can end inside them."""
        tokens, finish = self._token_stops(seq, forced, verified)
        emitted = [t for t in tokens if t not in seq.stop_token_ids]
        kept, text = seq.text.add(emitted)
        if seq.text.stopped is not None:
            # A stop string ended generation at emitted token ``kept``: what follows it goes,
            # also a stop token right after it (an EOS drafted or yielded by the same pass),
            # which plain decoding never reaches.
            tokens, finish = emitted[:kept], "stop"
        return tokens, text, finish

    def _token_stops(
        self, seq: Generation, forced: list[TokenId], verified: list[TokenId]
    ) -> tuple[list[TokenId], FinishReason | None]:
        """A completed grammar, then EOS / stop token ids, then max_tokens."""
        tokens = forced + verified
        finish: FinishReason | None = None
        if seq.grammar is not None:
            kept = _advance_grammar(seq.grammar, verified, seq.stop_token_ids)
            if kept is not None:
                tokens, finish = tokens[: len(forced) + kept], "stop"
        if finish is None:
            for i, token in enumerate(tokens):
                if token in seq.stop_token_ids:
                    tokens, finish = tokens[: i + 1], "stop"
                    break
        room = seq.params.max_tokens - len(seq.output_ids)
        if len(tokens) > room:  # whatever stop there is comes after the last token allowed
            tokens, finish = tokens[:room], "length"
        elif len(tokens) == room:
            finish = finish or "length"
        return tokens, finish

    # 5. Emit ------------------------------------------------------------------------------------

    def _emit(
        self, seq: Generation, logits: torch.Tensor, tokens: list[TokenId], text: str, finish: FinishReason | None,
        now: float,
    ) -> StepOutput:
        """Append the tokens to the output (and logprobs, drafter, stats); end the sequence or
        leave its last token pending."""
        logprobs = self._logprobs(seq, logits, tokens)
        prompt_logprobs = seq.prompt_logprobs if seq.stats.first_token_at is None else None
        seq.output_ids.extend(tokens)
        seq.stats.output_tokens = len(seq.output_ids)
        self._store_prefix(seq)
        if seq.stats.first_token_at is None:
            seq.stats.first_token_at = now
        if finish is not None:
            text += seq.text.flush()
            seq.finish(finish)
        else:
            seq.pending = [tokens[-1]]
            if seq.drafter is not None:
                seq.drafter.extend(tokens)
        return StepOutput(tokens, text, logprobs, finish, seq.stats.snapshot(), prompt_logprobs)

    def _prompt_logprobs(self, seq: Generation, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens that ``logits`` ``[rows, vocab]`` predict: the
        rows are at the first ``rows`` pending prompt tokens, so row i predicts the token after
        pending token i. Each entry has the token's rank and the top ``prompt_logprobs`` tokens."""
        assert seq.prompt_logprobs is not None
        prompt = seq.request.prompt_ids
        start = len(prompt) - len(seq.pending) + 1  # the prompt index row 0 predicts
        targets = torch.tensor(prompt[start : start + logits.shape[0]])
        logp = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
        chosen = logp.gather(1, targets[:, None])  # [rows, 1]
        ranks = ((logp > chosen).sum(-1) + 1).tolist()
        top_n = seq.params.prompt_logprobs or 0
        top_values, top_ids = logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], logp[:, :0].long())
        seq.prompt_logprobs.extend(
            TokenLogprob(token, lp, list(zip(ids, values)), rank)
            for token, lp, ids, values, rank in zip(targets.tolist(), chosen[:, 0].tolist(), top_ids.tolist(),
                                                    top_values.tolist(), ranks)
        )

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
            stats=seq.stats.snapshot(),
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
        )


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _advance_grammar(grammar: Grammar, verified: list[TokenId], stop_token_ids: frozenset[TokenId]) -> int | None:
    """Move the grammar past the verified tokens. Once it is complete nothing but EOS may follow,
    so the output ends there, with or without drafts (an accepted draft can complete it mid-pass,
    before the EOS after it): then the number of verified tokens kept, else None."""
    consumed = 0
    for token in verified:
        if grammar.stopped or token in stop_token_ids:
            break
        grammar.consume([token])
        consumed += 1
    return consumed if grammar.stopped else None
