"""The pieces a BPE tokenizer encodes one by one, with their character offsets, for any
vocabulary :class:`~parrot.tokenizer.vocabulary.Vocabulary` accepts; the general budget
(:mod:`parrot.tokenizer.general`) counts over them.

`tokenizers` encodes a text in three stages, and the encoding is the concatenation of its pieces':

1. added tokens are cut out, leftmost-longest: first those matched in the raw text, then, in each
   stretch between them after normalization, those matched in normalized text (Gemma's runs of
   ``▁``). Each is one token. A stretch between two of them is a *segment*;
2. the segment is normalized (SentencePiece: spaces become ``▁``, and Prepend puts a ``▁`` in
   front of every segment) and pre-tokenized: byte-level vocabularies by their own pre-tokenizer
   (a regex split, digits, ByteLevel), run here by `tokenizers` itself on the segment's text, so
   the pieces are exactly its; SentencePiece vocabularies have no pre-tokenizer, and a segment is
   one piece, cut here around every character without a token (it falls back to byte tokens,
   which merge with nothing);
3. BPE encodes each piece.

Where a scan can start. Every stage reads left to right from where it stands: a scan of a
text that starts at a piece boundary ``p`` of a longer text, where no added token of it covers p,
gives that text's pieces from p on until its pieces depend on where the shorter text ends. So
counting any range needs only to re-split its ends (:class:`parrot.tokenizer.general.Index`).
How far right a piece depends: an added token or a SentencePiece piece on nothing past itself; a
regex piece that ends at ``r`` on the text up to the end of the whitespace run starting at r, and
one character more (``\\s+(?!\\S)`` and ``\\s*[\\r\\n]+`` read a whole whitespace run; the other
alternatives of these pre-tokenizers stop one character past their match). :meth:`Splitter.settled`
applies that rule; ``tests/test_tokenizer_general.py`` checks it, and everything built on it,
against `tokenizers` on every family's pre-tokenizer with adversarial texts.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from parrot.tokenizer.bpe import TokenId
from parrot.tokenizer.pretokenize import _S
from parrot.tokenizer.vocabulary import Vocabulary

NO_SPECIAL: TokenId = -1
_SPACE_RUN = re.compile(f"[{_S}]*")


class Piece(NamedTuple):
    """``text[start:end]`` is encoded as ``model`` (the model's spelling; a SentencePiece piece
    may carry a prepended ``▁`` that no character of the text stands for), or is the added token
    ``special``."""

    start: int
    end: int
    model: str
    special: TokenId


class Splitter:
    """Splits text into pieces exactly as the served `tokenizers` tokenizer does before BPE."""

    def __init__(self, backend: Any, vocab: Vocabulary) -> None:
        self.vocab = vocab
        config = vocab.config
        self.sentencepiece = vocab.spelling == "sentencepiece"
        self.prepend = self.sentencepiece and any(
            n.get("type") == "Prepend" for n in (config["normalizer"].get("normalizers") or [config["normalizer"]]))
        self.pre_tokenizer = backend.pre_tokenizer
        raw, normalized = {}, {}
        for t in config["added_tokens"]:
            # Matched in normalized text only when a normalizer exists (as `tokenizers` does).
            (normalized if t.get("normalized") and config.get("normalizer") else raw)[t["content"]] = t["id"]
        self.special_tokens = {**raw, **normalized}
        self._raw = raw
        self._raw_re = _alternation(raw, lambda s: re.escape(s))
        # A normalized added token (``▁▁``) matches raw text whose normalization it is.
        self._normalized_re = _alternation(normalized, _raw_pattern)
        self.max_special_len = max(map(len, self.special_tokens), default=0)
        self.special_prefixes = {s[:k] for s in raw for k in range(1, len(s))}
        self._normalized_prefixes = {s[:k] for s in normalized for k in range(1, len(s))}
        # ASCII characters that have no token (SentencePiece): the rest take the fast path.
        self._unknown_ascii = "".join(
            c for c in map(chr, range(128)) if self.sentencepiece and not vocab.has_char_token(vocab.model_text(c)))
        if self.prepend and normalized:
            from parrot.tokenizer.bpe import UnsupportedTokenizer

            raise UnsupportedTokenizer("exact budgeting does not support normalized added tokens with a prepended '▁'")

    def pieces(self, text: str, start: int = 0, end: int | None = None, segment_start: bool = True) -> list[Piece]:
        """The pieces of ``text[start:end]`` read from ``start`` (``segment_start``: a segment
        begins there, so a Prepend normalizer writes its ``▁``: at a text's start and right after
        an added token)."""
        end = len(text) if end is None else end
        out: list[Piece] = []
        pos = start
        if self._raw_re is not None:
            for m in self._raw_re.finditer(text, start, end):
                self._segment(text, pos, m.start(), segment_start, out)
                out.append(Piece(m.start(), m.end(), "", self._raw[m.group()]))
                pos, segment_start = m.end(), True
        self._segment(text, pos, end, segment_start, out)
        return out

    def settled(self, text: str, boundary: int, end: int) -> bool:
        """Whether the pieces before ``boundary`` (a piece boundary) are the same in every text
        that agrees with ``text`` up to ``end`` (see the module docstring)."""
        if boundary >= end:
            return False
        if self.pre_tokenizer is None:
            return True
        run = _SPACE_RUN.match(text, boundary, end)
        return run is not None and run.end() < end

    def settled_from(self, text: str, boundary: int) -> int:
        """The shortest end for which :meth:`settled` holds at ``boundary`` (it holds for every
        longer one too)."""
        if self.pre_tokenizer is None:
            return boundary + 1
        run = _SPACE_RUN.match(text, boundary)
        return (run.end() if run is not None else boundary) + 1

    def special_start(self, text: str) -> int:
        """Where the longest suffix of ``text`` that is a proper prefix of an added token begins
        (``len(text)`` if none): the earliest place an added token could still start."""
        for k in range(min(len(text), self.max_special_len - 1), 0, -1):
            tail = text[-k:]
            if tail in self.special_prefixes or tail.replace(" ", "\u2581") in self._normalized_prefixes:
                return len(text) - k
        return len(text)

    # -- one stretch between raw added tokens -----------------------------------------------------

    def _segment(self, text: str, a: int, b: int, first: bool, out: list[Piece]) -> None:
        if a >= b:
            return
        if self._normalized_re is None:
            self._pieces_of(text, a, b, first, out)
            return
        pos = a
        for m in self._normalized_re.finditer(text, a, b):
            self._pieces_of(text, pos, m.start(), first and pos == a, out)
            out.append(Piece(m.start(), m.end(), "", self._normalized_id(m.group())))
            pos = m.end()
        self._pieces_of(text, pos, b, first and pos == a, out)

    def _normalized_id(self, raw: str) -> TokenId:
        return self.special_tokens[raw.replace(" ", "\u2581")]

    def _pieces_of(self, text: str, a: int, b: int, first: bool, out: list[Piece]) -> None:
        """Pieces of a stretch with no added token; ``first``: it begins a segment."""
        if a >= b:
            return
        if not self.sentencepiece:
            for model, (s, e) in self.pre_tokenizer.pre_tokenize_str(text[a:b]):
                out.append(Piece(a + s, a + e, model, NO_SPECIAL))
            return
        vocab = self.vocab
        model = vocab.model_text(text[a:b])
        prefix = "\u2581" if first and self.prepend else ""
        if model.isascii() and not (self._unknown_ascii and any(c in model for c in self._unknown_ascii)):
            out.append(Piece(a, b, prefix + model, NO_SPECIAL))
            return
        pos = 0
        for i, ch in enumerate(model):
            if not vocab.has_char_token(ch):
                if i > pos or prefix:
                    out.append(Piece(a + pos, a + i, prefix + model[pos:i], NO_SPECIAL))
                out.append(Piece(a + i, a + i + 1, ch, NO_SPECIAL))
                pos, prefix = i + 1, ""
        if pos < len(model) or prefix:
            out.append(Piece(a + pos, b, prefix + model[pos:], NO_SPECIAL))


def _raw_pattern(token: str) -> str:
    """A regex for raw text that normalizes (spaces to ``▁``) to ``token``."""
    return "".join("[ \u2581]" if c == "\u2581" else re.escape(c) for c in token)


def _alternation(tokens: dict[str, TokenId], pattern: Any) -> re.Pattern[str] | None:
    if not tokens:
        return None
    ordered = sorted(tokens, key=len, reverse=True)  # longest first: leftmost-longest
    return re.compile("|".join(pattern(s) for s in ordered))
