"""Prompt logprobs on the tiny deterministic model: every prompt token after the first, from one
pass over the whole prompt, however the prompt is read (in chunks, with drafting, alone or with
others in the pass), and with ``max_tokens`` 0 (the prompt only)."""

from __future__ import annotations

import random

import pytest
import torch

from parrot.config import DraftingConfig
from parrot.engine.engine import GenerationRequest
from parrot.engine.sampling import SamplingParams
from tests.tiny import tiny_engine

FORCED = DraftingConfig(adaptive=False, max_draft=8)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(length)]


def _expected(engine, prompt: list[int], top: int) -> list[tuple[int, float, int, list[int]]]:
    """(token, logprob, rank, top ids) of prompt[1:] from one pass over the whole prompt."""
    logits = engine.forward.forward([(engine.forward.new_cache(len(prompt)), prompt, len(prompt))])[0]
    logp = torch.log_softmax(logits[:-1], -1)
    rows = []
    for i, token in enumerate(prompt[1:]):
        lp = float(logp[i, token])
        rows.append((token, lp, int((logp[i] > lp).sum()) + 1, logp[i].topk(top).indices.tolist()))
    return rows


@pytest.mark.parametrize("prefill_chunk", [512, 7])
def test_prompt_logprobs_equal_one_pass_over_the_prompt(prefill_chunk):
    engine = tiny_engine("native", FORCED, prefill_chunk=prefill_chunk)
    prompt = _prompt(1, 15) * 2  # repeated: the drafter drafts from the first step
    expected = _expected(engine, prompt, 3)
    outputs = []
    result = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=12, prompt_logprobs=3, ignore_eos=True)),
                             on_output=outputs.append)
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(prompt) - 1
    for entry, (token, lp, rank, top) in zip(got, expected):
        assert entry.token == token and entry.rank == rank
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in entry.top] == top
    # The first output carries them, the others do not; the output itself is unchanged.
    assert outputs[0].prompt_logprobs is got and all(o.prompt_logprobs is None for o in outputs[1:])
    assert result.stats.drafted_tokens > 0
    plain = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    assert result.token_ids == plain.token_ids and plain.prompt_logprobs is None


def test_max_tokens_zero_reads_the_prompt_and_generates_nothing():
    engine = tiny_engine("native", FORCED, prefill_chunk=8)
    prompt = _prompt(2, 20)
    result = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0)))
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    assert [e.token for e in result.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in result.prompt_logprobs] == pytest.approx([r[1] for r in _expected(engine, prompt, 1)],
                                                                         abs=1e-4)
    assert all(e.top == [] for e in result.prompt_logprobs)


def test_prompt_logprobs_in_a_pass_shared_with_other_sequences():
    engine = tiny_engine("native", FORCED, prefill_chunk=6)
    prompts = [_prompt(s, 9 + 4 * s) for s in range(3)]
    seqs = [engine.start(GenerationRequest(p, SamplingParams(max_tokens=5, prompt_logprobs=2 if i != 1 else None,
                                                              ignore_eos=True)))
            for i, p in enumerate(prompts)]
    while not all(s.finished for s in seqs):
        engine.step(seqs)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        if i == 1:
            assert seq.prompt_logprobs is None
            continue
        expected = _expected(engine, prompt, 2)
        assert [e.token for e in seq.prompt_logprobs] == prompt[1:]
        assert [e.logprob for e in seq.prompt_logprobs] == pytest.approx([r[1] for r in expected], abs=1e-4)
