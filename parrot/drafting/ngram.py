"""The N-gram Parrot model: count n-grams of the prompt and context, suggest likely continuations.

``NGramModel`` follows the seed paper ("Autocomplete Algorithm for Language Models", N-gram
Parrot): an n-gram language model is trained on the request's own text (prompt, extra context,
and then every accepted token), and ``suggest(context, threshold)`` walks forward greedily,
appending the most probable next token while the cumulative probability of the suggestion stays
above ``threshold``.

Estimation: for each order k = 1..n the model counts how often each token followed each
(k-1)-token history. The next-token distribution for a context uses the longest history that
has been seen (stupid back-off without discounting): p(t | h) = count(h, t) / count(h, *). The
most probable token is the most frequent follower; ties go to the follower that reached that
count first (stable, and it keeps the answer independent of dictionary order).

Worked example (n=3), training tokens ``[1, 2, 3, 1, 2, 4, 1, 2, 3]``: the history ``(1, 2)``
was followed by 3 twice and 4 once. ``suggest([9, 1, 2], threshold=0.5)`` first proposes 3 with
p=2/3; the history ``(2, 3)`` was followed only by 1 (p=1), cumulative 2/3; then ``(3, 1)`` by 2
(p=1), cumulative still 2/3; then ``(1, 2)`` again gives 3 at 2/3, cumulative 4/9 < 0.5, so the
walk stops: ``[3, 1, 2]``.

Training is incremental: ``update(tokens)`` costs O(n) per token.

``NGramDrafter`` is the ``Drafter`` of ``drafting.method = "ngram"``: it suggests with the model
trained on the live sequence and the context documents, ``max_len`` tokens at most.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from parrot.drafting.drafter import Draft, TokenId
from parrot.drafting.registry import DrafterSettings, register_drafter


class _Followers:
    """Follower counts of one history, with its most frequent follower kept up to date."""

    __slots__ = ("counts", "total", "best", "best_count")

    def __init__(self) -> None:
        self.counts: dict[TokenId, int] = {}
        self.total = 0
        self.best: TokenId = -1
        self.best_count = 0

    def add(self, token: TokenId) -> None:
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        if count > self.best_count:
            self.best, self.best_count = token, count


class NGramModel:
    """An order-``n`` n-gram model over token ids, trained incrementally."""

    def __init__(self, n: int = 4, tokens: Sequence[TokenId] = (), stop_token_ids: Iterable[TokenId] = ()) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = n
        self.stop_token_ids = frozenset(stop_token_ids)
        # _tables[k] maps a k-token history to its followers (k = 0 .. n-1).
        self._tables: list[dict[tuple[TokenId, ...], _Followers]] = [{} for _ in range(n)]
        # The last n-1 tokens of the training stream, so that update() can continue it.
        self._tail: list[TokenId] = []
        self.update(tokens)

    def update(self, tokens: Iterable[TokenId], *, history: Sequence[TokenId] | None = None) -> None:
        """Train on more tokens, continuing the last stream or, if given, after ``history``."""
        if history is not None:
            self._tail = list(history[len(history) - (self.n - 1) :]) if self.n > 1 else []
        tail = self._tail
        for token in tokens:
            for k in range(min(len(tail), self.n - 1) + 1):
                history = tuple(tail[len(tail) - k :]) if k else ()
                table = self._tables[k]
                followers = table.get(history)
                if followers is None:
                    followers = table[history] = _Followers()
                followers.add(token)
            tail.append(token)
            if len(tail) > self.n - 1:
                del tail[0]

    def next_token(self, context: Sequence[TokenId]) -> tuple[TokenId, float] | None:
        """The most probable next token and its probability, from the longest seen history."""
        for k in range(min(len(context), self.n - 1), -1, -1):
            history = tuple(context[len(context) - k :]) if k else ()
            followers = self._tables[k].get(history)
            if followers is not None:
                return followers.best, followers.best_count / followers.total
        return None

    def suggest(self, context: Sequence[TokenId], threshold: float, max_len: int = 16) -> list[TokenId]:
        """Greedy continuation while the cumulative probability stays above ``threshold``."""
        window = list(context[-(self.n - 1) :]) if self.n > 1 else []
        suggestion: list[TokenId] = []
        cumulative = 1.0
        while len(suggestion) < max_len:
            guess = self.next_token(window)
            if guess is None:
                break
            token, probability = guess
            cumulative *= probability
            if cumulative < threshold:
                break
            suggestion.append(token)
            if token in self.stop_token_ids:
                break
            window.append(token)
            if len(window) > self.n - 1:
                del window[0]
        return suggestion


class NGramDrafter:
    """A ``Drafter`` over an ``NGramModel``; its drafts have no match length (one policy bucket)."""

    def __init__(
        self,
        tokens: Sequence[TokenId] = (),
        *,
        n: int = 4,
        threshold: float = 0.1,
        stop_token_ids: Iterable[TokenId] = (),
    ) -> None:
        self.threshold = threshold
        self.model = NGramModel(n, stop_token_ids=stop_token_ids)
        self._live: list[TokenId] = []
        self.extend(tokens)

    @property
    def tokens(self) -> list[TokenId]:
        return self._live

    def add_context(self, tokens: Sequence[TokenId]) -> None:
        self.model.update(tokens, history=())
        # Later live tokens continue the live stream, not the context document.
        self.model.update((), history=self._live)

    def extend(self, tokens: Iterable[TokenId]) -> None:
        new = list(tokens)
        self.model.update(new)
        self._live.extend(new)

    def propose(self, max_len: int, after: Sequence[TokenId] = ()) -> Draft:
        if max_len <= 0 or not (self._live or after):
            return Draft([])
        context = self._live[-self.model.n :] + list(after) if after else self._live
        return Draft(self.model.suggest(context, self.threshold, max_len))


@register_drafter("ngram")
def _ngram_drafter(settings: DrafterSettings) -> NGramDrafter:
    return NGramDrafter(n=settings.max_n, threshold=settings.threshold, stop_token_ids=settings.stop_token_ids)
