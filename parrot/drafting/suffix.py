"""Longest-suffix matching: propose the tokens that followed the longest earlier match.

Match policy (what ``SuffixDrafter.propose`` returns):

1. The *longest* match wins. For n from ``max_n`` down to ``min_n`` we look up the last n tokens
   of the live sequence (prompt + generated tokens) among the n-grams seen earlier; the first n
   that is found is used. A longer match has more context, so its continuation is more likely
   to be the one the model will produce.
2. Among occurrences of that n-gram, extra drafting context wins over the live sequence (that
   context exists to predict the output: a source document, OpenAI's Predicted Outputs). Within
   one source the first occurrence *after the last confirmed copy* wins: where the drafter last
   followed a match that the output confirmed, the next copy from that source most likely comes
   later in it (a summary takes an article's sentences front to back, an edit a file's lines).
   Without a confirmed copy in that source, or without an occurrence after it, the *most recent*
   occurrence wins (the text being produced now is most often a continuation of the latest copy).
   On the 1.5B coder's answers this mattered at the joins after reworded text, where only a 1-
   or 2-token match is left: the first drafted token there was right 23% (1-token matches) and
   53% (2-token) of the time with the most recent occurrence, 31% and 59% with this rule
   (summaries; ``loadtests/replay_drafting.py``).
3. A match that keeps being confirmed is followed: after a proposal from position p, when the
   next k tokens appended to the sequence equal source[p:p+k], the next proposal continues at
   p+k as long as that run (counted from the start of the match) is at least as long as the
   best fresh lookup. Without this, a phrase that occurs twice in a document would make the
   drafter jump to its latest occurrence half way through copying the first one.

Worked example (``min_n=1, max_n=3``), live sequence ``[5, 6, 7, 9, 5, 6, 7, 8, 5, 6]`` and no
extra context. The last 3 tokens ``[7, 8, 5]`` never occurred before, so n=3 fails; the last 2
tokens ``[5, 6]`` occurred at positions 0 and 4; the most recent one (4) wins, and the proposal is
what followed it: ``[7, 8, 5, 6]`` (up to ``max_len``). The older occurrence would have proposed
``[7, 9, ...]``.

Rule 2's cursor, same settings: live ``[1, 2, 3, 4, 1, 5, 9, 1, 6, 0, 2]``. The suffix ``[2]``
matched at position 1, so the proposal is ``[3, 4, ...]``; the output then confirms ``3`` (the
last confirmed copy ends at position 3), writes ``8`` and ``1``. Now only ``[1]`` matches, and it
occurred with continuations at 1, 5 and 8: the first after 3 wins, proposing ``[5, 9, ...]``
where the most recent would have proposed ``[6, 0, ...]``.

Incremental cost: ``extend`` indexes each new token's n-grams (O(max_n) dictionary writes per
token, each hashing at most max_n ints); ``propose`` does at most max_n lookups, a binary search
among the matched n-gram's occurrences, and the slice it returns. Nothing is ever rebuilt, so
proposing on an 8k-token context costs about the same as on a 100-token one.

The drafter never proposes past an end-of-sequence token: a proposal stops right after the first
token in ``stop_token_ids``. ``Draft([])`` means "no draft"; a draft's ``match_length`` is the n
of the match it continues. This is the ``Drafter`` of ``drafting.method = "suffix"``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

from parrot.drafting.drafter import Draft, TokenId
from parrot.drafting.registry import DrafterSettings, register_drafter

# Source ids: 0 is the live sequence; 1, 2, ... are extra context documents in the order added.
_LIVE = 0


class SuffixDrafter:
    """Per-request index of every n-gram (min_n <= n <= max_n) of the sequence and its context."""

    def __init__(
        self,
        tokens: Sequence[TokenId] = (),
        *,
        min_n: int = 1,
        max_n: int = 8,
        stop_token_ids: Iterable[TokenId] = (),
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self.stop_token_ids = frozenset(stop_token_ids)
        # _sources[s] is the token list of source s; _sources[0] is the live sequence.
        self._sources: list[list[TokenId]] = [[]]
        # n-gram -> the start of its continuation, or the starts in order of occurrence when it
        # occurred more than once (most n-grams of 3 or more tokens occur once: a list each would
        # double the index, 7 -> 12 MB for 8k tokens); one dict per kind of source so that
        # context matches can win ties against the live sequence (policy rule 2).
        self._context_index: dict[tuple[TokenId, ...], tuple[int, int] | list[tuple[int, int]]] = {}
        self._live_index: dict[tuple[TokenId, ...], int | list[int]] = {}
        # The match being followed (policy rule 3): source, next position, run length so far.
        self._follow: tuple[int, int, int] | None = None
        # Where the last confirmed copy ended (rule 2): source, position of its next token.
        self._cursor: tuple[int, int] | None = None
        self.extend(tokens)

    @property
    def tokens(self) -> list[TokenId]:
        """The live sequence (prompt + accepted tokens)."""
        return self._sources[_LIVE]

    def add_context(self, tokens: Sequence[TokenId]) -> None:
        """Index extra drafting context that is never fed to the model."""
        source = len(self._sources)
        doc = list(tokens)
        self._sources.append(doc)
        for end in range(1, len(doc)):
            # n-grams ending at end-1 whose continuation starts at `end`, in order of occurrence.
            for n in range(self.min_n, min(self.max_n, end) + 1):
                _add(self._context_index, tuple(doc[end - n : end]), (source, end))

    def extend(self, tokens: Iterable[TokenId]) -> None:
        """Append accepted tokens to the live sequence: O(max_n) work per token."""
        live = self._sources[_LIVE]
        for token in tokens:
            end = len(live)
            # Index the n-grams ending at the current last token now that their continuation
            # (`token`) exists. The n-gram ending at the new token is indexed on the next append:
            # an occurrence is only useful once something follows it, and this keeps the
            # sequence's own suffix from matching itself.
            for n in range(self.min_n, min(self.max_n, end) + 1):
                _add(self._live_index, tuple(live[end - n : end]), end)
            live.append(token)
            self._advance_follow(token)

    def _advance_follow(self, token: TokenId) -> None:
        if self._follow is None:
            return
        source, pos, run = self._follow
        doc = self._sources[source]
        if pos < len(doc) and doc[pos] == token and (source != _LIVE or pos < len(doc) - 1):
            self._follow = (source, pos + 1, run + 1)
            self._cursor = (source, pos + 1)
        else:
            self._follow = None

    def _lookup(self, after: Sequence[TokenId] = ()) -> tuple[int, int, int] | None:
        """(source, continuation start, match length) of the longest most-preferred match."""
        live = self._sources[_LIVE]
        tail = live[-self.max_n :] + list(after) if after else live
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            key = tuple(tail[-n:])
            hits = self._context_index.get(key)
            if hits is not None:
                return (*self._pick_context(hits if isinstance(hits, list) else [hits]), n)
            starts = self._live_index.get(key)
            if starts is not None:
                return _LIVE, self._pick_live(starts if isinstance(starts, list) else [starts]), n
        return None

    def _pick_context(self, hits: list[tuple[int, int]]) -> tuple[int, int]:
        """Rule 2 among a context n-gram's occurrences, (source, start) in order of occurrence:
        the first after the cursor in the cursor's document, else the most recent."""
        if self._cursor is not None:
            i = bisect.bisect_right(hits, self._cursor)
            if i < len(hits) and hits[i][0] == self._cursor[0]:
                return hits[i]
        return hits[-1]

    def _pick_live(self, starts: list[int]) -> int:
        """Rule 2 among a live n-gram's continuation starts, in order: the first after the
        cursor when it is in the live sequence, else the most recent."""
        if self._cursor is not None and self._cursor[0] == _LIVE:
            i = bisect.bisect_right(starts, self._cursor[1])
            if i < len(starts):
                return starts[i]
        return starts[-1]

    def propose(self, max_len: int, after: Sequence[TokenId] = ()) -> Draft:
        """Up to ``max_len`` tokens that followed the best match; ``Draft([])`` when there is none.

        ``after``: tokens that will certainly follow the sequence (a grammar's forced tokens);
        the proposal continues after them. Such a lookup does not start following a match.
        """
        if max_len <= 0:
            return Draft([])
        if after:
            self._follow = None
            match = self._lookup(after)
            return Draft([]) if match is None else self._draft(match, max_len)
        candidates = [m for m in (self._follow, self._lookup()) if m is not None]
        # Rule 3: the followed run wins unless a fresh lookup found a strictly longer match.
        candidates.sort(key=lambda m: -m[2])
        for match in candidates:
            draft = self._draft(match, max_len)
            if draft.tokens:
                self._follow = match
                return draft
        self._follow = None
        return Draft([])

    def _draft(self, match: tuple[int, int, int], max_len: int) -> Draft:
        """What follows ``match`` (source, continuation start, length), ended after a stop token."""
        source, pos, length = match
        tokens = self._sources[source][pos : pos + max_len]
        for i, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return Draft(tokens[: i + 1], length)
        return Draft(tokens, length if tokens else 0)


def _add(index: dict[Any, Any], key: tuple[TokenId, ...], start: Any) -> None:
    """Record an occurrence of ``key``: its start alone the first time, then a list of them."""
    known = index.get(key)
    if known is None:
        index[key] = start
    elif isinstance(known, list):
        known.append(start)
    else:
        index[key] = [known, start]


@register_drafter("suffix")
def _suffix_drafter(settings: DrafterSettings) -> SuffixDrafter:
    return SuffixDrafter(min_n=settings.min_n, max_n=settings.max_n, stop_token_ids=settings.stop_token_ids)
