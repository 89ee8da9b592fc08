"""Exact budgeting on vocabularies other than SmolLM2's (parrot.tokenizer.general): every count,
range count, cut, chunk and appended count equals what the served tokenizer's own encode gives.

The vocabularies are made offline: the embedded model's byte-level BPE vocabulary loaded as each
family's GGUF (``tokenizer.ggml.pre``: Llama 3 with its whole-word rule, Qwen2, DeepSeek LLM and
Coder, GPT-2), so the family's pre-tokenizer runs over it; and that vocabulary respelled as a
SentencePiece vocabulary with byte fallback, once as Llama 2's (a ``▁`` prepended to every text)
and once as Gemma's (none, with its user-defined runs of newlines and spaces matched whole).
Texts: the repository's prompts and adversarial strings (runs of spaces, digits, emoji,
combining marks, added tokens cut anywhere). ``make check-budgeting`` runs the same checks on real
GGUFs and every held-out text.
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from parrot.tokenizer.bpe import UnsupportedTokenizer
from parrot.tokenizer.general import GeneralBudget
from parrot.tokenizer.loader import load_tokenizer
from parrot.tokenizer.vocabulary import spelling
from tests.test_gguf_tokenizers import embedded_reader, tokenizer_only_gguf, vocabulary_gguf

BYTE_LEVEL = ["llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "gpt-2"]
SENTENCEPIECE = ["llama2-spm", "gemma-spm"]
FAMILIES = BYTE_LEVEL + SENTENCEPIECE

ALPHABET = ["a", "b", "Z", " ", "  ", "\n", "\n\n", "\t", "1", "123", "'s", "'", "!", "(", "é", "😀", "\u0301",
            "中", "ا", "▁", "<s>", "<|endoftext|>", "<start_of_turn>", "\r\n", "x ", " y", "\x01", "ǅ"]
ADVERSARIAL = [
    " " * 3000 + "x", "a" * 3000, "7" * 3000, "😀" * 400, "e\u0301" * 600, "\n" * 300 + "x", " \n" * 300,
    "ab " * 700, "中文" * 500, "!" * 2000, "'s" * 400, "\t \n" * 300, "a" * 900 + " " * 900 + "b" * 90,
    "👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ok👍👍👍 " * 20, "日本語のテキスト、中文文本。한국어 텍스트 Ελληνικά ру́сский " * 10,
    "it's we'll THEY'RE '''s <|endoftext|> <s> <start_of_turn>user\n  code  \n\n\n" * 10,
]


def _prompts() -> list[str]:
    path = Path(__file__).parent / "data" / "fallback_prompts.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f]


def _sentencepiece_gguf(directory: str, gemma: bool) -> str:
    """The embedded vocabulary respelled as SentencePiece: UTF-8 text with spaces as ``▁``, scores
    in merge order, 256 byte tokens; Gemma's style adds user-defined runs of newlines and spaces
    (stored with real spaces, as Gemma's files store them) and a control turn marker."""
    reader = embedded_reader()
    seen: set[str] = set()
    pieces: list[str] = []
    from parrot.tokenizer.bpe import bytes_to_unicode

    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    for token in reader.get("tokenizer.ggml.tokens"):
        if token.startswith("<|") or not all(c in char_byte for c in token):
            continue
        try:
            text = bytes(char_byte[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace(" ", "▁")
        if text and text not in seen and not text.startswith("<0x"):
            seen.add(text)
            pieces.append(text)
    specials = ["<unk>", "<s>", "</s>"] + (["<start_of_turn>", "<end_of_turn>"] if gemma else [])
    user = ["\n" * k for k in range(1, 6)] + [" " * k for k in range(2, 9)] if gemma else []
    pieces = [p for p in pieces if p not in user and p.replace("▁", " ") not in user]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + user + pieces
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [4] * len(user) + [1] * len(pieces)
    name = "gemma-spm.gguf" if gemma else "llama2-spm.gguf"
    return vocabulary_gguf(os.path.join(directory, name), "llama", tokens, types, add_space_prefix=not gemma,
                           arch="gemma3" if gemma else "llama")


@lru_cache(maxsize=None)
def family_tokenizer(family: str):
    import tempfile

    directory = tempfile.mkdtemp(prefix=f"parrot-{family}-")
    if family in SENTENCEPIECE:
        path = _sentencepiece_gguf(directory, gemma=family == "gemma-spm")
    else:
        path = tokenizer_only_gguf(directory, family)
    return load_tokenizer(directory, os.path.basename(path))


@lru_cache(maxsize=None)
def family_budget(family: str, long_piece: int = 4096) -> GeneralBudget:
    return GeneralBudget(family_tokenizer(family), long_piece=long_piece)


def _count(family: str, text: str) -> int:
    return len(family_tokenizer(family).encode(text))


def _random_texts(seed: int, count: int, longest: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, longest))) for _ in range(count)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_served_tokenizer_gets_the_general_budget_and_it_counts_as_encode(family):
    tokenizer = family_tokenizer(family)
    budget = tokenizer.budget
    assert isinstance(budget, GeneralBudget)
    assert budget.vocab.spelling == ("sentencepiece" if family in SENTENCEPIECE else "byte-level")
    for text in _prompts()[:5] + ADVERSARIAL:
        assert budget.count(text) == len(tokenizer.encode(text))
        index = budget.interval_counter(text)
        assert index.total == len(tokenizer.encode(text))  # the pieces reproduce the encoding
    if family == "llama-bpe":
        assert budget.vocab.ignore_merges  # Llama 3's whole-word rule is exercised
    if family == "llama2-spm":
        assert budget.splitter.prepend
    if family == "gemma-spm":
        assert not budget.splitter.prepend and budget.splitter._normalized_re is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_range_of_short_adversarial_texts_counts_as_encoding_it(family):
    budget = family_budget(family)
    cut_inside = 0
    for text in _random_texts(1, 40, 12):
        index = budget.interval_counter(text)
        starts = set(index.starts)
        for start in range(len(text) + 1):
            for end in range(start, len(text) + 1):
                assert index.count(start, end) == _count(family, text[start:end]), (text, start, end)
                cut_inside += start not in starts
    assert cut_inside > 300  # most ranges begin inside a piece: the head re-split is exercised


@pytest.mark.parametrize("family", FAMILIES)
def test_ranges_of_long_runs_count_exactly_through_the_interval_tables(family):
    budget = family_budget(family, long_piece=16)
    rng = random.Random(2)
    tables = 0
    for text in ADVERSARIAL + _prompts()[:4]:
        index = budget.interval_counter(text)
        for _ in range(10):
            start = rng.randint(0, len(text))
            end = rng.randint(start, len(text))
            assert index.count(start, end) == _count(family, text[start:end]), (text[:20], start, end)
        tables += len(index._tables)
    if family != "llama2-spm":  # there a range's first segment gets its own ▁: counted whole
        assert tables > 0  # cuts inside long pieces went through PieceIntervals


@pytest.mark.parametrize("family", FAMILIES)
def test_cuts_are_the_longest_prefix_and_shortest_suffix_within_budget(family):
    budget = family_budget(family)
    for text in _random_texts(3, 25, 20):
        counts_prefix = [_count(family, text[:i]) for i in range(len(text) + 1)]
        counts_suffix = [_count(family, text[i:]) for i in range(len(text) + 1)]
        for n in range(0, 8):
            kept = budget.split_at_tokens(text, n)
            assert len(kept) == max(i for i, c in enumerate(counts_prefix) if c <= n), (text, n)
            right = budget.truncate(text, n, side="right")
            assert right.text == kept and right.count == counts_prefix[len(kept)]
            left = budget.truncate(text, n, side="left")
            assert left.offset == min(i for i, c in enumerate(counts_suffix) if c <= n), (text, n)
            assert left.count == counts_suffix[left.offset] <= n


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_cover_the_text_and_each_is_the_longest_that_fits(family):
    budget = family_budget(family)
    for text in _prompts()[:6] + [t[:300] for t in ADVERSARIAL[:10]]:  # (long runs: make check-budgeting)
        for n in (7, 64):
            chunks = budget.chunk(text, n)
            assert "".join(c.text for c in chunks) == text
            for c in chunks:
                assert c.count == _count(family, c.text) <= n
                if c.end < len(text):
                    assert _count(family, text[c.start : c.end + 1]) > n or budget.split_at_tokens(text[c.start :], n) == c.text


@pytest.mark.parametrize("family", FAMILIES)
def test_appending_counts_equal_encoding_everything_appended_so_far(family):
    budget = family_budget(family)
    tokenizer = family_tokenizer(family)
    rng = random.Random(4)
    # (long last pieces: a run, and prose lines a SentencePiece vocabulary keeps as one piece)
    for text in _random_texts(5, 20, 30) + [ADVERSARIAL[15][:200], _prompts()[0][:300], "a" * 300, "中文" * 80]:
        encoder = budget.appending_encoder()
        pos = 0
        while pos < len(text):
            step = rng.randint(1, 4)
            encoder.append(text[pos : pos + step])
            pos += step
            assert encoder.count == _count(family, text[:pos]), (text, pos)
        assert encoder.tokens == tokenizer.encode(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_count_till_limit_stops_at_the_limit(family):
    budget = family_budget(family)
    text = " ".join(_prompts()) * 3
    total = _count(family, text)
    assert budget.count_till_limit(text, total) == total
    assert budget.count_till_limit(text, total - 1) is None
    assert budget.count_till_limit(text, 50) is None


def test_configurations_the_general_budget_does_not_implement_are_refused_with_the_reason():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bpe = {"type": "BPE", "vocab": {}, "merges": []}
    with pytest.raises(UnsupportedTokenizer, match="model is not BPE"):
        spelling({"model": {"type": "WordPiece"}, "pre_tokenizer": byte_level, "added_tokens": []})
    with pytest.raises(UnsupportedTokenizer, match="a normalizer on a byte-level BPE"):
        spelling({"model": bpe, "normalizer": {"type": "NFC"}, "pre_tokenizer": byte_level, "added_tokens": []})
    with pytest.raises(UnsupportedTokenizer, match="add_prefix_space"):
        spelling({"model": bpe, "pre_tokenizer": {**byte_level, "add_prefix_space": True}, "added_tokens": []})
    with pytest.raises(UnsupportedTokenizer, match="normalizer"):
        spelling({"model": {**bpe, "byte_fallback": True}, "normalizer": {"type": "NFKC"}, "pre_tokenizer": None,
                  "added_tokens": []})
    with pytest.raises(UnsupportedTokenizer, match="lstrip"):
        spelling({"model": bpe, "pre_tokenizer": byte_level,
                  "added_tokens": [{"id": 0, "content": "<x>", "lstrip": True}]})


def test_token_endpoints_answer_for_a_llama3_vocabulary():
    # They answered 501 for every vocabulary but SmolLM2's before.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from parrot.config import Config
    from parrot.server.errors import install_error_handlers
    from parrot.server.routes import tokens
    from parrot.server.state import ServerState

    tokenizer = family_tokenizer("llama-bpe")
    state = ServerState(Config())
    state.loaded = SimpleNamespace(tokenizer=tokenizer, name="llama3", context_window=4096)  # type: ignore[assignment]
    state.scheduler = SimpleNamespace(failure=None)  # type: ignore[assignment]
    app = FastAPI()
    app.state.parrot = state
    install_error_handlers(app)
    app.include_router(tokens.router)
    text = "hello world 123, it's 2026!  \n\n  done"
    with TestClient(app) as client:
        r = client.post("/v1/tokens/count", json={"text": text, "ranges": [[0, 11], [3, 20], [6, len(text)]]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(tokenizer.encode(text))
        assert [x["count"] for x in body["ranges"]] == [len(tokenizer.encode(text[s:e])) for s, e in [(0, 11), (3, 20), (6, len(text))]]
        r = client.post("/v1/tokens/truncate", json={"text": text, "max_tokens": 5, "side": "left"})
        assert r.status_code == 200 and r.json()["count"] == len(tokenizer.encode(r.json()["text"])) <= 5
        r = client.post("/v1/tokens/chunk", json={"text": text, "max_tokens": 4})
        assert r.status_code == 200 and "".join(c["text"] for c in r.json()["chunks"]) == text
