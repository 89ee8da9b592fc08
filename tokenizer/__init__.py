"""Exact tokenization for the served model: loading, chat template, token budgeting."""

from tokenizer.loader import Tokenizer, TokenId, load_tokenizer

__all__ = ["Tokenizer", "TokenId", "load_tokenizer"]
