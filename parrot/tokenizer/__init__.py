"""Exact tokenization for the served model: loading, chat template, token budgeting.

``load_tokenizer`` gives a :class:`Tokenizer` (encode/decode, chat template); its ``budget``
(a :class:`TokenBudget`) counts, splits, truncates and chunks text exactly as the model tokenizes
it; :class:`IntervalCounter` counts any range of one text; :class:`AppendingEncoder` counts while
text is appended. Algorithms: :mod:`parrot.tokenizer.budget` and the modules it names.
"""

from parrot.tokenizer.appending import AppendingEncoder
from parrot.tokenizer.bpe import UnsupportedTokenizer
from parrot.tokenizer.budget import Chunk, Side, TokenBudget, Truncation
from parrot.tokenizer.interval import IntervalCounter
from parrot.tokenizer.loader import Tokenizer, TokenId, load_tokenizer

__all__ = [
    "AppendingEncoder",
    "Chunk",
    "IntervalCounter",
    "Side",
    "TokenBudget",
    "TokenId",
    "Tokenizer",
    "Truncation",
    "UnsupportedTokenizer",
    "load_tokenizer",
]
