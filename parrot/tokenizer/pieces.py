"""Token counts as sums over pre-tokenized pieces: the base every exact count in this package
builds on (:mod:`parrot.tokenizer.budget`, :mod:`parrot.tokenizer.interval`, :mod:`parrot.tokenizer.appending`).

The served tokenizer encodes each piece of :mod:`parrot.tokenizer.pretokenize` on its own, so the
encoding of a text is the concatenation of its pieces' encodings, and a piece's count is cached
by :class:`~parrot.tokenizer.bpe.ByteLevelBPE`. Pieces longer than ``long_piece`` characters are where
the algorithms above switch to the linear tables of :mod:`parrot.tokenizer.bpe_tables`.
"""

from __future__ import annotations

from typing import Any

from parrot.tokenizer.bpe import ByteLevelBPE, TokenId
from parrot.tokenizer.pretokenize import MIN_RUN, NO_SPECIAL, Pretokenizer


class PieceCounter:
    """The served tokenizer's BPE and pre-tokenizer, counting text piece by piece."""

    def __init__(self, backend: Any, long_piece: int = 64) -> None:
        """``backend`` is a `tokenizers.Tokenizer` (``hf.backend_tokenizer``); raises
        :class:`~parrot.tokenizer.bpe.UnsupportedTokenizer` unless it is the smollm byte-level BPE.
        ``long_piece``: pieces longer than this many characters use the linear tables (tests
        lower it to exercise them on short inputs)."""
        self.bpe = ByteLevelBPE(backend)
        self.pretokenizer = Pretokenizer(self.bpe.special_tokens)
        self.long_piece = max(long_piece, MIN_RUN)

    def encode(self, text: str) -> list[TokenId]:
        """Token ids, identical to ``Tokenizer.encode``."""
        ids: list[TokenId] = []
        for s, e, special in self.pretokenizer.scan(text):
            if special != NO_SPECIAL:
                ids.append(special)
            else:
                ids.extend(self.bpe.encode_piece(text[s:e]))
        return ids

    def count(self, text: str) -> int:
        """``len(encode(text))``, without building the list."""
        total = 0
        encode_piece = self.bpe.encode_piece
        for s, e, special in self.pretokenizer.scan(text):
            total += 1 if special != NO_SPECIAL else len(encode_piece(text[s:e]))
        return total

    def count_span(self, text: str, start: int, end: int) -> int:
        """Tokens of ``text[start:end]`` scanned on its own (meant for short spans: no tables)."""
        return sum(
            1 if special != NO_SPECIAL else len(self.bpe.encode_piece(text[s:e]))
            for s, e, special in self.pretokenizer.scan(text, start, end)
        )
