"""Exact token budgeting for any BPE vocabulary :class:`~parrot.tokenizer.vocabulary.Vocabulary`
accepts (Llama 3, Qwen2, DeepSeek, StarCoder, GPT-2 byte-level BPE; Llama 2, Mistral, Gemma
SentencePiece BPE): the same operations as :class:`~parrot.tokenizer.budget.TokenBudget`, which
keeps the SmolLM2 vocabulary's own faster path.

Everything rests on one operation, :meth:`Index.count`: after one pass that splits a text into
its pieces (:mod:`parrot.tokenizer.splitter`) and sums their counts, the count of any range is

- the *head*: the range's own first pieces, re-split from its start (in windows that grow
  fourfold) until one of them is a piece of the whole text too, and final: from there on the
  range's pieces are the text's (the scan starts over at the same place, with the same text to
  its right);
- the prefix-sum difference over the text's pieces in between;
- the *tail*: re-split from the last boundary whose pieces before it cannot depend on where the
  range ends (:meth:`Splitter.settled`: usually the start of the piece holding the range's end).

A re-split piece that is not one of the text's is counted by BPE (cached for short pieces), or,
inside a piece of thousands of characters, by that piece's linear interval table
(:class:`~parrot.tokenizer.bpe_tables.PieceIntervals`, built on first use). A query costs a few
re-split windows: near-constant for text with spaces and line breaks. A SentencePiece vocabulary
with a prepended ``▁`` (Llama 2) makes a range that starts inside a segment its own first piece
(``▁`` + the rest of the segment), counted whole: linear in the segment.

The prefix operations (split, truncate on the right, chunk) use the same rule: the pieces before
a settled boundary are final, so once those before some boundary exceed n tokens, no prefix that
reaches past it fits; the prefixes ending before it are counted one by one, longest first. The
suffix operation (truncate on the left) is the mirror image: starts are evaluated from two
pieces before the place where the pieces after it exceed n, shortest suffix last; every count
returned is exact.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from typing import Any

from parrot.tokenizer.bpe import TokenId
from parrot.tokenizer.bpe_tables import PieceIntervals, PrefixEncoder
from parrot.tokenizer.splitter import NO_SPECIAL, Piece, Splitter
from parrot.tokenizer.vocabulary import Vocabulary

LONG_PIECE = 4096  # characters: a cut piece longer than this is counted by its interval table
OPEN_PIECE = 64  # characters: a longer last piece of appended text is counted by a growing prefix table
SEARCH_LONG_PIECE = 256  # the same where one piece is cut at many places (prefix and suffix searches)


class GeneralBudget:
    """Exact budgeting over one tokenizer (see the module docstring); build once and share."""

    def __init__(self, tokenizer: Any, long_piece: int = LONG_PIECE) -> None:
        """``tokenizer``: :class:`parrot.tokenizer.loader.Tokenizer`. ``long_piece``: tests lower it
        to exercise the interval tables on short texts. Raises
        :class:`~parrot.tokenizer.bpe.UnsupportedTokenizer` with the reason."""
        backend = tokenizer.hf.backend_tokenizer
        self.tokenizer = tokenizer
        self.vocab = Vocabulary(backend)
        self.splitter = Splitter(backend, self.vocab)
        self.long_piece = long_piece

    # -- whole texts --------------------------------------------------------------------------

    def encode(self, text: str) -> list[TokenId]:
        return self.tokenizer.encode(text)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        return self.count(self.tokenizer.render_chat(messages, add_generation_prompt))

    def count_till_limit(self, text: str, limit: int) -> int | None:
        """The token count if it is at most ``limit``, else None; reads about ``limit`` tokens'
        worth of text when the text is over it."""
        _check_budget(limit)
        window = 4 * limit + 256
        while window < len(text):
            index = Index(self, text[:window])
            if index.settled_tokens() > limit:
                return None
            window *= 2
        total = self.count(text)
        return total if total <= limit else None

    def interval_counter(self, text: str) -> "Index":
        return Index(self, text)

    def appending_encoder(self) -> "AppendingCounter":
        return AppendingCounter(self)

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of characters the model does not see as written (bytes without a token)."""
        return self.vocab.lost_characters(text)

    # -- prefixes and suffixes ------------------------------------------------------------------

    def split_at_tokens(self, text: str, n: int) -> str:
        _check_budget(n)
        return text[: self._longest_prefix(text, 0, n)[0]]

    def truncate(self, text: str, max_tokens: int, side: str = "right") -> Any:
        from parrot.tokenizer.budget import Truncation

        _check_budget(max_tokens)
        if side == "right":
            end, count = self._longest_prefix(text, 0, max_tokens)
            return Truncation(text[:end], count, end, side, end < len(text))
        if side == "left":
            start, count = self._shortest_suffix(text, max_tokens)
            return Truncation(text[start:], count, start, side, start > 0)
        raise ValueError(f"side must be 'left' or 'right', not {side!r}")

    def chunk(self, text: str, max_tokens: int) -> list[Any]:
        from parrot.tokenizer.budget import Chunk

        _check_budget(max_tokens)
        chunks, pos = [], 0
        while pos < len(text):
            end, count = self._longest_prefix(text, pos, max_tokens)
            if end == pos:
                raise ValueError(f"the character at offset {pos} needs more than {max_tokens} tokens")
            chunks.append(Chunk(pos, end, count, text[pos:end]))
            pos = end
        return chunks

    def _longest_prefix(self, text: str, start: int, n: int) -> tuple[int, int]:
        """(end, count): the largest ``end`` with count(text[start:end]) <= n."""
        window = 4 * n + 256
        while True:
            stop = min(len(text), start + window)
            complete = stop == len(text)
            index = Index(self, text[start:stop], SEARCH_LONG_PIECE)
            local, prefix, pieces = index.text, index.prefix, index.pieces
            k = bisect_right(prefix, n) - 1  # prefix[k] <= n < prefix[k + 1]: piece k overflows
            if k >= len(pieces):
                if complete:
                    return len(text), prefix[-1]
                window *= 2
                continue
            end_k = pieces[k].end
            if not complete and not self.splitter.settled(local, end_k, index.segment_end(len(local))):
                window *= 2
                continue
            # A prefix reaching past `upper` has end_k as a settled boundary: over n.
            upper = self.splitter.settled_from(local, end_k) - 1
            for piece in pieces[k + 1 :]:
                if piece.start > upper + 1:
                    break
                if piece.special != NO_SPECIAL:  # a prefix cutting it re-splits what is before it
                    upper = max(upper, piece.end - 1)
            if not complete and upper >= len(local):
                window *= 2
                continue
            for i in range(min(upper, len(local)), 0, -1):
                count = index.count(0, i)
                if count <= n:
                    return start + i, count
            return start, 0

    def _shortest_suffix(self, text: str, n: int) -> tuple[int, int]:
        """(start, count): the smallest ``start`` found with count(text[start:]) <= n."""
        window = 4 * n + 256
        while True:
            first = max(0, len(text) - window)
            index = Index(self, text[first:], SEARCH_LONG_PIECE)
            prefix, pieces = index.prefix, index.pieces
            total = prefix[-1]
            if total <= n:
                if first == 0:
                    return 0, total
                window *= 2
                continue
            k = bisect_left(prefix, total - n) - 1  # the pieces from k on hold more than n tokens
            if k < 3 and first > 0:
                window *= 2  # keep the window's own first pieces away from the answer
                continue
            lo = pieces[max(0, k - 2)].start
            for i in range(lo, len(index.text) + 1):
                count = index.count(i, len(index.text))
                if count <= n:
                    return first + i, count
            raise AssertionError("unreachable: the empty suffix fits")


