"""Penalties and logit_bias on the tiny deterministic model: exact under speculation (greedy output
identical with drafting on and off, sampling follows the penalised distribution), and checked
against a plain reference of OpenAI's and vLLM's documented semantics."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from parrot.config import DraftingConfig
from parrot.engine.engine import GenerationRequest, SpeculationParams
from parrot.engine.sampling import Penalties, SamplingParams
from tests.tiny import chi_square_below_quantile, sampled_pairs, tiny_engine

FORCED = DraftingConfig(adaptive=False, max_draft=8)  # always draft what the drafter proposes

PENALTIES = {
    "presence+frequency": {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    "repetition": {"repetition_penalty": 2.0},
    "logit_bias": {"logit_bias": ((5, 4.0), (9, -100.0), (20, 3.0))},
    "all": {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3, "logit_bias": ((7, 2.5),)},
}


def _prompt(seed: int, length: int = 12) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(1, 64) for _ in range(length)]
    return base + base


def _generate(engine, prompt, params, spec=True, context=()):
    return engine.generate(GenerationRequest(prompt, params, SpeculationParams(enabled=spec),
                                             draft_context=[list(c) for c in context]))


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The documented semantics, one token at a time: logit_bias is added; a token of the prompt
    or the output has its logit divided by repetition_penalty if positive, else multiplied by it
    (vLLM); a token of the output loses presence_penalty once and frequency_penalty per
    occurrence (OpenAI)."""
    out = logits.clone()
    bias = dict(params.logit_bias)
    for token in range(out.shape[-1]):
        value = float(out[token]) + bias.get(token, 0.0)
        count = output.count(token)
        if token in prompt or count:
            rp = params.repetition_penalty
            value = value / rp if value > 0 else value * rp
        value -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out[token] = value
    return out


def test_penalties_match_the_documented_semantics_at_every_verified_position():
    """Position i of a verify pass is penalised by the output before the pass plus drafts 0..i-1."""
    params = SamplingParams(**PENALTIES["all"])
    prompt, before, draft = [3, 7, 9], [7, 12, 12], [12, 40, 7]
    logits = torch.randn(len(draft) + 1, 64) * 3
    penalties = Penalties(params, prompt)
    penalties.apply(logits, before[:1], [])  # counts are kept across calls, as the output grows
    got = penalties.apply(logits, before, draft)
    for i in range(len(draft) + 1):
        torch.testing.assert_close(got[i], reference(logits[i], prompt, before + draft[:i], params))


@pytest.mark.parametrize("name", PENALTIES)
def test_greedy_output_identical_with_and_without_drafting_under_penalties(name):
    engine = tiny_engine("native", FORCED)
    params = SamplingParams(max_tokens=48, ignore_eos=True, **PENALTIES[name])
    drafted = accepted = changed = 0
    for seed in range(4):
        prompt = _prompt(seed)
        plain = _generate(engine, prompt, params, spec=False)
        unpenalised = _generate(engine, prompt, SamplingParams(max_tokens=48, ignore_eos=True), spec=False)
        changed += plain.token_ids != unpenalised.token_ids
        # A prediction right but for every 4th token: drafts are accepted and rejected, and the
        # accepted ones change the counts that the positions after them are penalised by.
        prediction = [(t % 62) + 1 if i % 4 == 3 else t for i, t in enumerate(plain.token_ids)]
        spec = _generate(engine, prompt, params, context=[prediction])
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats.drafted_tokens
        accepted += spec.stats.accepted_tokens
    assert changed >= 3  # the penalty changes what greedy decoding picks
    # Guard against passing because nothing was drafted, or nothing accepted or rejected.
    assert accepted > 40 and drafted > accepted


def test_sampling_with_penalties_follows_the_penalised_distribution_with_drafting():
    """Two sampled tokens after a fixed prompt, the second verified against drafts from the
    prompt, against the exact joint distribution of the penalised model computed with ``reference`` (chi-square, 16 x 16
    outcomes pooled to cells expecting >= 5). Seeds 0..1999 are fixed, so the test is
    deterministic; the threshold is the chi-square 0.999999 quantile, so a correct sampler
    passes for essentially any seeds, while the unpenalised distribution is far off (checked).
    """
    vocab = 16
    engine = tiny_engine("native", FORCED, vocab_size=vocab, logit_scale=1.0, seed=7)
    forward = engine.forward
    # Every token but EOS appears in the prompt, so whatever the first token is (sampled in the
    # pass that reads the prompt, which drafts nothing), the drafter proposes the next two.
    prompt = list(range(1, vocab)) * 2
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6, repetition_penalty=1.6, logit_bias=((7, 1.5), (2, -1.0)))
    first_logits = forward.forward([(forward.new_cache(16), prompt, 1)])[0][0]
    first = torch.softmax(reference(first_logits, prompt, [], params), -1)
    joint = torch.zeros(vocab, vocab)
    plain_joint = torch.zeros(vocab, vocab)
    for a in range(vocab):
        second_logits = forward.forward([(forward.new_cache(16), prompt + [a], 1)])[0][0]
        joint[a] = first[a] * torch.softmax(reference(second_logits, prompt, [a], params), -1)
        plain_joint[a] = torch.softmax(first_logits, -1)[a] * torch.softmax(second_logits, -1)
    n = 2000
    counts = sampled_pairs(lambda seed: _generate(engine, prompt, dataclasses.replace(params, seed=seed)), vocab, n)
    chi2, quantile = chi_square_below_quantile(joint.flatten() * n, counts.flatten())
    assert chi2 < quantile, (chi2, quantile)
    plain_chi2, plain_quantile = chi_square_below_quantile(plain_joint.flatten() * n, counts.flatten())
    assert plain_chi2 > plain_quantile  # the test can tell penalised sampling from plain sampling


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_sampling_params_reject_out_of_range_penalties(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
