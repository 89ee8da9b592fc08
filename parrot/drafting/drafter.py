"""The drafter interface: what the engine asks of every drafter, and what it may rely on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

TokenId = int


@dataclass(frozen=True)
class Draft:
    """A proposal: the tokens to verify, and how long the match behind them is.

    ``Draft([])`` is the one "no draft" value. ``match_length`` is the number of history tokens
    the proposal rests on (0 when the drafter has no such notion, as the n-gram model, or when
    there is no draft); the draft-length policy keeps acceptance statistics per bucket of it
    (``parrot.drafting.policy.match_bucket``).
    """

    tokens: list[TokenId]
    match_length: int = 0


class Drafter(Protocol):
    """Proposes the tokens likely to follow one request's sequence, from token ids alone.

    The contract, which the engine relies on and ``tests/test_drafting.py`` checks for every
    built-in method:

    - State: the *live sequence*, the prompt and then every token the request emitted, appended
      in order by ``extend``; and any number of *context documents* (``add_context``), tokens the
      drafter may copy from that are never part of the sequence (a source document, OpenAI
      Predicted Outputs). The engine adds the context before the prompt; a drafter accepts
      context at any time.
    - ``propose(max_len, after)`` drafts what follows ``live + after``, where ``after`` holds
      tokens certain to follow the sequence that ``extend`` has not seen yet (a grammar's forced
      tokens). At most ``max_len`` tokens; ``max_len <= 0`` gives no draft.
    - No draft is ``Draft([])``: never None, never the input handed back.
    - A draft never runs past a stop token: it ends right after the first one it contains.
    - Deterministic: the same calls in the same order give the same drafts. A drafter may keep
      state between calls (``SuffixDrafter`` follows a confirmed match), derived only from the
      tokens it was given.
    - Plain ints in, plain ints out: no model, no torch, so a drafter is tested on lists.

    Each drafter's docstring states its match policy (which match wins, how ties break) with a
    worked example: ``SuffixDrafter`` (the longest match; context before the live sequence; the
    most recent occurrence) and ``NGramDrafter`` (the most frequent follower; the first to reach
    that count on ties).
    """

    def extend(self, tokens: Iterable[TokenId]) -> None:
        """Append tokens to the live sequence."""
        ...

    def add_context(self, tokens: Sequence[TokenId]) -> None:
        """Index a context document, which is never part of the live sequence."""
        ...

    def propose(self, max_len: int, after: Sequence[TokenId] = ()) -> Draft:
        """Up to ``max_len`` tokens to follow ``live + after``; ``Draft([])`` when none."""
        ...
