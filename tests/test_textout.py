"""Generated text decoded a window of tokens at a time (parrot/engine/textout.py) equals the
decoder's text of all the ids after every step, on a byte-level BPE vocabulary (the embedded
model's) and a SentencePiece one with byte fallback, for token streams that split characters
across tokens, mix in special tokens and random ids, and arrive a few tokens per step."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from parrot.engine.textout import TextAssembler
from tests.test_gguf_tokenizers import sentencepiece_gguf
from parrot.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Grüße aus Köln, 世界! 👋🏽 naïve café — ok.\n\n  Indented  twice, then ✓ done",
    "Hello world Hello  world\nHello",
    " Hello wörld 🎉🎉 Hello",
]


class Recording:
    """A decoder that remembers the longest run of ids it was asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decodes_incrementally = inner.decodes_incrementally
        self.longest = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens)

    def text_may_change(self, ids) -> bool:
        return self.inner.text_may_change(ids)


def _stream_through(tokenizer: Tokenizer, ids: list[int], rng: random.Random) -> Recording:
    decoder = Recording(tokenizer)
    assembler = TextAssembler(decoder)
    sent, at = "", 0
    while at < len(ids):
        step = rng.randint(1, 5)  # a verified draft adds several tokens at once
        _, delta = assembler.add(ids[at : at + step])
        at += step
        sent += delta
        assert assembler.text == tokenizer.decode(ids[:at])
    assert sent + assembler.flush() == tokenizer.decode(ids)
    return decoder


def _streams(tokenizer: Tokenizer, specials: list[int], rng: random.Random) -> list[list[int]]:
    streams = []
    for text in TEXTS:
        ids = tokenizer.encode(text * 3)
        streams.append(ids)
        mixed = list(ids)
        for _ in range(6):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
        streams.append(mixed)
    streams.append([rng.randrange(tokenizer.vocab_size) for _ in range(300)])  # any ids at all
    return streams


def _check(tokenizer: Tokenizer, specials: list[int], seed: int) -> None:
    rng = random.Random(seed)
    assert tokenizer.decodes_incrementally
    for ids in _streams(tokenizer, specials, rng):
        _stream_through(tokenizer, ids, rng)
    # Not vacuous: a long natural stream is decoded in windows of its last tokens, never whole
    # (the made-up SentencePiece vocabulary spells most letters in byte tokens, whose open runs
    # hold a window back: its windows reach ~70 tokens, the embedded model's stay under 40).
    ids = tokenizer.encode(TEXTS[0] * 20)
    assert len(ids) > 600
    assert _stream_through(tokenizer, ids, rng).longest < 100


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_text_decoded_in_windows_equals_the_whole_decode(embedded_tokenizer, seed):
    hf = embedded_tokenizer.hf
    specials = [hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    _check(embedded_tokenizer, specials, seed)


@pytest.mark.parametrize("seed", range(4))
def test_sentencepiece_text_decoded_in_windows_equals_the_whole_decode(tmp_path, seed):
    # Llama 2 / Mistral style: '▁' for spaces, the first token's leading space stripped, characters
    # outside the vocabulary as <0xXX> byte tokens; <s> and </s> are skipped special tokens.
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(sentencepiece_gguf(str(tmp_path))))
    assert tokenizer.decode(tokenizer.encode(" Hello wörld")) == " Hello wörld"
    _check(tokenizer, [1, 2, 0], seed)


def test_decoders_that_clean_up_spaces_are_decoded_whole():
    # transformers' clean-up (' .' -> '.') can reach across any cut: such tokenizers decode whole.
    cleaning = Tokenizer(hf=SimpleNamespace(clean_up_tokenization_spaces=True), eos_token_ids=frozenset(), name="x")
    assert not cleaning.decodes_incrementally
