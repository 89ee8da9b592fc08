"""How many draft tokens to verify: the length that maximises expected tokens per second.

Verifying k drafts costs one forward pass over k+1 tokens, ``cost[k+1]`` seconds, measured at
start-up on the actual hardware (the curve is flat on some machines and steep on others) and
kept up to date from the passes the server runs (``DraftLengthPolicy.observe``). The
pass yields 1 + (number of drafts accepted) tokens. With

- ``a1``: the probability that the first draft token is accepted, and
- ``an``: the probability that a draft token is accepted given the one before it was,

the expected yield of k drafts is ``1 + a1 * (1 + an + an^2 + ... + an^(k-1))``, and the policy
picks the k in 0..max_len with the best ``yield(k) / cost[k+1]``. k = 0 (plain decoding) is always
a candidate, so when drafts do not pay the policy stops drafting: on text the context cannot
predict, speculation costs (almost) nothing.

Both probabilities are estimated online per request from what was accepted, with exponential
forgetting so that the estimate follows the text (a response alternates between copying and
writing freely). A pass also tests the draft token just past the cut: when every verified draft
holds, the model's own token is the verdict on it (the engine reports it as one more draft
verified). Without that, a request verifying one draft a pass never tests ``an`` and one
verifying none never tests ``a1``: both estimates would stay where they stood when the policy
stopped, which held a server on a Zen 4 at one draft a pass on code edits whose drafts were
accepted 63 times of 64. Both are kept per match-length bucket, because a 1-token suffix match is a
much weaker signal than an 8-token one (for the first draft token and for how far the copy goes
on), and in a bucket of their own for drafts that spell the bytes a grammar forces
(``GRAMMAR_BUCKET``). Until a bucket has seen a draft token past the first, ``an`` is the
request's estimate over all buckets.

Several requests decoding together share one pass, and there the question is different: the
pass already has a row per request, so a draft token costs the extra row it adds, and it is worth
it only if it is likely enough. ``DraftLengthPolicy.allocate`` sizes all the drafts of a pass
together by the same rule over the whole pass (tokens per second of the pass).

The engine asks a ``DraftSizer`` to cut the drafts of each pass; ``DraftLengthPolicy.size`` is
the default one, and a benchmark or test passes its own (``loadtests/replay_grammar.py``'s
oracle knows where the model departs from each draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from parrot.drafting.drafter import TokenId


GRAMMAR_BUCKET = 6  # drafts that start with the grammar's forced bytes (see Grammar.spelled_forced)


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
    next: _Beta = field(default_factory=lambda: _Beta(2.0, 1.0))  # all buckets together
    next_by_bucket: dict[int, _Beta] = field(default_factory=dict)

    def first_accept(self, bucket: int) -> float:
        return self.first.get(bucket, _Beta(1.0, 1.0)).mean

    def next_accept(self, bucket: int) -> float:
        return self.next_by_bucket.get(bucket, self.next).mean

    def observe(self, bucket: int, num_drafted: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` of ``num_drafted`` drafts (a prefix) kept."""
        if num_drafted <= 0:
            return
        self.first.setdefault(bucket, _Beta(1.0, 1.0)).observe(min(num_accepted, 1), 1, self.decay)
        # Positions 1.. that were reached (everything before them accepted), and how many passed.
        reached = min(num_accepted, num_drafted - 1)
        if reached > 0:
            self.next.observe(max(num_accepted - 1, 0), reached, self.decay)
            self.next_by_bucket.setdefault(bucket, _Beta(2.0, 1.0)).observe(max(num_accepted - 1, 0), reached, self.decay)


@dataclass(frozen=True)
class DraftSlot:
    """One sequence of a forward pass with logits to verify: its longest draft, to be cut."""

    rows: int  # tokens it feeds anyway (its pending token and forced tokens), one output token each
    draft: list[TokenId]  # the longest draft it may verify this pass
    position: int  # index of the draft's first token in the sequence (prompt + output)
    acceptance: AcceptanceStats
    bucket: int  # the acceptance bucket of this draft (match_bucket, or GRAMMAR_BUCKET)


