"""The smollm pre-tokenizer, re-implemented so that it can start anywhere and stop early.

The served tokenizer splits text in three stages, and token counts add up over the pieces:

1. added (special) tokens such as ``<|im_end|>`` are cut out first, leftmost-longest; each is one
   token, and the text between two of them is pre-tokenized on its own (its end acts as the end
   of the text);
2. every digit (Rust ``char::is_numeric``) becomes a piece of its own;
3. the GPT-2 byte-level regex splits the rest:
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``.

Stage 2 and 3 are one pattern here, :data:`PIECE_PATTERN`, with the lookahead ``(?!\\S)`` widened
to "not followed by a letter or other" because a digit ends the piece before it. Its character
classes come from :mod:`parrot.tokenizer.unicode_classes`.

Facts the budgeting algorithms rely on (``tests/test_tokenizer_exactness.py`` checks the scan
against `tokenizers` and the hard boundaries; ``tests/test_tokenizer_budget.py`` checks the
algorithms built on the rest against full re-encodes):

- a regex match at position p depends on the text from p up to one character past the match
  end, two for a whitespace run that ``\\s+(?!\\S)`` ended one character early; so a scan
  started at a true piece boundary reproduces the true pieces from there on, and a scan of
  ``text[:i]`` agrees with the scan of ``text`` on every piece that ends by i - 2;
- a piece scanned on its own is that one piece; a piece of 4 or more characters is a run (letters
  or "other", maybe after one space; or whitespace); every prefix of a run is one piece, and a
  scan started inside a run has the rest of the run as its first piece, except at an apostrophe
  that ends an "other" run, which can start a contraction (``'s``) with what follows;
- boundaries that every scan has, wherever it started: before and after a digit, before a
  whitespace character that follows a non-whitespace one, and around an added token.
"""

from __future__ import annotations

import re
from typing import Iterator

from parrot.tokenizer.unicode_classes import DIGITS, LETTERS, SPACES

TokenId = int
NO_SPECIAL: TokenId = -1  # the third field of a piece that is ordinary text


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(
        f"\\U{first:08x}" if first == last else f"\\U{first:08x}-\\U{last:08x}" for first, last in ranges
    )


_L, _D, _S = _char_class(LETTERS), _char_class(DIGITS), _char_class(SPACES)
PIECE_PATTERN = (
    rf"[{_D}]|'s|'t|'re|'ve|'m|'ll|'d| ?[{_L}]+| ?[^{_L}{_D}{_S}]+"
    rf"|[{_S}]+(?![^{_S}{_D}])|[{_S}]+"
)
_PIECE_RE = re.compile(PIECE_PATTERN)
# The same pattern for ASCII-only text, where the classes are small (and matching is faster).
_ASCII_PIECE_RE = re.compile(
    r"[0-9]|'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[^A-Za-z0-9\t-\r ]+|[\t-\r ]+(?![^\t-\r 0-9])|[\t-\r ]+"
)
# A boundary every scan has: a digit (before it), or whitespace that follows non-whitespace.
_HARD_BOUNDARY_RE = re.compile(rf"[{_D}]|(?<=[^{_S}])[{_S}]")
_CLASS_RES = {
    "L": re.compile(rf"[{_L}]+"),
    "D": re.compile(rf"[{_D}]+"),
    "S": re.compile(rf"[{_S}]+"),
    "O": re.compile(rf"[^{_L}{_D}{_S}]+"),
}

# Pieces of at least this many characters are runs of one class (see the module docstring).
MIN_RUN = 4


