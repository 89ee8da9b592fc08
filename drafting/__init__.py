"""Drafting: per-request n-gram drafters and the draft-length policy. Pure Python, no torch."""

from drafting.ngram import NGramDrafter, NGramModel
from drafting.policy import GRAMMAR_BUCKET, AcceptanceStats, DraftLengthPolicy, expected_yield, match_bucket
from drafting.suffix import SuffixDrafter

__all__ = [
    "GRAMMAR_BUCKET",
    "AcceptanceStats",
    "DraftLengthPolicy",
    "NGramDrafter",
    "NGramModel",
    "SuffixDrafter",
    "expected_yield",
    "match_bucket",
]
