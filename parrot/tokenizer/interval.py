"""Exact token counts of any character range of one text, after one linear pass.

:class:`IntervalCounter` pre-tokenizes the text once, keeps prefix sums of piece token counts,
and builds :class:`~parrot.tokenizer.bpe_tables.PieceIntervals` for every piece longer than the
budget's ``long_piece``. The count of ``text[start:end]`` is then

- a few re-split pieces at the head: a range that starts inside a piece is re-split from
  ``start`` until one of its pieces ends on a boundary of the full text (after that the scan is
  the full text's scan again). A range starting inside a run is that run's suffix, one piece;
- the prefix-sum difference over the whole pieces in between;
- the tail: the piece holding ``end - 1`` cut at ``end`` (a run's prefix is one piece), re-split
  together with the piece before it when the cut makes them one (a cut inside an added token, or
  one character into a whitespace piece that a whitespace run ended early for).

A range inside one long piece is a sub-range of that piece's bytes, counted by its table. A
query costs a few pattern matches and cached piece counts; only a range cut at those rare
joins next to a very long piece re-encodes that piece (linear in it).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right

from parrot.tokenizer.bpe_tables import PieceIntervals
from parrot.tokenizer.pieces import PieceCounter
from parrot.tokenizer.pretokenize import NO_SPECIAL


class IntervalCounter:
    """``IntervalCounter(budget, text).count(start, end)`` == ``budget.count(text[start:end])``."""

    def __init__(self, budget: PieceCounter, text: str) -> None:
        self.text = text
        self._budget = budget
        bpe = budget.bpe
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._special: list[bool] = []
        counts = array("q")
        self._long: dict[int, tuple[PieceIntervals, array[int]]] = {}  # piece index -> table, offsets
        boundary = bytearray(len(text) + 1)  # 1 at every piece boundary of the full text
        for index, (s, e, special) in enumerate(budget.pretokenizer.scan(text)):
            self._starts.append(s)
            self._ends.append(e)
            self._special.append(special != NO_SPECIAL)
            boundary[s] = boundary[e] = 1
            if special != NO_SPECIAL:
                counts.append(1)
            elif e - s <= budget.long_piece:
                counts.append(len(bpe.encode_piece(text[s:e])))
            else:
                table = PieceIntervals(bpe, bpe.model_bytes(text[s:e]))
                self._long[index] = (table, array("i", bpe.byte_offsets(text[s:e])))
                counts.append(table.depth[0])
        self._boundary = boundary
        self._prefix = array("q", [0]) * (len(counts) + 1)  # tokens of the pieces before index i
        for i, c in enumerate(counts):
            self._prefix[i + 1] = self._prefix[i] + c

    @property
    def total(self) -> int:
        return self._prefix[-1]

    def count(self, start: int, end: int) -> int:
        """Exact token count of ``text[start:end]``."""
        if not 0 <= start <= end <= len(self.text):
            raise ValueError(f"range [{start}, {end}) is outside the text (length {len(self.text)})")
        if start == end:
            return 0
        starts, ends, prefix = self._starts, self._ends, self._prefix
        first = bisect_right(starts, start) - 1  # piece holding start
        last = bisect_right(starts, end - 1) - 1  # piece holding end - 1
        if first == last:
            if start == starts[first] and end == ends[first]:
                return prefix[first + 1] - prefix[first]
            if first in self._long:
                return self._long_count(first, start, end)
            return self._budget.count_span(self.text, start, end)
        # Head: from start to the first boundary of the full text that a re-split reaches.
        head, sync = 0, start
        if start != starts[first]:
            # A run's suffix is one piece, unless an apostrophe ending an "other" run starts a
            # contraction with what follows ('s): then re-split.
            if first in self._long and self.text[start] != "'":
                head, sync = self._long_count(first, start, ends[first]), ends[first]
            else:
                head, sync = self._resplit(start, end)
                if sync == end:
                    return head
        sync_index = bisect_right(starts, sync) - 1
        # Tail: where the last piece must be re-split from, and what it adds.
        base = last
        cut_inside = end < ends[last]
        if last > 0 and ends[last - 1] == starts[last] and not self._special[last - 1]:
            if self._special[last] and cut_inside:
                base = last - 1  # a cut inside an added token: its text joins the piece before
            elif end == starts[last] + 1 and self._joins_space(last):
                base = last - 1  # one character into a whitespace piece after a whitespace run
        if base < sync_index:
            return self._budget.count_span(self.text, start, end)  # head and tail meet: short
        if base == last and not cut_inside:
            return head + prefix[last + 1] - prefix[sync_index]
        if base == last and last in self._long:
            tail = self._long_count(last, starts[last], end)
        else:
            tail = self._budget.count_span(self.text, starts[base], end)
        return head + prefix[base] - prefix[sync_index] + tail

    def _resplit(self, start: int, end: int) -> tuple[int, int]:
        """(tokens, position): re-split ``text[start:end]`` until a piece ends on a boundary of
        the full text (or at end)."""
        tokens = 0
        encode_piece = self._budget.bpe.encode_piece
        for s, e, special in self._budget.pretokenizer.scan(self.text, start, end):
            tokens += 1 if special != NO_SPECIAL else len(encode_piece(self.text[s:e]))
            if self._boundary[e] and e < end - 1 or e == end:
                return tokens, e
        return tokens, end

    def _joins_space(self, index: int) -> bool:
        char_class = self._budget.pretokenizer.char_class
        s = self._starts[index]
        return s > 0 and char_class(self.text[s]) == "S" and char_class(self.text[s - 1]) == "S"

    def _long_count(self, index: int, start: int, end: int) -> int:
        table, offsets = self._long[index]
        s = self._starts[index]
        return table.count(offsets[start - s], offsets[end - s])
