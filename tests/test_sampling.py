"""The target distribution's candidates (top-k, top-p, min-p found without sorting the vocabulary)
equal the dense definition, and the inverse-CDF draw follows them."""

from __future__ import annotations

import pytest
import torch

from parrot.engine.sampling import Sampler, SamplingParams, argmax_rows, target_probs


def dense_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k, top-p and min-p as masks over the whole vocabulary, the nucleus from a full sort."""
    scores = logits.double() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.999),  # a flat distribution: the nucleus needs thousands
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.1),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("scale", [1.0, 6.0])  # flat and peaked logits
def test_candidates_equal_the_dense_distribution(params, scale):
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * scale
    ours, reference = target_probs(logits, params).double(), dense_reference(logits, params)
    assert torch.equal(ours > 0, reference > 0)  # the same tokens keep mass
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0, 0.0])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, True, False, False]


def test_inverse_cdf_draws_follow_the_distribution():
    # 20,000 positions of one seeded sampler; tolerances of > 5 standard errors.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    params = SamplingParams(temperature=1.0, top_p=0.95)
    expected = target_probs(logits, params)
    sampler = Sampler(params, seed=11)
    n = 20_000
    counts = torch.bincount(torch.tensor([sampler.sample(logits, position) for position in range(n)]), minlength=6)
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus
    frequency = counts.double() / n
    tolerance = 5 * (expected.double() * (1 - expected.double()) / n).sqrt() + 1e-12
    assert ((frequency - expected.double()).abs() <= tolerance).all(), (frequency, expected)


def test_argmax_rows_takes_the_first_maximum_as_torch_does():
    x = torch.tensor([[1.0, 3.0, 3.0], [float("-inf")] * 3, [0.0, float("nan"), 5.0]])
    assert argmax_rows(x) == x.argmax(dim=-1).tolist() == [1, 0, 1]
