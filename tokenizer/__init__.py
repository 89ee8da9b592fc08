"""Exact tokenization for the served model: loading, chat template, token budgeting.

``load_tokenizer`` gives a :class:`Tokenizer` (encode/decode, chat template); its ``budget``
(a :class:`TokenBudget`) counts, splits, truncates and chunks text exactly as the model tokenizes
it; :class:`IntervalCounter` counts any range of one text; :class:`AppendingEncoder` counts while
text is appended. Algorithms: :mod:`tokenizer.budget` and the modules it names.
"""

from tokenizer.appending import AppendingEncoder
from tokenizer.bpe import UnsupportedTokenizer
from tokenizer.budget import Chunk, Side, TokenBudget, Truncation
from tokenizer.interval import IntervalCounter
from tokenizer.loader import Tokenizer, TokenId, load_tokenizer

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
