"""Count tokens exactly while text is appended, at a cost proportional to what is appended.

:class:`AppendingEncoder` keeps the text in two parts:

- *settled* pieces, whose tokens no later append can change: a piece ``[p, e)`` of the
  pre-tokenizer depends on the text up to ``e + 2`` at most (a whitespace run followed by a
  non-space ends one character early), and on whether an added token starts before that. So a
  piece settles once the text is two characters past it and no added token can still start
  (the earliest place one could, ``q``, is where the longest suffix that is a proper prefix of an
  added token begins) before its end + 2;
- the *unsettled* rest, re-split on every append: usually the last word. Its first piece may be
  a long run (``'a' * n``, a whitespace run), held as a :class:`~parrot.tokenizer.bpe_tables.PrefixEncoder`
  that is extended byte by byte, plus its last few characters. Re-splitting uses those last
  characters as a stand-in for the run: a suffix of a run splits like the run itself, so the
  stand-in's first piece ends where the run's piece ends, and the encoder gives the count of the
  run cut there. Appending characters of the run's own class only extends the encoder.

Typical text costs one or two pattern matches and a cached piece lookup per append.
"""

from __future__ import annotations

from typing import Sequence

from parrot.tokenizer.bpe import TokenId
from parrot.tokenizer.bpe_tables import PrefixEncoder
from parrot.tokenizer.pieces import PieceCounter
from parrot.tokenizer.pretokenize import NO_SPECIAL


class _Run:
    """A long run piece at the start of the unsettled text."""

    def __init__(self, budget: PieceCounter, text: str, keep: int) -> None:
        self.encoder = PrefixEncoder(budget.bpe)
        self.encoder.extend(budget.bpe.model_bytes(text))
        self.length = len(text)  # characters
        self.last = _stand_in(text, keep)  # its last characters, the stand-in for re-splitting
        self.cls = budget.pretokenizer.char_class(text[-1])
        self._bpe = budget.bpe
        self._keep = keep

    def extend(self, text: str) -> None:
        self.encoder.extend(self._bpe.model_bytes(text))
        self.length += len(text)
        self.last = _stand_in(self.last + text, self._keep)

    def truncate(self, chars: int) -> None:
        """Keep the run's first ``chars`` characters (within the stand-in's reach)."""
        cut = chars - (self.length - len(self.last))
        self.encoder.truncate(self.byte_offset(chars))
        self.length, self.last = chars, self.last[:cut]

    def byte_offset(self, chars: int) -> int:
        """Encoder offset of the run's first ``chars`` characters (within the stand-in's reach)."""
        cut = chars - (self.length - len(self.last))
        assert 0 <= cut <= len(self.last)
        return len(self.encoder) - len(self._bpe.model_bytes(self.last[cut:]))


def _stand_in(text: str, keep: int) -> str:
    """The last ``keep`` characters of a run, less a leading apostrophe (which could start a
    contraction such as ``'s`` that the run, an "other" run, did not)."""
    last = text[-keep:]
    return last[1:] if last.startswith("'") else last


