"""Any BPE vocabulary the general budget (:mod:`parrot.tokenizer.general`) supports, in one of two
spellings, with what the linear tables of :mod:`parrot.tokenizer.bpe_tables` need from it.

- **byte-level** (GPT-2's spelling: Llama 3, Qwen2, DeepSeek, StarCoder, GPT-2): a piece's text
  is its UTF-8 bytes written one printable character per byte; every byte has a token.
- **SentencePiece** (Llama 2, Mistral, Gemma, as `tokenizers` runs them): a normalizer writes
  spaces as ``▁`` (and may prepend one), BPE merges characters, and a character without a token
  falls back to its bytes' ``<0xXX>`` tokens. Those never merge with anything, so a character
  without a token is a piece of its own (:mod:`parrot.tokenizer.splitter` splits there), and the
  tables only ever see text whose characters all have tokens; they walk code points, not bytes
  (a token starts and ends on a character).

BPE here is `tokenizers`' own model (``backend.model``): pieces are encoded by it, and pair
validity (the rust-gems ``bpe`` facts in :mod:`parrot.tokenizer.bpe`) is decided by re-encoding two
tokens with it. A vocabulary with ``ignore_merges`` (Llama 3) takes a whole piece that is a token
as that token; the tables, which count pieces of pieces by merges alone, use a second model without
that rule, and the callers apply it to whole pieces (:meth:`Vocabulary.whole_token`).
"""

from __future__ import annotations

import json
import re
from array import array
from typing import Any

