"""Sampling parameters and the verification rule: which drafted tokens the model keeps.

Greedy (temperature 0): draft token i is accepted while it equals the argmax at position i; the
first mismatch contributes the model's own argmax (the *recovered* token), and when every draft
matches, the argmax after the last one is a free *bonus* token.

Sampling: an n-gram draft is a point mass, q(x) = 1. The exact rule (Leviathan et al. 2023) is:
accept x with probability p(x); on rejection sample from p with x removed and renormalised. We
implement it as *sample and compare*, which is the same thing: draw y ~ p at the position and
accept the draft iff y == x. P(accept) = p(x), and given rejection y is distributed as
p(. | y != x), the residual. Drawing y with randomness keyed by (seed, output position) makes a
seeded request produce the same tokens whether or not it drafts, and however many tokens it
drafts: position t always draws y_t from p_t with the same random numbers. The n choices of one
request share its seed, so the key includes the choice's index: (seed, choice, position).

Target distribution p: logits / temperature, then top-k, then top-p (nucleus), then min-p, as
vLLM and transformers apply them. Before that, in vLLM's order, ``Penalties`` adjust the logits
by the text so far: ``logit_bias``, then the repetition penalty (prompt and output), then the
frequency and presence penalties (output only). Verified position i of a pass sees the output
before the pass plus the drafts before i, so a penalised request too gives the same tokens with
drafting on or off.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

TokenId = int

_MASK64 = (1 << 64) - 1


def _host_float32(x: torch.Tensor) -> bool:
    """Whether ``x`` can be read as a NumPy array (float32 in CPU memory). NumPy works on one
    thread, where torch spreads an operation over 49,152 entries across Parrot's passive OpenMP
    threads and pays 70-540 us to wake them (AVX2 EPYC): the per-token steps below use it there."""
    return x.device.type == "cpu" and x.dtype == torch.float32


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of each row's maximum (the first one on ties, a NaN's if there is one: torch's
    and NumPy's rule alike); 7 us through NumPy against torch's 70 us per decoding step."""
    if _host_float32(x):
        return x.reshape(-1, x.shape[-1]).numpy().argmax(axis=-1).tolist()
    return x.reshape(-1, x.shape[-1]).argmax(dim=-1).tolist()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256  # 0: read the prompt only (for its prompt logprobs)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob and the top n
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's (but the first) and the top n
    # OpenAI: minus presence_penalty for a token in the output so far, minus frequency_penalty
    # times its count there.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM: the logit of a token in the prompt or the output, divided by this if positive, else
    # multiplied by it (> 1 discourages repeats).
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[TokenId, float], ...] = ()  # (token, bias): added to its logit
    choice: int = 0  # which of a request's n choices this is: keys the random numbers with the seed

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError("repetition_penalty must be > 0")
        if any(token < 0 or not -100 <= bias <= 100 for token, bias in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.choice < 0:
            raise ValueError("choice must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether logits depend on more than the model: a penalty or a logit bias is set."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def random_stream(seed: int, choice: int) -> int:
    """The generator seed of choice ``choice`` of a request seeded with ``seed``: the seed itself
    for choice 0 (a request's first choice does not depend on n), a mix of both for the others."""
    return seed if choice == 0 else _mix(seed, -choice)


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The target distribution of 1-D ``logits`` as (token ids, their probabilities): every token
    (ids None: the probabilities are over the whole vocabulary) or, under top-k / top-p / min-p,
    the tokens that keep mass. The nucleus comes from the largest probabilities found with topk
    (64, then 4 times as many until they hold top_p): the smallest prefix of them whose mass
    reaches top_p, which is the same prefix a sort of the whole vocabulary gives, where sorting
    49,152 probabilities cost 4.7 ms per sampled token (AVX2 EPYC)."""
    if _host_float32(logits):  # 11 us against torch's 80
        scores = torch.from_numpy(logits.contiguous().numpy() / np.float32(params.temperature))
    else:
        scores = logits.float() / params.temperature
    ids: torch.Tensor | None = None
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        ids = _at_least(scores, kth)  # ties with the k-th stay, as a mask would keep them
        scores = scores[ids]
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        k = min(64, probs.shape[-1])
        while True:
            top, order = torch.topk(probs, k)  # largest first
            before = top.cumsum(-1) - top  # mass of the larger ones
            if k == probs.shape[-1] or before[-1] >= params.top_p:
                break  # the prefix ends inside: every token after it is dropped too
            k = min(4 * k, probs.shape[-1])
        keep = before < params.top_p  # always the top token
        order = order[keep]
        ids = order if ids is None else ids[order]
        probs = top[keep] / top[keep].sum()
    if params.min_p > 0:
        keep = _at_least(probs, params.min_p * probs.max())
        ids = keep if ids is None else ids[keep]
        probs = probs[keep] / probs[keep].sum()
    return ids, probs


def _at_least(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Indices of the entries of 1-D ``x`` that are >= ``value``, in order (through NumPy: 30 us
    for 49,152 entries against torch's 540)."""
    if _host_float32(x):
        return torch.from_numpy(np.flatnonzero(x.numpy() >= value.item()))
    return (x >= value).nonzero().flatten()


def _cdf(probs: torch.Tensor) -> np.ndarray:
    """The cumulative sums of 1-D probabilities in float64 (the conversion in NumPy and the sums
    in torch: 80 us for 49,152 entries, against 190-230 either way alone)."""
    if _host_float32(probs):
        return torch.from_numpy(probs.numpy().astype(np.float64)).cumsum(-1).numpy()
    return probs.double().cumsum(-1).cpu().numpy()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from over the whole vocabulary, for 1-D ``logits``."""
    ids, probs = candidates(logits, params)
    if ids is None:
        return probs
    return torch.zeros(logits.shape[-1], dtype=probs.dtype, device=probs.device).index_put_((ids,), probs)


class Penalties:
    """The logit adjustments that depend on the text so far, for one sequence, in vLLM's order:
    ``logit_bias``; the repetition penalty over tokens of the prompt or the output; then the
    frequency and presence penalties over the output's token counts.

    Counts are kept incrementally: the output only grows, so each call counts the tokens added
    since the last one. Only the columns of tokens a penalty or bias can touch are computed (the
    output's and drafts' tokens, the prompt's for the repetition penalty, the biased ones): the
    rest keep their logits, as they would under the same arithmetic over the whole vocabulary,
    where 5-7 such operations of 49,152 entries each cost 0.25-0.9 ms per step.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[TokenId]) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.counted = 0  # output tokens already in output_counts
        self.output_counts: torch.Tensor | None = None  # [vocab] float32, made at the first call
        self.in_prompt: torch.Tensor | None = None  # [vocab] bool
        self.bias_ids: torch.Tensor | None = None  # tokens with a logit bias, and their biases
        self.bias_values: torch.Tensor | None = None
        self.present: set[TokenId] = set()  # tokens whose columns a penalty touches: output (and prompt)
        self._columns: torch.Tensor | None = None  # sorted(present), rebuilt when it grows

    def _start(self, vocab: int) -> None:
        self.output_counts = torch.zeros(vocab)
        if self.params.repetition_penalty != 1:
            self.in_prompt = torch.bincount(torch.tensor(list(self.prompt_ids), dtype=torch.long), minlength=vocab)[:vocab] > 0
            self.present.update(t for t in self.prompt_ids if 0 <= t < vocab)
        if self.params.logit_bias:
            bias = dict(self.params.logit_bias)  # the last of a repeated token wins
            self.bias_ids = torch.tensor(sorted(bias), dtype=torch.long)
            self.bias_values = torch.tensor([bias[t] for t in sorted(bias)], dtype=torch.float32)

    def apply(self, logits: torch.Tensor, output_before: Sequence[TokenId], draft_tokens: Sequence[TokenId]) -> torch.Tensor:
        """``logits`` ``[len(draft) + 1, vocab]`` adjusted at each position i for the output
        ``output_before + draft_tokens[:i]``."""
        if self.output_counts is None:
            self._start(logits.shape[-1])
        assert self.output_counts is not None
        new = list(output_before[self.counted :])
        if new:
            self.output_counts.index_add_(0, torch.tensor(new), torch.ones(len(new)))
            self.counted = len(output_before)
            if not self.present.issuperset(new):
                self.present.update(new)
                self._columns = None
        params = self.params
        # a float32 copy to adjust (NumPy's: torch's took 80 us)
        logits = torch.from_numpy(logits.numpy().copy()) if _host_float32(logits) else logits.to(torch.float32, copy=True)
        if self.bias_ids is not None:
            logits[:, self.bias_ids] += self.bias_values.to(logits.device)
        if not (params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty):
            return logits
        if self._columns is None:
            self._columns = torch.tensor(sorted(self.present), dtype=torch.long)
        drafted = set(draft_tokens)
        extra = sorted(drafted - self.present)
        columns = torch.cat([self._columns, torch.tensor(extra, dtype=torch.long)]) if extra else self._columns
        # counts [positions, columns]: position i + 1 on sees draft i as output
        counts = self.output_counts[columns].repeat(len(draft_tokens) + 1, 1)
        if draft_tokens:
            at = {token: i for i, token in enumerate(columns.tolist()) if token in drafted}
            for i, token in enumerate(draft_tokens):
                counts[i + 1 :, at[token]] += 1
        index = columns.to(logits.device)
        part = logits[:, index]
        counts = counts.to(logits.device)
        if params.repetition_penalty != 1:
            seen = counts > 0
            if self.in_prompt is not None:
                seen |= self.in_prompt[columns].to(logits.device)
            penalised = torch.where(part > 0, part / params.repetition_penalty, part * params.repetition_penalty)
            part = torch.where(seen, penalised, part)
        if params.frequency_penalty:
            part = part - params.frequency_penalty * counts
        if params.presence_penalty:
            part = part - params.presence_penalty * (counts > 0).float()
        logits[:, index] = part
        return logits


@dataclass
class Sampler:
    """Draws tokens for one request with randomness keyed by output position. ``prompt_ids``
    matter only to the repetition penalty."""

    params: SamplingParams
    seed: int = field(default=-1)
    prompt_ids: Sequence[TokenId] = ()

    def __post_init__(self) -> None:
        if self.seed < 0:
            seed = self.params.seed
            self.seed = random_stream(seed, self.params.choice) if seed is not None else secrets.randbits(63)
        self.penalties = Penalties(self.params, self.prompt_ids) if self.params.penalised else None

    def sample(self, logits: torch.Tensor, position: int) -> TokenId:
        """One token from p(. | logits) using the random number of output ``position``: the
        inverse of p's cumulative distribution (in float64) at one uniform u in [0, 1), the top 53
        bits of a splitmix64 hash of (seed, position). (An exponential race over the vocabulary
        drew 49,152 random numbers per token: 1.2 ms.)"""
        ids, probs = candidates(logits, self.params)
        cdf = _cdf(probs)
        u = (_mix(self.seed, position) >> 10) * 2.0**-53
        index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)
        return index if ids is None else int(ids[index])

    def verify(
        self,
        logits: torch.Tensor,
        draft_tokens: list[TokenId],
        output_before: Sequence[TokenId],
        allowed: torch.Tensor | None = None,
    ) -> tuple[list[TokenId], int]:
        """Accept a prefix of ``draft_tokens`` against ``logits`` ``[len(draft) + 1, vocab]``.

        ``output_before``: the output tokens before the first verified position, so the tokens
        before position i are ``output_before + draft_tokens[:i]``, at output position
        ``len(output_before) + i`` (which keys its random numbers). Penalties read the output
        so far from there; ``output_before`` only grows from one call to the next.

        Returns (tokens to emit, number of drafts accepted): the accepted drafts followed by the
        recovered token (first rejection) or the bonus token (all accepted). ``allowed`` (bool,
        same shape) masks each position to what a grammar allows there: greedy takes the masked
        argmax, sampling the masked distribution (still exact for the constrained target).
        """
        assert logits.shape[0] == len(draft_tokens) + 1, (tuple(logits.shape), len(draft_tokens))
        first_position = len(output_before)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if self.penalties is not None:
            logits = self.penalties.apply(logits, output_before, draft_tokens)
        if self.params.greedy:
            targets = argmax_rows(logits)
            num_accepted = 0
            while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == targets[num_accepted]:
                num_accepted += 1
            return draft_tokens[:num_accepted] + [targets[num_accepted]], num_accepted
        for i, draft_token in enumerate(draft_tokens):
            token = self.sample(logits[i], first_position + i)
            if token != draft_token:
                return draft_tokens[:i] + [token], i
        bonus = self.sample(logits[len(draft_tokens)], first_position + len(draft_tokens))
        return draft_tokens + [bonus], len(draft_tokens)