# How many tokens of each slot's draft to verify (0..len(slot.draft)), for all the slots of one
# pass together, in their order.
DraftSizer = Callable[[Sequence[DraftSlot]], list[int]]


def expected_yield(k: int, a1: float, an: float) -> float:
    """Expected tokens from one pass verifying k drafts (accepted drafts + the model's own token)."""
    total, reach = 1.0, a1
    for _ in range(k):
        total += reach
        reach *= an
    return total


class DraftLengthPolicy:
    """Chooses draft lengths from a measured cost curve and the requests' acceptance stats.

    The start-up curve is a few seconds' measurement. A neighbour busy in those seconds, or a
    machine whose passes cost otherwise once it serves (deeper contexts, several requests, a
    warmer or colder cache), would set the drafting for the server's whole life. So the engine
    reports the time of every decoding pass (``observe``), and the curve follows them: each
    length keeps a low quantile of its recent passes (the minimum of its first few, then a
    tracker; a pass slowed by a neighbour only ever takes longer, which is why the start-up
    points are minima too), and the curve is the start-up curve times, at each length, the ratio
    of that quantile to the start-up time, interpolated between lengths that have been seen and
    held flat past them.

    The policy only sees the lengths it chooses. On a steep curve (the avx2 kernels on an AMD
    Zen 4: 2 tokens 1.1x one, 4 tokens 1.7x, 8 tokens 2.8x), one bench run's server verified a
    single draft per pass for its whole life, on code edits whose drafts were accepted 63 times
    of 64 (a start-up that measured 3 tokens and more some 15% dear is enough for that). So past
    the longest length seen the curve is at most the line through the two longest: where nothing
    has been seen it is optimistic, the next length gets tried, and what it is seen to cost
    replaces the guess. (The same symptom has an acceptance side, which the engine's look past
    the cut answers: see the module docstring.)
    """

    # A length's estimate moves this far towards a pass that took less time, and this far towards
    # one that took more: it settles near the 10th percentile of its passes' times, and a
    # lasting change (a neighbour starting or stopping) moves it within some tens of passes.
    DOWN, UP = 0.25, 0.025
    SEEN = 4  # passes of a length whose minimum replaces its start-up time

    def __init__(self, cost: Sequence[float]) -> None:
        """``cost[t]`` = seconds of one forward pass over t tokens, for t = 1..len(cost)-1."""
        if len(cost) < 2 or any(c <= 0 for c in cost[1:]):
            raise ValueError("cost curve needs positive costs for 1.. tokens")
        self.startup = list(cost)
        self._estimate = list(cost)
        self._passes = [0] * len(cost)
        self._set_curve(list(cost))

    def _set_curve(self, cost: list[float]) -> None:
        self.cost = cost
        last = len(self.cost) - 1
        # Beyond the measured tokens a pass grows linearly (the weights are read once either way;
        # every extra row adds the same arithmetic): continue the slope of the curve's last half.
        first = max(1, last // 2)
        self._slope = (self.cost[last] - self.cost[first]) / (last - first) if last > first else self.cost[last]

    def observe(self, tokens: int, seconds: float) -> None:
        """A decoding pass over ``tokens`` rows took ``seconds``: update the curve (passes longer
        than the curve measured, or of no time, are ignored)."""
        if not 1 <= tokens < len(self.cost) or not seconds > 0:
            return
        passes = self._passes[tokens] = self._passes[tokens] + 1
        estimate = self._estimate[tokens]
        if passes <= self.SEEN:  # the first passes' minimum, as the start-up measurement takes one
            self._estimate[tokens] = seconds if passes == 1 else min(estimate, seconds)
        else:
            self._estimate[tokens] = estimate + (self.DOWN if seconds < estimate else self.UP) * (seconds - estimate)
        if passes >= self.SEEN:
            self._set_curve(self._refreshed())

    @property
    def observed_passes(self) -> int:
        return sum(self._passes)

    def _refreshed(self) -> list[float]:
        """The start-up curve scaled by the observed/start-up ratios (see the class docstring)."""
        last = len(self.startup) - 1
        seen = [t for t in range(1, last + 1) if self._passes[t] >= self.SEEN]
        ratio = {t: self._estimate[t] / self.startup[t] for t in seen}
        scale = [ratio[seen[0]]] * seen[0] + [ratio[seen[-1]]] * (last + 1 - seen[0])  # flat outside
        for a, b in zip(seen, seen[1:]):
            for t in range(a, b):
                scale[t] = ratio[a] + (ratio[b] - ratio[a]) * (t - a) / (b - a)
        cost = [0.0] + [self.startup[t] * scale[t] for t in range(1, last + 1)]
        if len(seen) >= 2:
            # Past the longest length seen, at most the line through the two longest: optimism
            # where nothing has been seen, so that a length made dear by the start-up gets tried
            # (verifying one draft more than pays at the observed cost) and then seen.
            s, p = seen[-1], seen[-2]
            slope = max(0.0, (self._estimate[s] - self._estimate[p]) / (s - p))
            for t in range(s + 1, last + 1):
                cost[t] = min(cost[t], self._estimate[s] + slope * (t - s))
        for t in range(2, last + 1):  # a longer pass never costs less
            cost[t] = max(cost[t], cost[t - 1])
        return cost

    @property
    def max_draft(self) -> int:
        return len(self.cost) - 2

    def cost_at(self, tokens: int) -> float:
        """Seconds of a pass over ``tokens`` rows, measured or extrapolated."""
        last = len(self.cost) - 1
        if tokens <= last:
            return self.cost[max(tokens, 1)]
        return self.cost[last] + self._slope * (tokens - last)

    def size(self, slots: Sequence[DraftSlot]) -> list[int]:
        """The ``DraftSizer`` of this policy: ``allocate`` over the slots of one pass (each row a
        slot feeds anyway yields one output token)."""
        return self.allocate([
            (slot.rows, slot.rows, slot.acceptance.first_accept(slot.bucket), slot.acceptance.next_accept(slot.bucket),
             len(slot.draft))
            for slot in slots
        ])

    def choose(self, max_len: int, a1: float, an: float) -> int:
        """The draft length in 0..max_len with the most expected tokens per second (one request)."""
        return self.allocate([(1, 1.0, a1, an, max_len)])[0]

    def allocate(self, requests: Sequence[tuple[int, float, float, float, int]]) -> list[int]:
        """Draft lengths for all the requests of one forward pass.

        Each request is ``(rows, tokens, a1, an, max_len)``: it feeds ``rows`` tokens to the pass
        anyway (its pending token and forced tokens, or a prompt chunk), which yield ``tokens``
        output tokens, and it may add up to ``max_len`` draft tokens. Draft token j of a request
        adds ``a1 * an^(j-1)`` expected tokens, and these gains fall with j, so the best m drafts
        of the whole pass are the m largest gains; the pass takes the m in 0..sum(max_len) with
        the most expected tokens per second, ``(tokens + gains) / cost(rows + m)``. With one
        request feeding one token this is the single-request rule in the module docstring; with
        several, a draft token has to pay for its row in a pass that already has many rows, so
        a batch drafts only its likeliest tokens.
        """
        rows = sum(r for r, _, _, _, _ in requests)
        base = sum(t for _, t, _, _, _ in requests)
        gains: list[tuple[float, int]] = []
        for index, (_, _, a1, an, max_len) in enumerate(requests):
            reach = a1
            for _ in range(min(max_len, self.max_draft)):
                gains.append((reach, index))
                reach *= an
        gains.sort(key=lambda g: -g[0])  # stable: a request's earlier drafts stay first on ties
        best_m, best_rate = 0, base / self.cost_at(rows)
        total = base
        for m, (gain, _) in enumerate(gains, 1):
            total += gain
            rate = total / self.cost_at(rows + m)
            if rate > best_rate:
                best_m, best_rate = m, rate
        lengths = [0] * len(requests)
        for _, index in gains[:best_m]:
            lengths[index] += 1
        return lengths