from parrot.tokenizer.bpe import PairTables, TokenId, UnsupportedTokenizer, _lost_characters_re, bytes_to_unicode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Vocabulary(PairTables):
    """Vocabulary, cached piece encoding and pair validity of one BPE tokenizer."""

    def __init__(self, backend: Any, cache_size: int = 200_000) -> None:
        """``backend`` is a `tokenizers.Tokenizer`; raises :class:`UnsupportedTokenizer` with the
        reason when its model, normalizer or pre-tokenizer is not one this module implements."""
        config = json.loads(backend.to_str())
        self.config = config
        self.spelling = spelling(config)
        model = config["model"]
        self._model = backend.model
        self.ignore_merges = bool(model.get("ignore_merges"))
        self._merges_model = _without_ignore_merges(model) if self.ignore_merges else backend.model
        added = {t["id"] for t in config["added_tokens"]}
        vocab: dict[str, TokenId] = model["vocab"]
        self.vocab_size = max([*vocab.values(), *added]) + 1
        self.token_str: list[str] = [""] * self.vocab_size  # the model's spelling, "" for added tokens
        # The symbols the tables walk: bytes (byte-level) or code points (SentencePiece, whose
        # tokens are whole characters); empty for added and <0xXX> tokens.
        self.radix = 256 if self.spelling == "byte-level" else 0x110000
        self.token_bytes: list[Any] = [b""] * self.vocab_size
        byte_char = bytes_to_unicode()
        char_byte = {c: b for b, c in byte_char.items()}
        for s, tid in vocab.items():
            if tid in added:
                continue
            self.token_str[tid] = s
            if self.spelling == "byte-level":
                self.token_bytes[tid] = bytes(char_byte[c] for c in s)
            elif not _BYTE_TOKEN.fullmatch(s):
                self.token_bytes[tid] = tuple(map(ord, s))
        self.token_len = [len(b) for b in self.token_bytes]
        self.max_token_len = max(self.token_len)
        self._by_bytes = {b: tid for tid, b in enumerate(self.token_bytes) if b}
        self.missing_bytes = b""
        self._lost_re = None
        if self.spelling == "byte-level":
            # BPE drops a byte without a token and merges its neighbours (see parrot.tokenizer.bpe).
            self.missing_bytes = bytes(b for b in range(256) if byte_char[b] not in vocab)
            self._lost_re = _lost_characters_re(set(self.missing_bytes))
            self._to_model = {b: byte_char[b] for b in range(256)}
        else:
            missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
            if missing:
                raise UnsupportedTokenizer(f"byte fallback lacks {len(missing)} of the 256 <0xXX> tokens")
        self._cache: dict[str, int] = {}
        self._cache_size = cache_size
        self._pairs: dict[int, bool] = {}
        self._reachable: dict[TokenId, bool] = {}
        self._suffix_trie: tuple[dict[int, int], list[TokenId]] | None = None
        self._prefix_trie: tuple[dict[int, int], list[TokenId]] | None = None

    # -- the model's text ----------------------------------------------------------------------

    def model_text(self, raw: str) -> str:
        """The model's spelling of raw text (SentencePiece: spaces as ``▁``; no prepended ``▁``)."""
        if self.spelling == "byte-level":
            return raw.encode("utf-8").decode("latin-1").translate(self._to_model)
        return raw.replace(" ", "\u2581")

    def model_bytes(self, model_text: str) -> Any:
        """The symbols the tables walk for a piece in the model's spelling (bytes, or code points)."""
        if self.spelling == "byte-level":
            data = model_text.encode("latin-1") if model_text.isascii() else bytes(_BYTE_OF[c] for c in model_text)
            return data.translate(None, self.missing_bytes) if self.missing_bytes else data
        return array("I", map(ord, model_text))

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of the characters whose bytes (some or all) have no token (byte-level only;
        byte fallback loses nothing)."""
        return [] if self._lost_re is None else [m.start() for m in self._lost_re.finditer(text)]

    def buffer(self, data: Any = ()) -> Any:
        return bytearray(data) if self.radix == 256 else array("I", data)

    # -- encoding ------------------------------------------------------------------------------

    def count_model(self, model_text: str) -> int:
        """Tokens of one piece in the model's spelling (cached)."""
        n = self._cache.get(model_text)
        if n is None:
            n = len(self._model.tokenize(model_text))
            if len(model_text) <= 256:
                if len(self._cache) >= self._cache_size:
                    self._cache.clear()
                self._cache[model_text] = n
        return n

    def encode_model(self, model_text: str) -> list[TokenId]:
        return [t.id for t in self._model.tokenize(model_text)]

    def encode_bytes(self, data: bytes) -> list[TokenId]:
        """BPE by merges alone of bytes in the tables' form (what :mod:`bpe_tables` calls)."""
        if self.spelling == "byte-level":
            text = bytes(data).decode("latin-1").translate(self._to_model)
        else:
            text = "".join(map(chr, data))
        return [t.id for t in self._merges_model.tokenize(text)]

    def whole_token(self, data: Any) -> bool:
        """Whether a whole piece with these symbols is one token by ``ignore_merges``."""
        if not self.ignore_merges or len(data) > self.max_token_len:
            return False
        return (bytes(data) if self.radix == 256 else tuple(data)) in self._by_bytes


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def spelling(config: dict[str, Any]) -> str:
    """"byte-level" or "sentencepiece" for a `tokenizers` config the general budget implements;
    raises :class:`UnsupportedTokenizer` naming every reason it does not."""
    model = config.get("model") or {}
    normalizer = config.get("normalizer")
    pre = config.get("pre_tokenizer")
    problems = [
        what
        for what, bad in [
            ("model is not BPE", model.get("type") != "BPE"),
            ("BPE dropout", model.get("dropout") not in (None, 0.0)),
            ("subword prefix/suffix", bool(model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"))),
            ("added tokens with single_word, lstrip or rstrip",
             any(t.get(k) for t in config.get("added_tokens", []) for k in ("single_word", "lstrip", "rstrip"))),
        ]
        if bad
    ]
    steps = _steps(pre)
    if model.get("byte_fallback"):
        kinds = [n.get("type") for n in _steps(normalizer, "normalizers")]
        replace_ok = all(
            n.get("type") != "Replace" or (n.get("pattern") == {"String": " "} and n.get("content") == "\u2581")
            for n in _steps(normalizer, "normalizers"))
        prepend_ok = all(n.get("type") != "Prepend" or n.get("prepend") == "\u2581" for n in _steps(normalizer, "normalizers"))
        if pre is not None:
            problems.append("a pre-tokenizer with byte fallback")
        if kinds not in (["Replace"], ["Prepend", "Replace"]) or not replace_ok or not prepend_ok:
            problems.append(f"normalizer {kinds or None} (supported: Replace(' ', '▁'), optionally after Prepend('▁'))")
        if problems:
            raise UnsupportedTokenizer("exact budgeting does not support this SentencePiece-style BPE: " + ", ".join(problems))
        return "sentencepiece"
    if normalizer is not None:
        problems.append("a normalizer on a byte-level BPE")
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    others = [s for s in steps if s.get("type") not in ("ByteLevel", "Split", "Digits")]
    if len(byte_level) != 1 or byte_level[0].get("add_prefix_space") or steps[-1].get("type") != "ByteLevel" or others:
        problems.append("pre-tokenizer is not Split/Digits steps ending in ByteLevel without add_prefix_space")
    if any(s.get("type") == "Split" and (s.get("behavior") != "Isolated" or s.get("invert")) for s in steps):
        problems.append("a Split step that does not isolate its matches")
    if any("(?<" in json.dumps(s.get("pattern", "")) for s in steps):
        problems.append("a pre-tokenizer regex with a lookbehind")
    if problems:
        raise UnsupportedTokenizer("exact budgeting does not support this byte-level BPE: " + ", ".join(problems))
    return "byte-level"


def _steps(node: dict[str, Any] | None, key: str = "pretokenizers") -> list[dict[str, Any]]:
    if node is None:
        return []
    return list(node.get(key, [])) if node.get("type") == "Sequence" else [node]


def _without_ignore_merges(model: dict[str, Any]) -> Any:
    """The same BPE model without ``ignore_merges`` (merges alone decide)."""
    from tokenizers import Tokenizer

    config = {"version": "1.0", "model": {**model, "ignore_merges": False}, "added_tokens": [],
              "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None}
    return Tokenizer.from_str(json.dumps(config)).model
