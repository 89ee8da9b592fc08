"""Exact token budgeting over the served tokenizer: count, count up to a limit, split a text after
n tokens at a character boundary, truncate from either side, chunk, count chat messages.

Everything here equals a full re-encode by the served tokenizer (``Tokenizer.encode``), and
costs time proportional to the text it has to look at, never more than linear:

- Counts add up over pre-tokenized pieces (:mod:`parrot.tokenizer.pretokenize`), so a count is a sum of
  cached piece counts, and work can stop once the pieces read so far are over budget.
- A prefix ``text[:i]`` re-tokenizes only its last piece or two; BPE counts are not monotonic in
  i (appending can merge tokens and lower the count), so "the first n tokens of the full
  encoding" is not the answer. :meth:`TokenBudget.split_at_tokens` returns the longest prefix
  whose own encoding has at most n tokens: it reads pieces until the ones before the current
  piece need more than n tokens (no longer prefix can fit then), and evaluates the prefixes that
  end in the last pieces one by one.
- Pieces longer than ``long_piece`` characters (``'a' * n``, long letter runs, whitespace runs)
  go through the linear prefix/suffix tables of :mod:`parrot.tokenizer.bpe_tables` instead of being
  re-encoded per candidate, and stop by the window rule described there.

A character is a Unicode code point: offsets are Python string indices, and a split never falls
inside a code point (it may fall between a base letter and a combining mark, as in BPE itself).
Added tokens written in the text (``<|im_end|>``) count as one token each, as ``encode`` does.
Characters whose bytes have no token count as what the model receives (see
:mod:`parrot.tokenizer.bpe`); :meth:`TokenBudget.lost_characters` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Iterator, Literal, NamedTuple, Protocol

from parrot.tokenizer.appending import AppendingEncoder
from parrot.tokenizer.bpe import TokenId
from parrot.tokenizer.bpe_tables import PrefixEncoder, SuffixEncoder
from parrot.tokenizer.interval import IntervalCounter
from parrot.tokenizer.pieces import PieceCounter
from parrot.tokenizer.pretokenize import NO_SPECIAL

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Side = Literal["left", "right"]
Piece = tuple[int, int, TokenId]


class _Seen(NamedTuple):
    """A piece read by the prefix search."""

    start: int
    end: int
    special: TokenId
    before: int  # tokens of the pieces before it
    base: int  # where prefixes ending inside it are evaluated from
    base_total: int  # tokens before base
    join: str  # how it re-splits the previous piece: "", "special" or "space"
    start_clean: bool  # whether the prefix ending at its start has exactly `before` tokens


@dataclass(frozen=True)
class Chunk:
    """``text[start:end]`` of the chunked text, and its exact token count."""

    start: int
    end: int
    count: int
    text: str


@dataclass(frozen=True)
class Truncation:
    """What :meth:`TokenBudget.truncate` kept.

    ``side`` is the side that was cut: "right" keeps ``original[:offset]`` (the first tokens'
    worth), "left" keeps ``original[offset:]`` (the last tokens' worth, vLLM's
    ``truncate_prompt_tokens``). ``count`` is the exact token count of ``text``.
    """

    text: str
    count: int
    offset: int
    side: Side
    truncated: bool


class ChatTokenizer(Protocol):
    """What a budget reads of the served tokenizer (:class:`parrot.tokenizer.loader.Tokenizer`, which
    hands out its shared budget and so cannot be imported here)."""

    hf: PreTrainedTokenizerBase

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


class TokenBudget(PieceCounter):
    """Exact budgeting operations for one tokenizer; build once (about a second) and share it
    between requests and threads: its caches are dicts that are only filled (or cleared) with
    values that do not depend on who computed them. Whole-text ``encode`` and ``count`` come
    from :class:`~parrot.tokenizer.pieces.PieceCounter`."""

    def __init__(self, tokenizer: ChatTokenizer, long_piece: int = 64) -> None:
        """``long_piece``: pieces longer than this many characters use the linear tables (tests
        lower it to exercise them on short inputs)."""
        super().__init__(tokenizer.hf.backend_tokenizer, long_piece)
        self.tokenizer = tokenizer

    # -- whole texts --------------------------------------------------------------------------------

    def count_till_limit(self, text: str, limit: int) -> int | None:
        """The token count if it is at most ``limit``, else None; reads only about ``limit``
        tokens' worth of text."""
        _check_budget(limit)
        total = 0
        for s, e, special in self.pretokenizer.scan(text):
            if special != NO_SPECIAL:
                total += 1
            elif e - s <= self.long_piece:
                total += len(self.bpe.encode_piece(text[s:e]))
            else:
                _, _, whole = self._long_prefix(text, s, e, limit - total)
                if whole is None:
                    return None
                total += whole
            if total > limit:
                return None
        return total

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        """Tokens of the prompt the chat template makes of ``messages`` (as ``encode_chat``)."""
        return self.count(self.tokenizer.render_chat(messages, add_generation_prompt))

    def interval_counter(self, text: str) -> IntervalCounter:
        """An :class:`~parrot.tokenizer.interval.IntervalCounter` over ``text`` (one linear pass)."""
        return IntervalCounter(self, text)

    def appending_encoder(self) -> AppendingEncoder:
        """An empty :class:`~parrot.tokenizer.appending.AppendingEncoder`."""
        return AppendingEncoder(self)

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of characters the model does not see as written (bytes without a token)."""
        return self.bpe.lost_characters(text)

    # -- prefixes -----------------------------------------------------------------------------------

    def split_at_tokens(self, text: str, n: int) -> str:
        """The longest prefix whose own encoding has at most ``n`` tokens (ends on a character
        boundary; one more character does not fit, unless it is the whole text)."""
        _check_budget(n)
        return text[: self._longest_prefix(text, 0, n)[0]]

    def truncate(self, text: str, max_tokens: int, side: Side = "right") -> Truncation:
        """Keep the first (``side="right"``) or last (``side="left"``) ``max_tokens`` tokens'
        worth of text, cut at a character boundary; the kept text is as long as possible."""
        _check_budget(max_tokens)
        if side == "right":
            end, count, _ = self._longest_prefix(text, 0, max_tokens)
            return Truncation(text[:end], count, end, side, end < len(text))
        if side == "left":
            start, count = self._shortest_suffix(text, max_tokens)
            return Truncation(text[start:], count, start, side, start > 0)
        raise ValueError(f"side must be 'left' or 'right', not {side!r}")

    def chunk(self, text: str, max_tokens: int) -> list[Chunk]:
        """Consecutive pieces covering ``text`` exactly, each the longest prefix of what is left
        that fits in ``max_tokens`` tokens. Raises ValueError if one character needs more."""
        _check_budget(max_tokens)
        chunks: list[Chunk] = []
        pos, run_end = 0, None
        while pos < len(text):
            end, count, run_end = self._longest_prefix(text, pos, max_tokens, run_end)
            if end == pos:
                raise ValueError(f"the character at offset {pos} needs more than {max_tokens} tokens")
            chunks.append(Chunk(pos, end, count, text[pos:end]))
            pos = end
        return chunks

    def _longest_prefix(self, text: str, start: int, n: int, run_end: int | None = None) -> tuple[int, int, int | None]:
        """(end, count, run_end): the largest ``end`` with count(text[start:end]) <= n. When
        ``end`` falls inside a long run piece, ``run_end`` is that piece's end: a scan restarted
        at ``end`` sees ``text[end:run_end]`` as its first piece (the chunking loop passes it
        back, so that a megabyte run is not rescanned once per chunk)."""
        pieces: Iterator[Piece] = self.pretokenizer.scan(text, start)
        if run_end is not None and start < run_end and text[start] != "'":  # see _shortest_suffix
            pieces = chain([(start, run_end, NO_SPECIAL)], self.pretokenizer.scan(text, run_end))
        total = 0  # tokens of the pieces before the current one
        recent: list[_Seen] = []  # the last pieces read
        long_fit: dict[int, tuple[int, int]] = {}  # long piece start -> best fitting end, count
        for s, e, special in pieces:
            previous = recent[-1] if recent else None
            join = self._join(text, previous, s, special)
            base, base_total = (previous.start, previous.before) if previous and join else (s, total)
            if base_total > n:
                break  # every prefix ending here or later needs more than n tokens
            start_clean = previous is None or previous.join != "space"
            seen = _Seen(s, e, special, total, base, base_total, join, start_clean)
            if special != NO_SPECIAL:
                tokens: int | None = 1
            elif e - s <= self.long_piece:
                tokens = len(self.bpe.encode_piece(text[s:e]))
            else:
                long_fit[s], tokens = self._long_piece_fit(text, seen, n)
            recent = [*recent[-3:], seen]
            if tokens is None:
                break  # the window rule: no prefix ending after this piece's best fits
            total += tokens
        else:
            if total <= n:
                return len(text), total, None
        # Prefixes ending in the last pieces, longest first; one of them fits (see _join).
        for seen in reversed(recent):
            if seen.start in long_fit:
                fit_end, fit_count = long_fit[seen.start]
                if fit_end > seen.start:
                    return fit_end, fit_count, seen.end if fit_end < seen.end else None
            else:
                for i in range(seen.end, seen.start, -1):
                    count = seen.base_total + self.count_span(text, seen.base, i)
                    if count <= n:
                        return i, count, None
            if seen.start_clean and seen.before <= n:
                return seen.start, seen.before, None
        raise AssertionError("unreachable: a recent piece boundary fits")

    def _join(self, text: str, previous: _Seen | None, s: int, special: TokenId) -> str:
        """How a prefix ending inside the piece at ``s`` re-splits the previous piece, which is
        then the base to evaluate such prefixes from: "special" when the piece is an added token
        (a prefix cut inside it is text that the piece before may absorb), "space" when both are
        whitespace (a run followed by a non-space ends one character early, ``\\s+(?!\\S)``, so
        the previous piece depends on the character after this one), "" otherwise. A boundary
        after a "space" piece is not clean: the prefix ending there re-splits too. Chains do not
        happen (a whitespace piece never follows a "space" piece), so the start of the piece
        before the last one read always fits when reading stopped."""
        if previous is None or previous.end != s or previous.special != NO_SPECIAL:
            return ""
        if special != NO_SPECIAL:
            return "special"
        char_class = self.pretokenizer.char_class
        return "space" if char_class(text[s]) == "S" and char_class(text[s - 1]) == "S" else ""

    def _long_piece_fit(self, text: str, seen: _Seen, n: int) -> tuple[tuple[int, int], int | None]:
        """((end, count) of the longest prefix ending inside the run piece ``seen`` that fits in
        n, or (start, 0) if none does; the piece's token count, or None if reading stopped)."""
        s, e, total = seen.start, seen.end, seen.before
        fit_end, fit_count, whole = s, 0, None
        if total <= n:
            # After a "space" join, the prefix ending one character in re-splits: evaluated below.
            fit_end, fit_count, whole = self._long_prefix(text, s, e, n - total, seen.join == "space")
            fit_count += total
        if seen.join == "space" and fit_end < s + 2:
            count = seen.base_total + self.count_span(text, seen.base, s + 1)
            if count <= n:
                fit_end, fit_count = s + 1, count
        return (fit_end, fit_count), whole

    def _long_prefix(self, text: str, s: int, e: int, budget: int, skip_first: bool = False) -> tuple[int, int, int | None]:
        """Over the run piece ``text[s:e]``: (end, count) of its longest prefix with at most
        ``budget`` tokens (not counting the one-character prefix if ``skip_first``), and the
        piece's whole count, or None if the window rule stopped early."""
        encoder = PrefixEncoder(self.bpe)
        best_end, best_count = s, 0
        span = self.bpe.max_token_len
        pos, block = s, 256
        while pos < e:
            stop = min(e, pos + block)
            part = text[pos:stop]
            offsets, base = self.bpe.byte_offsets(part), len(encoder)
            encoder.extend(self.bpe.model_bytes(part))
            depth = encoder.depth
            for k in range(2 if skip_first and pos == s else 1, len(offsets)):
                if depth[base + offsets[k]] <= budget:
                    best_end, best_count = pos + k, depth[base + offsets[k]]
            if len(encoder) >= span and min(depth[len(encoder) - span + 1 :]) > budget and stop < e:
                return best_end, best_count, None
            pos, block = stop, min(2 * block, 1 << 16)
        return best_end, best_count, encoder.count()

    # -- suffixes -----------------------------------------------------------------------------------

    def _shortest_suffix(self, text: str, n: int) -> tuple[int, int]:
        """(start, count): the smallest ``start`` with count(text[start:]) <= n."""
        window = 4 * n + 256
        while True:
            q = self.pretokenizer.hard_boundary_at_or_before(text, max(0, len(text) - window))
            pieces = self.pretokenizer.spans(text, q)
            after: dict[int, int] = {len(text): 0}  # piece boundary -> tokens of the pieces after it
            best, best_count = len(text), 0
            for s, e, special in reversed(pieces):
                if special != NO_SPECIAL:
                    after[s] = after[e] + 1
                elif e - s <= self.long_piece:
                    after[s] = after[e] + len(self.bpe.encode_piece(text[s:e]))
                else:
                    # A suffix starting inside a run is one piece up to the run's end, except
                    # an apostrophe ending an "other" run: it may start a contraction ('s).
                    if after[e] > n:
                        return best, best_count
                    apostrophe = text[e - 1] == "'"
                    fit, fit_count, whole = self._long_suffix(text, s, e, n - after[e], apostrophe)
                    fit_count += after[e]
                    if apostrophe and fit == e:
                        count = self._suffix_count(text, e - 1, after)
                        if count <= n:
                            fit, fit_count = e - 1, count
                    if fit < best:
                        best, best_count = fit, fit_count
                    if whole is None:
                        return best, best_count
                    after[s] = after[e] + whole
                if after[s] <= n:
                    best, best_count = s, after[s]
                elif special != NO_SPECIAL or e - s <= self.long_piece:
                    # Suffixes starting inside this piece re-split it; they may still fit.
                    for i in range(s + 1, e):
                        count = self._suffix_count(text, i, after)
                        if count <= n:
                            best, best_count = i, count
                            break
                # A suffix starting before this piece re-synchronises with the true pieces by
                # the end of this piece at the latest, so it has at least after[e] tokens.
                if after[e] > n:
                    return best, best_count
            if q == 0:
                return best, best_count
            window *= 2

    def _suffix_count(self, text: str, i: int, after: dict[int, int]) -> int:
        """Tokens of ``text[i:]``: re-split from i until a piece ends on a known boundary."""
        total = 0
        for s, e, special in self.pretokenizer.scan(text, i):
            total += 1 if special != NO_SPECIAL else len(self.bpe.encode_piece(text[s:e]))
            if e in after:
                return total + after[e]
        return total

    def _long_suffix(self, text: str, s: int, e: int, budget: int, skip_last: bool = False) -> tuple[int, int, int | None]:
        """Over the run piece ``text[s:e]``: (start, count) of its longest suffix with at most
        ``budget`` tokens (not counting the one-character suffix if ``skip_last``), and the
        piece's whole count, or None if the window rule stopped early."""
        encoder = SuffixEncoder(self.bpe, self.bpe.model_bytes(text[s:e]))
        best_start, best_count = e, 0
        span = self.bpe.max_token_len
        pos, byte_pos, block = e, len(encoder.data), 256
        while pos > s:
            lo = max(s, pos - block)
            part = text[lo:pos]
            offsets = self.bpe.byte_offsets(part)
            byte_lo = byte_pos - offsets[-1]
            encoder.extend_to(byte_lo)
            depth = encoder.depth
            for k in range(len(offsets) - (3 if skip_last and pos == e else 2), -1, -1):
                if depth[byte_lo + offsets[k]] <= budget:
                    best_start, best_count = lo + k, depth[byte_lo + offsets[k]]
            window = depth[byte_lo : byte_lo + span]
            if len(window) == span and min(window) > budget and lo > s:
                return best_start, best_count, None
            pos, byte_pos, block = lo, byte_lo, min(2 * block, 1 << 16)
        return best_start, best_count, encoder.count(0)


def _check_budget(n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"a token budget must be a non-negative integer, not {n!r}")