class Pretokenizer:
    """Splits text into pieces exactly as the served tokenizer does before BPE.

    A piece is ``(start, end, special)``: character offsets into the text, and the token id when
    the piece is an added token (``NO_SPECIAL`` otherwise).
    """

    def __init__(self, special_tokens: dict[str, TokenId]) -> None:
        self.special_tokens = dict(special_tokens)
        ordered = sorted(special_tokens, key=len, reverse=True)  # longest first: leftmost-longest
        self._special_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.max_special_len = max(map(len, ordered), default=0)
        # Proper prefixes of added tokens: where text could still turn into an added token.
        self.special_prefixes = {s[:k] for s in ordered for k in range(1, len(s))}
        self.special_last_chars = frozenset(s[-1] for s in ordered)
        self._special_first_chars = sorted({s[0] for s in ordered})
        # When no added token can overlap another (a proper suffix of one is never a prefix of
        # one), an occurrence found by a local search is the one the left-to-right split takes.
        self.specials_local = not any(
            t.startswith(s[k:]) for s in ordered for t in ordered for k in range(1, len(s))
        )
        self.char_classes: dict[str, str] = {}  # cache of char_class (read it, do not write)

    def scan(self, text: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, TokenId]]:
        """The pieces of ``text[start:end]``, lazily, in order (``start`` must be a true boundary
        of the text for them to be pieces of the whole text)."""
        end = len(text) if end is None else end
        pos, window = start, 1024
        while pos < end:
            # Look for added tokens only up to a horizon, so that a caller who stops early pays
            # for what it read. A piece touching an artificial horizon may be cut short: rescan
            # it with a doubled window (geometric, so linear overall).
            horizon = min(end, pos + window)
            special = None
            if self._special_re is not None:
                special = self._special_re.search(text, pos, min(end, horizon + self.max_special_len - 1))
                if special is not None and special.start() >= horizon:
                    special = None
            seg_end = special.start() if special is not None else horizon
            open_end = special is None and horizon < end
            for m in _PIECE_RE.finditer(text, pos, seg_end):
                if open_end and m.end() == seg_end:
                    pos, window = m.start(), window * 2
                    break
                yield m.start(), m.end(), NO_SPECIAL
            else:
                pos = seg_end
                if special is not None:
                    yield special.start(), special.end(), self.special_tokens[special.group()]
                    pos = special.end()

    def spans(self, text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int, TokenId]]:
        return list(self.scan(text, start, end))

    def spans_of(self, text: str) -> list[tuple[int, int, TokenId]]:
        """The pieces of a short standalone text (a fast path for texts with no added token)."""
        if self._special_re is not None and self._special_re.search(text):
            return self.spans(text)
        pattern = _ASCII_PIECE_RE if text.isascii() else _PIECE_RE
        return [(m.start(), m.end(), NO_SPECIAL) for m in pattern.finditer(text)]

    def plain(self, text: str) -> bool:
        """Whether ``text`` holds no added token (then :meth:`plain_spans` splits it)."""
        return self._special_re is None or self._special_re.search(text) is None

    def plain_spans(self, text: str) -> list[tuple[int, int]]:
        """Piece spans of a short standalone text that holds no added token."""
        pattern = _ASCII_PIECE_RE if text.isascii() else _PIECE_RE
        return [m.span() for m in pattern.finditer(text)]

    def is_run_of(self, text: str, cls: str) -> bool:
        """Whether every character of ``text`` is of class ``cls``."""
        if len(text) == 1:
            return self.char_class(text) == cls
        return self.run_length(text, 0, cls) == len(text)

    def special_start(self, text: str) -> int:
        """Where the longest suffix of ``text`` that is a proper prefix of an added token begins
        (``len(text)`` if none): the earliest place an added token could still start."""
        lo, best = max(0, len(text) - self.max_special_len + 1), len(text)
        for first in self._special_first_chars:
            p = text.find(first, lo)
            while 0 <= p < best:
                if text[p:] in self.special_prefixes:
                    best = p
                    break
                p = text.find(first, p + 1)
        return best

    def char_class(self, ch: str) -> str:
        """"L", "D", "S" or "O" for one character."""
        cls = self.char_classes.get(ch)
        if cls is None:
            cls = next(k for k, r in _CLASS_RES.items() if r.match(ch))
            self.char_classes[ch] = cls
        return cls

    def is_space(self, ch: str) -> bool:
        return self.char_class(ch) == "S"

    def run_length(self, text: str, pos: int, cls: str, end: int | None = None) -> int:
        """How many characters of class ``cls`` follow ``pos`` (up to ``end``)."""
        m = _CLASS_RES[cls].match(text, pos, len(text) if end is None else end)
        return 0 if m is None else m.end() - pos

    def hard_boundary_at_or_before(self, text: str, pos: int) -> int:
        """A position <= pos that is a piece boundary of every scan of ``text`` reaching it (0 at
        worst), found by looking back from pos in growing windows (linear in the distance)."""
        window = 256
        while pos > 0:
            lo = max(0, pos - window)
            found = [m.start() for m in _HARD_BOUNDARY_RE.finditer(text, lo, pos + 1)]
            found = [q for q in found if q <= pos]
            # The lookbehind cannot see before lo: a match at lo itself is not proven.
            found = [q for q in found if q > lo or lo == 0]
            for q in reversed(found):
                boundary = self._outside_special(text, q)
                if boundary is not None:
                    return boundary
            if lo == 0:
                return 0
            pos, window = lo, window * 2
        return 0

    def _outside_special(self, text: str, q: int) -> int | None:
        """q if no added token occurrence covers it, else that occurrence's start (None when the
        added tokens may overlap, so that a local search proves nothing)."""
        if self._special_re is None:
            return q
        if not self.specials_local:
            return None
        lo = max(0, q - self.max_special_len + 1)
        for m in self._special_re.finditer(text, lo, min(len(text), q + self.max_special_len)):
            if m.start() < q < m.end():
                return m.start()
        return q