class Index:
    """``Index(budget, text).count(start, end)`` == ``budget.count(text[start:end])`` (see the
    module docstring)."""

    def __init__(self, budget: GeneralBudget, text: str, long_piece: int | None = None) -> None:
        """``long_piece``: cut pieces of longer ones are counted by tables (the budget's by
        default; the prefix and suffix searches, which cut one piece many times, lower it)."""
        self.text = text
        self._budget = budget
        self._long_piece = budget.long_piece if long_piece is None else long_piece
        self._splitter = budget.splitter
        self._vocab = budget.vocab
        self.pieces = self._splitter.pieces(text)
        self.starts = [p.start for p in self.pieces]
        count_model = self._vocab.count_model
        counts = [1 if p.special != NO_SPECIAL else count_model(p.model) for p in self.pieces]
        self._counts = counts
        prefix = array("q", [0]) * (len(counts) + 1)
        total = 0
        for i, c in enumerate(counts):
            total += c
            prefix[i + 1] = total
        self.prefix = prefix
        self._tables: dict[int, tuple[PieceIntervals, array[int]]] = {}

    @property
    def total(self) -> int:
        return self.prefix[-1]

    def settled_tokens(self) -> int:
        """Tokens of the pieces that no text continuing this one can change."""
        k = len(self.pieces) - 1
        while k > 0 and not self._splitter.settled(self.text, self.starts[k], len(self.text)):  # (no cut token)
            k -= 1
        return self.prefix[k] if k > 0 else 0

    def count(self, start: int, end: int) -> int:
        """Exact token count of ``text[start:end]``."""
        text = self.text
        if not 0 <= start <= end <= len(text):
            raise ValueError(f"range [{start}, {end}) is outside the text (length {len(text)})")
        if start == end:
            return 0
        starts = self.starts
        i = bisect_left(starts, start)
        if i < len(starts) and starts[i] == start and (not self._splitter.prepend or self._segment_start(i)):
            head, first = 0, i
        else:
            head, synced = self._head(start, end)
            if synced is None:
                return head
            first = synced
        # Tail: from the last boundary whose pieces before it do not depend on the range's end.
        k = bisect_right(starts, end - 1) - 1
        final = self.segment_end(end)
        while k > first and not self._splitter.settled(text, starts[k], final):
            k -= 1
        while k > first and starts[k - 1] == starts[k]:
            k -= 1  # a prepended ``▁`` piece belongs with the piece after it
        tail_pieces = self._splitter.pieces(text, starts[k], end, starts[k] == start or self._segment_start(k))
        tail = sum(self._count_piece(p) for p in tail_pieces)
        return head + self.prefix[k] - self.prefix[first] + tail

    def segment_end(self, end: int) -> int:
        """Where the text cut at ``end`` stops being the same to a pre-tokenizer: ``end``, or the
        start of the added token that ``end`` cuts (its characters become text, which a scan of
        the segment before it reads on into)."""
        i = bisect_right(self.starts, end - 1) - 1
        if i >= 0 and self.pieces[i].special != NO_SPECIAL and self.starts[i] < end < self.pieces[i].end:
            return self.starts[i]
        return end

    def _segment_start(self, i: int) -> bool:
        """Whether a segment begins at piece i (the text's start, or right after an added token)."""
        start = self.starts[i]
        if start == 0:
            return True
        j = bisect_left(self.starts, start) - 1
        return j >= 0 and self.pieces[j].special != NO_SPECIAL and self.pieces[j].end == start

    def _head(self, start: int, end: int) -> tuple[int, int | None]:
        """(tokens before the sync point, index of the text's piece there), or (the range's
        whole count, None) when the range ends before its pieces meet the text's."""
        window = 24
        splitter = self._splitter
        while True:
            stop = min(end, start + window)
            pieces = splitter.pieces(self.text, start, stop, True)
            if stop == end:
                return sum(self._count_piece(p) for p in pieces), None
            final = self.segment_end(stop)
            for n, piece in enumerate(pieces):
                if not splitter.settled(self.text, piece.end, final):
                    break
                same = self._same_piece(piece)
                if same is not None:
                    return sum(self._count_piece(p) for p in pieces[:n]), same
            window *= 4

    def _same_piece(self, piece: Piece) -> int | None:
        i = bisect_left(self.starts, piece.start)
        while i < len(self.pieces) and self.starts[i] == piece.start:
            if self.pieces[i] == piece:
                return i
            i += 1
        return None

    def _count_piece(self, piece: Piece) -> int:
        """Tokens of a re-split piece: the text's own count when it is one of its pieces; a cut of a
        long piece by that piece's table; else BPE."""
        if piece.special != NO_SPECIAL:
            return 1
        i = bisect_right(self.starts, piece.start) - 1
        if i >= 0:
            whole = self.pieces[i]
            if whole == piece:
                return self._counts[i]
            long_piece = self._long_piece
            if (whole.special == NO_SPECIAL and piece.end <= whole.end and whole.end - whole.start > long_piece
                    and piece.end - piece.start > long_piece // 4):
                counted = self._table_count(i, piece)
                if counted is not None:
                    return counted
        return self._vocab.count_model(piece.model)

    def _table_count(self, i: int, piece: Piece) -> int | None:
        vocab, whole = self._vocab, self.pieces[i]
        if piece.model != vocab.model_text(self.text[piece.start : piece.end]):
            return None  # a prepended ``▁``: not a range of the whole piece's bytes
        table = self._tables.get(i)
        if table is None:
            raw = self.text[whole.start : whole.end]
            lead = len(vocab.model_bytes(whole.model)) - len(vocab.model_bytes(vocab.model_text(raw)))
            offsets = array("i", [lead])
            for ch in raw:
                offsets.append(offsets[-1] + len(vocab.model_bytes(vocab.model_text(ch))))
            table = self._tables[i] = (PieceIntervals(vocab, vocab.model_bytes(whole.model)), offsets)  # type: ignore[arg-type]
        intervals, offsets = table
        x, y = offsets[piece.start - whole.start], offsets[piece.end - whole.start]
        if vocab.whole_token(intervals.data[x:y]):
            return 1
        return intervals.count(x, y)


class AppendingCounter:
    """``append(text)``; then ``count`` and ``tokens`` equal a full encode of everything appended.

    Pieces that no later text can change (before a settled boundary, and before any place an
    added token could still start) are counted once and dropped; the rest, usually the last
    word or two (a SentencePiece vocabulary: the current line), is re-split on every append,
    and a long last piece is counted by a prefix table that grows with it."""

    def __init__(self, budget: GeneralBudget) -> None:
        self._splitter = budget.splitter
        self._vocab = budget.vocab
        self._settled: list[TokenId] = []
        self._rest = ""
        self._rest_count = 0
        self._segment_start = True
        self._length = 0
        self._open: tuple[str, PrefixEncoder] | None = None  # the last piece's spelling and prefix table

    def __len__(self) -> int:
        return self._length

    @property
    def count(self) -> int:
        return len(self._settled) + self._rest_count

    @property
    def tokens(self) -> list[TokenId]:
        rest = [t for p in self._splitter.pieces(self._rest, 0, None, self._segment_start) for t in self._ids(p)]
        return [*self._settled, *rest]

    def append(self, text: str) -> None:
        if not text:
            return
        self._length += len(text)
        rest = self._rest + text
        splitter = self._splitter
        pieces = splitter.pieces(rest, 0, None, self._segment_start)
        limit = splitter.special_start(rest)  # an added token may still begin here: the segment may end
        keep = 0  # pieces[:keep] are final
        for k in range(len(pieces) - 1, 0, -1):
            boundary = pieces[k].start
            if pieces[k - 1].start < boundary and splitter.settled(rest, boundary, limit):
                keep = k
                break
        for p in pieces[:keep]:
            self._settled.extend(self._ids(p))
        if keep:
            cut = pieces[keep].start
            self._segment_start = pieces[keep - 1].special != NO_SPECIAL
            rest = rest[cut:]
            pieces = [Piece(p.start - cut, p.end - cut, p.model, p.special) for p in pieces[keep:]]
        self._rest = rest
        count_model = self._vocab.count_model
        *others, last = pieces if pieces else [Piece(0, 0, "", NO_SPECIAL)]
        self._rest_count = sum(1 if p.special != NO_SPECIAL else count_model(p.model) for p in others)
        self._rest_count += self._count_last(last)

    def _count_last(self, last: Piece) -> int:
        """Tokens of the last piece: a long one (a line of a SentencePiece text, a run) grows as
        text is appended, so its prefix table is extended instead of encoding it again."""
        if last.special != NO_SPECIAL:
            self._open = None
            return 1
        if len(last.model) <= OPEN_PIECE:
            self._open = None
            return self._vocab.count_model(last.model)
        vocab = self._vocab
        if self._open is None or not last.model.startswith(self._open[0]):
            self._open = ("", PrefixEncoder(vocab))  # type: ignore[arg-type]
        grown, encoder = self._open
        encoder.extend(vocab.model_bytes(last.model[len(grown):]))
        self._open = (last.model, encoder)
        return encoder.count()

    def _ids(self, piece: Piece) -> list[TokenId]:
        return [piece.special] if piece.special != NO_SPECIAL else self._vocab.encode_model(piece.model)


def _check_budget(n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"a token budget must be a non-negative integer, not {n!r}")
