"""Drafting: per-request drafters behind one interface, a registry by method name, and the
draft-length policy. Pure Python, no torch; importing the package registers the built-in drafters."""

from parrot.drafting.drafter import Draft, Drafter
from parrot.drafting.ngram import NGramDrafter, NGramModel
from parrot.drafting.policy import (
    GRAMMAR_BUCKET,
    AcceptanceStats,
    DraftLengthPolicy,
    DraftSizer,
    DraftSlot,
    expected_yield,
    match_bucket,
)
from parrot.drafting.registry import DrafterSettings, drafter_methods, new_drafter, register_drafter
from parrot.drafting.suffix import SuffixDrafter

__all__ = [
    "GRAMMAR_BUCKET",
    "AcceptanceStats",
    "Draft",
    "DraftLengthPolicy",
    "DraftSizer",
    "DraftSlot",
    "Drafter",
    "DrafterSettings",
    "NGramDrafter",
    "NGramModel",
    "SuffixDrafter",
    "drafter_methods",
    "expected_yield",
    "match_bucket",
    "new_drafter",
    "register_drafter",
]