class AppendingEncoder:
    """``append(text)``; then ``count`` and ``tokens`` equal a full encode of everything appended."""

    def __init__(self, budget: PieceCounter) -> None:
        self._budget = budget
        self._pre = budget.pretokenizer
        self._keep = max(self._pre.max_special_len, 2) + 2
        self._settled: list[TokenId] = []
        self._run: _Run | None = None
        self._rest = ""  # unsettled text after the run (all of it when there is no run)
        self._rest_tokens: Sequence[TokenId] = ()
        self._length = 0
        # Class of the one unsettled piece when appending that class can only extend it.
        self._grows: str | None = None
        self._long_piece = budget.long_piece
        self._encode_piece = budget.bpe.encode_piece
        self._special_last = self._pre.special_last_chars
        self._classes = self._pre.char_classes

    def __len__(self) -> int:
        return self._length

    @property
    def count(self) -> int:
        if self._run is None:
            return len(self._settled) + len(self._rest_tokens)
        return len(self._settled) + self._run.encoder.count() + len(self._rest_tokens)

    @property
    def tokens(self) -> list[TokenId]:
        """All token ids so far (a copy: linear in the text, unlike ``append``)."""
        run = self._run
        run_tokens = run.encoder.tokens() if run else []
        return [*self._settled, *run_tokens, *self._rest_tokens]

    def append(self, text: str) -> None:
        if not text:
            return
        self._length += len(text)
        pre = self._pre
        grows = self._grows
        if grows is not None and len(self._rest) + len(text) <= self._long_piece:
            if len(text) == 1:
                same = (self._classes.get(text) or pre.char_class(text)) == grows and text not in self._special_last
            else:
                same = pre.is_run_of(text, grows) and self._special_last.isdisjoint(text)
            if same:
                self._rest = rest = self._rest + text  # the last word grows
                self._rest_tokens = self._encode_piece(rest)
                return
        run = self._run
        if run is None and self._rest == " " and len(text) == 1 and text not in self._special_last:
            cls = pre.char_class(text)
            if cls == "L" or cls == "O":  # a space then a word: one piece, " ?\p{L}+"
                self._rest = rest = " " + text
                self._rest_tokens, self._grows = self._encode_piece(rest), cls
                return
        if run is None and self._plain_resplit(text):
            return
        if (
            run is not None
            and not self._rest
            and pre.is_run_of(text, run.cls)
            and not pre.special_last_chars.intersection(text)
        ):
            run.extend(text)  # the run piece just grows; no added token can complete
            return
        self._resplit(text)

    def _plain_resplit(self, text: str) -> bool:
        """The common re-split: no run and no added token anywhere near. False if it does not
        apply (then :meth:`_resplit` handles it)."""
        local = self._rest + text
        pre = self._pre
        if not pre.plain(local):
            return False
        spans = pre.plain_spans(local)
        # A piece depends on one character past its end; a whitespace piece on two, and so does
        # a lone apostrophe (``'re`` could still form).
        settle_before = min(len(local), pre.special_start(local)) - 1
        encode_piece, settled = self._encode_piece, self._settled
        index, count = 0, len(spans)
        space = pre.is_space
        while index < count:
            last = local[spans[index][1] - 1]
            if spans[index][1] > settle_before - (last == "'" or space(last)):
                break
            index += 1
        if index < count and spans[index][1] - spans[index][0] > self._long_piece:
            return False  # a long run begins the unsettled text: the general path makes it a run
        for s, e in spans[:index]:
            settled.extend(encode_piece(local[s:e]))
        if index == count:
            self._rest, self._rest_tokens, self._grows = "", (), None
            return True
        self._rest = rest = local[spans[index][0] :]
        if index == count - 1:
            self._rest_tokens = encode_piece(rest)
            cls = pre.char_class(rest[-1])
            first = rest[1] if rest[0] == " " and len(rest) > 1 else rest[0]
            self._grows = cls if cls != "D" and pre.char_class(first) == cls else None
        else:
            self._rest_tokens = [t for a, b in spans[index:] for t in encode_piece(local[a:b])]
            self._grows = None
        return True

    def _resplit(self, text: str) -> None:
        run, pre, bpe = self._run, self._pre, self._budget.bpe
        stand_in = run.last if run is not None else ""
        local = stand_in + self._rest + text
        pieces = pre.spans_of(local)
        # Pieces ending at or before this are final (see the module docstring).
        settle_before = pre.special_start(local) - 2
        index = 0
        if run is not None:
            # The stand-in's first piece ends where the run's piece ends.
            first_end = pieces[0][1] if pieces and pieces[0][0] == 0 and pieces[0][2] == NO_SPECIAL else 0
            grow = first_end - len(stand_in)
            if grow > 0:
                run.extend(local[len(stand_in) : first_end])
            elif grow < 0:  # the piece ends before the run does (a whitespace run, an added token)
                run.truncate(run.length + grow)
            if first_end > 0:
                index = 1
            if first_end > settle_before:
                self._keep_unsettled(local, pieces, index, first_end)
                return
            # The run's piece is final.
            self._settled.extend(run.encoder.tokens())
            self._run = None
        while index < len(pieces) and pieces[index][1] <= settle_before:
            s, e, special = pieces[index]
            self._settled.extend([special] if special != NO_SPECIAL else bpe.encode_piece(local[s:e]))
            index += 1
        if index < len(pieces) and pieces[index][2] == NO_SPECIAL:
            s, e, _ = pieces[index]
            if e - s > self._budget.long_piece:  # a long run begins the unsettled text
                self._run = _Run(self._budget, local[s:e], self._keep)
                index += 1
                self._keep_unsettled(local, pieces, index, e)
                return
        start = pieces[index][0] if index < len(pieces) else len(local)
        self._keep_unsettled(local, pieces, index, start)

    def _keep_unsettled(self, local: str, pieces: list[tuple[int, int, TokenId]], index: int, start: int) -> None:
        """The unsettled text after the run (or all of it) is ``local[start:]``, split as
        ``pieces[index:]``."""
        bpe = self._budget.bpe
        self._rest = local[start:]
        if len(pieces) == index + 1 and pieces[index][2] == NO_SPECIAL:
            self._rest_tokens = bpe.encode_piece(self._rest)
        else:
            rest_tokens: list[TokenId] = []
            for s, e, special in pieces[index:]:
                rest_tokens.extend([special] if special != NO_SPECIAL else bpe.encode_piece(local[s:e]))
            self._rest_tokens = rest_tokens
        self._grows = None
        if self._run is None and len(pieces) == index + 1 and pieces[index][2] == NO_SPECIAL:
            # One piece that is a run of one class (not a digit, not a contraction such as 's):
            # characters of that class extend it.
            piece = self._rest
            char_class = self._pre.char_class
            cls = char_class(piece[-1])
            first = piece[1] if piece[0] == " " and len(piece) > 1 else piece[0]
            if cls != "D" and char_class(first) == cls:
                self._grows = cls
