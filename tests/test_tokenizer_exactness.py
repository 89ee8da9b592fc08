"""The library tokenizes exactly as the served model was trained: the smollm digit rule that the
transformers GGUF conversion drops, the 21 bytes without a token, and a pre-tokenizer that
agrees with the `tokenizers` one piece for piece."""

from __future__ import annotations

import random

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from parrot.tokenizer.pretokenize import Pretokenizer
from parrot.tokenizer.unicode_classes import DIGITS, LETTERS, SPACES

# The GPT-2 byte-level regex, as the `tokenizers` ByteLevel pre-tokenizer applies it.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def smollm_rule_pieces(text: str) -> list[str]:
    """Reference for ASCII-and-common text: every digit is a piece of its own, then the GPT-2
    regex splits what is between digits (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM)."""
    pieces = []
    for part in regex.split(r"(\p{N})", text):
        if part:
            pieces += GPT2_PATTERN.findall(part) if not regex.fullmatch(r"\p{N}", part) else [part]
    return pieces


@pytest.fixture(scope="module")
def unfixed(embedded_tokenizer):
    """The tokenizer as transformers converts it from the GGUF: plain ByteLevel, no digit rule."""
    backend = BackendTokenizer.from_str(embedded_tokenizer.hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    return backend


# text, the fixed (trained) tokens, the unfixed conversion's tokens
DIGIT_RULE_TABLE = [
    # the unfixed conversion attaches the space to the digit (" 1"), leaving one lone space
    ("a  1", ["a", "ĠĠ", "1"], ["a", "Ġ", "Ġ", "1"]),
    ("x\n\n 1", ["x", "ĊĊĠ", "1"], ["x", "ĊĊ", "Ġ", "1"]),
    # digits one by one: the unfixed one would use multi-digit tokens if the vocabulary had them
    ("in 2024", ["in", "Ġ", "2", "0", "2", "4"], None),
    ("v1.2", ["v", "1", ".", "2"], None),
]


@pytest.mark.parametrize("text,fixed_tokens,unfixed_tokens", DIGIT_RULE_TABLE)
def test_digit_rule_restored_where_the_gguf_conversion_drops_it(embedded_tokenizer, unfixed, text, fixed_tokens, unfixed_tokens):
    hf = embedded_tokenizer.hf
    assert hf.convert_ids_to_tokens(embedded_tokenizer.encode(text)) == fixed_tokens
    if unfixed_tokens is not None:
        assert unfixed.encode(text, add_special_tokens=False).tokens == unfixed_tokens
        assert unfixed_tokens != fixed_tokens  # guards against a table that tests nothing


def test_fixed_pre_tokenizer_follows_the_smollm_rule(embedded_tokenizer):
    rng = random.Random(0)
    alphabet = list("ab Z'sdtrevml09 \n\t.!,-") + ["  ", "\n\n", "12345", "'s", "'ll"]
    pre = embedded_tokenizer.hf.backend_tokenizer.pre_tokenizer
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        pieces = [text[a:b] for _, (a, b) in pre.pre_tokenize_str(text)]
        assert pieces == smollm_rule_pieces(text), repr(text)


def test_unfixed_conversion_differs_on_whitespace_before_digits(embedded_tokenizer, unfixed):
    # Guard: the fix matters on ordinary text, not only on a constructed table.
    text = "Total:  42 items\n\n 7 left"
    assert unfixed.encode(text, add_special_tokens=False).ids != embedded_tokenizer.encode(text)


def test_the_21_bytes_without_a_token(token_budget):
    missing = sorted(token_budget.bpe.missing_bytes)
    assert missing == [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]


LOST_TABLE = [
    # text, tokens the model receives, offsets that lost_characters reports
    ("\x04", [], [0]),  # vanishes entirely: no token at all
    ("!\x04!", ["!!"], [1]),  # and its neighbours merge as if adjacent
    ("a\x1db", ["a", "b"], [1]),
    ("x\U00040000y", ["x", "Ģ", "Ģ", "Ģ", "y"], [1]),  # lead byte 0xf1 lost: 3 continuation bytes
    ("plain text", ["plain", "Ġtext"], []),
]


@pytest.mark.parametrize("text,tokens,lost", LOST_TABLE)
def test_bytes_without_a_token_count_as_the_model_sees_them_and_are_reported(embedded_tokenizer, token_budget, text, tokens, lost):
    assert embedded_tokenizer.hf.convert_ids_to_tokens(embedded_tokenizer.encode(text)) == tokens
    assert token_budget.count(text) == len(tokens)
    assert token_budget.lost_characters(text) == lost


def test_lost_characters_are_exactly_those_that_do_not_round_trip(embedded_tokenizer, token_budget):
    rng = random.Random(1)
    for _ in range(2000):
        ch = chr(rng.choice([rng.randrange(0x20), rng.randrange(0x80, 0x800), rng.randrange(0x10000, 0x110000)]))
        if 0xD800 <= ord(ch) < 0xE000:
            continue
        round_trips = embedded_tokenizer.decode(embedded_tokenizer.encode("a" + ch + "a")) == "a" + ch + "a"
        assert (token_budget.lost_characters(ch) == [0]) == (not round_trips), hex(ord(ch))


def _class_of(c: int) -> str:
    for name, ranges in (("L", LETTERS), ("D", DIGITS), ("S", SPACES)):
        if any(a <= c <= b for a, b in ranges):
            return name
    return "O"


def test_character_class_table_matches_the_installed_tokenizers(embedded_tokenizer):
    """Sampled (the full measurement takes a minute): every range end and its neighbours, the
    code points where Python's own Unicode tables disagree, and random ones."""
    import unicodedata

    rng = random.Random(2)
    points = {c + d for ranges in (LETTERS, DIGITS, SPACES) for a, b in ranges for c in (a, b) for d in (-1, 0, 1)}
    points |= {rng.randrange(0x110000) for _ in range(3000)}
    points |= {c for c in range(0x20000) if unicodedata.category(chr(c)) == "Cn"}  # unassigned to Python
    points = sorted(c for c in points if 0 <= c < 0x110000 and not 0xD800 <= c < 0xE000)
    pre = embedded_tokenizer.hf.backend_tokenizer.pre_tokenizer
    from parrot.tokenizer.unicode_classes import measure_char_classes  # noqa: F401  (the generator)

    def pieces(template: str) -> list[int]:
        probes = [template.replace("c", chr(c)) for c in points]
        text = "0".join(probes)
        starts = [a for _, (a, _) in pre.pre_tokenize_str(text)]
        import bisect

        out, pos = [], 0
        for probe in probes:
            out.append(bisect.bisect_left(starts, pos + len(probe)) - bisect.bisect_left(starts, pos))
            pos += len(probe) + 1
        return out

    letter, other, digit = pieces("xcx"), pieces("!c!"), pieces("cc")
    for c, n_letter, n_other, n_digit in zip(points, letter, other, digit):
        measured = "L" if n_letter == 1 else "O" if n_other == 1 else "D" if n_digit == 2 else "S"
        assert _class_of(c) == measured, hex(c)


def test_pretokenizer_matches_tokenizers_on_real_text(embedded_tokenizer, token_budget):
    import glob
    import json
    import os

    texts = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        texts += [row["prompt"] for row in rows if "prompt" in row][:40]  # schemas.jsonl holds schemas, not prompts
    if not texts:  # a checkout without ../shared beside it: the bundled copies
        with open(os.path.join(os.path.dirname(__file__), "data", "fallback_prompts.jsonl"), encoding="utf-8") as f:
            texts = [json.loads(line)["prompt"] for line in f]
    text = "\n\n".join(texts)
    pre = embedded_tokenizer.hf.backend_tokenizer.pre_tokenizer
    ours = [(s, e) for s, e, _ in token_budget.pretokenizer.scan(text)]
    assert ours == [span for _, span in pre.pre_tokenize_str(text)]


ADVERSARIAL = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("aZ é中ß'sdtrml 09٣²Ⅻ\n\t\r\u3000\xa0\u0301\u0308!.-<|>😀👍🏽\u200d\x04\x1d\U00040000")),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ADVERSARIAL)
def test_pretokenizer_matches_tokenizers_on_any_text(embedded_tokenizer, text):
    pre = embedded_tokenizer.hf.backend_tokenizer.pre_tokenizer
    ours = [(s, e) for s, e, _ in Pretokenizer({}).scan(text)]
    assert ours == [span for _, span in pre.pre_tokenize_str(text)]


@settings(max_examples=200, deadline=None)
@given(ADVERSARIAL, st.data())
def test_scan_from_a_hard_boundary_reproduces_the_pieces(token_budget, text, data):
    """The fact that left truncation relies on: a scan restarted at a hard boundary is in step."""
    pre = token_budget.pretokenizer
    full = pre.spans(text)
    pos = data.draw(st.integers(0, len(text)))
    q = pre.hard_boundary_at_or_before(text, pos)
    assert q <= pos
    assert pre.spans(text, q) == [p for p in full if p[0] >= q]
