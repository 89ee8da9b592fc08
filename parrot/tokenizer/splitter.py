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
        self._split_cache: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        raw, normalized = {}, {}
        for t in config["added_tokens"]:
            # Matched in normalized text only when a normalizer exists (as `tokenizers` does).
            (normalized if t.get("normalized") and config.get("normalizer") else raw)[t["content"]] = t["id"]
        self.special_tokens = {**raw, **normalized}
        self._raw = raw
        self._raw_re = _alternation(raw, re.escape)
        # A normalized added token (``▁▁``) matches raw text whose normalization it is.
        self._normalized_re = _alternation(normalized, _raw_pattern)
        self.max_special_len = max(map(len, self.special_tokens), default=0)
        self.special_prefixes = {s[:k] for s in raw for k in range(1, len(s))}
        self._normalized_prefixes = {s[:k] for s in normalized for k in range(1, len(s))}
        # SentencePiece: the characters (in the model's spelling) that have no token of their own.
        self._unknown_re = _unknown_characters(vocab) if self.sentencepiece else None
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
            stretch = text[a:b]
            split = self._split_cache.get(stretch)
            if split is None:
                split = self.pre_tokenizer.pre_tokenize_str(stretch)
                if len(stretch) <= 64:  # words and short windows recur: re-split them once
                    if len(self._split_cache) >= 100_000:
                        self._split_cache.clear()
                    self._split_cache[stretch] = split
            for model, (s, e) in split:
                out.append(Piece(a + s, a + e, model, NO_SPECIAL))
            return
        model = self.vocab.model_text(text[a:b])
        prefix = "\u2581" if first and self.prepend else ""
        pos = 0
        assert self._unknown_re is not None
        for m in self._unknown_re.finditer(model):
            i = m.start()
            if i > pos or prefix:
                out.append(Piece(a + pos, a + i, prefix + model[pos:i], NO_SPECIAL))
            out.append(Piece(a + i, a + i + 1, m.group(), NO_SPECIAL))
            pos, prefix = i + 1, ""
        if pos < len(model) or prefix:
            out.append(Piece(a + pos, b, prefix + model[pos:], NO_SPECIAL))


def _unknown_characters(vocab: Vocabulary) -> re.Pattern[str]:
    """A regex matching one character that has no token of its own."""
    known = sorted({t[0] for t in vocab.token_bytes if isinstance(t, tuple) and len(t) == 1})
    ranges: list[list[int]] = []
    for c in known:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    body = "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
    return re.compile(f"[^{body}]")


def _raw_pattern(ch: str) -> str:
    """A regex for the raw characters that normalize (spaces to ``▁``) to ``ch``."""
    return "[ \u2581]" if ch == "\u2581" else re.escape(ch)


def _alternation(tokens: dict[str, TokenId], pattern: Any) -> re.Pattern[str] | None:
    """A regex matching the longest of ``tokens`` at a position (``pattern`` writes one character):
    a trie, so that thousands of added tokens (Gemma has 6,414) cost one walk, not one try each."""
    if not tokens:
        return None
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}  # a token ends here

    def emit(node: dict[str, Any]) -> str:
        # Children first: the text picks one child, so the deepest token on its path (the
        # longest match) is the first the regex finds; "" ends a token here if none is longer.
        alternatives = [pattern(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if "" in node:
            alternatives.append("")
        return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"

    return re.compile(emit(trie))
