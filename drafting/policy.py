"""How many draft tokens to verify: the length that maximises expected tokens per second.

Verifying k drafts costs one forward pass over k+1 tokens, ``cost[k+1]`` seconds, measured at
start-up on the actual hardware (the curve is flat on some machines and steep on others). The
pass yields 1 + (number of drafts accepted) tokens. With

- ``a1``: the probability that the first draft token is accepted, and
- ``an``: the probability that a draft token is accepted given the one before it was,

the expected yield of k drafts is ``1 + a1 * (1 + an + an^2 + ... + an^(k-1))``, and the policy
picks the k in 0..max_len with the best ``yield(k) / cost[k+1]``. k = 0 (plain decoding) is always
a candidate, so when drafts do not pay the policy stops drafting: on text the context cannot
predict, speculation costs (almost) nothing.

Both probabilities are estimated online per request from what was accepted, with exponential
forgetting so that the estimate follows the text (a response alternates between copying and
writing freely). ``a1`` is kept per match-length bucket, because a 1-token suffix match is a
much weaker signal than an 8-token one; ``an`` is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def match_bucket(match_length: int) -> int:
    """Bucket of a suffix-match length: 1, 2, 3-4, 5-8, 9+ (0 for no match length known)."""
    if match_length <= 2:
        return max(match_length, 0)
    if match_length <= 4:
        return 3
    if match_length <= 8:
        return 4
    return 5


@dataclass
class _Beta:
    """A Beta-distributed acceptance probability with exponential forgetting."""

    accepted: float
    rejected: float

    @property
    def mean(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, accepted: int, trials: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (trials - accepted)


@dataclass
class AcceptanceStats:
    """Online acceptance estimates of one request."""

    decay: float = 0.9
    first: dict[int, _Beta] = field(default_factory=dict)
    next: _Beta = field(default_factory=lambda: _Beta(2.0, 1.0))

    def first_accept(self, bucket: int) -> float:
        return self.first.get(bucket, _Beta(1.0, 1.0)).mean

    def observe(self, bucket: int, num_drafted: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` of ``num_drafted`` drafts (a prefix) kept."""
        if num_drafted <= 0:
            return
        self.first.setdefault(bucket, _Beta(1.0, 1.0)).observe(min(num_accepted, 1), 1, self.decay)
        # Positions 1.. that were reached (everything before them accepted), and how many passed.
        reached = min(num_accepted, num_drafted - 1)
        if reached > 0:
            self.next.observe(max(num_accepted - 1, 0), reached, self.decay)


def expected_yield(k: int, a1: float, an: float) -> float:
    """Expected tokens from one pass verifying k drafts (accepted drafts + the model's own token)."""
    total, reach = 1.0, a1
    for _ in range(k):
        total += reach
        reach *= an
    return total


class DraftLengthPolicy:
    """Chooses the draft length from a measured cost curve and a request's acceptance stats."""

    def __init__(self, cost: Sequence[float]) -> None:
        """``cost[t]`` = seconds of one forward pass over t tokens, for t = 1..len(cost)-1."""
        if len(cost) < 2 or any(c <= 0 for c in cost[1:]):
            raise ValueError("cost curve needs positive costs for 1.. tokens")
        self.cost = list(cost)

    @property
    def max_draft(self) -> int:
        return len(self.cost) - 2

    def choose(self, max_len: int, a1: float, an: float) -> int:
        """The draft length in 0..max_len with the most expected tokens per second."""
        max_len = min(max_len, self.max_draft)
        best_k, best_rate = 0, 1.0 / self.cost[1]
        total, reach = 1.0, a1
        for k in range(1, max_len + 1):
            total += reach
            reach *= an
            rate = total / self.cost[k + 1]
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
