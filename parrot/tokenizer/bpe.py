"""The byte-level BPE vocabulary of the served tokenizer, and the facts about BPE that make exact
budgeting cheap (from the github/rust-gems ``bpe`` README):

- a token sequence is *valid* when BPE re-encodes its bytes to exactly that sequence; the valid
  encoding of a text is unique;
- any contiguous part of a valid sequence is valid, so the encoding of a prefix ``text[:i]`` is
  the encoding of ``text[:i - len(last)]`` followed by ``last``, its last token;
- a sequence whose neighbouring pairs are all valid is valid, so the last token of a prefix's
  encoding is the one suffix token that forms a valid pair with the last token before it.

:class:`ByteLevelBPE` answers pair validity (cached, by re-encoding two tokens with the
`tokenizers` model itself), encodes pieces (cached), and holds the byte tries that the tables in
:mod:`parrot.tokenizer.bpe_tables` walk.

Bytes without a token. This vocabulary has no token for 21 byte values (0x04 0x06 0x13 0x14 0x16
0x1d 0xc0 0xc1 0xf1 0xf2 0xf5-0xff). The trained tokenizer (and so the served model) silently drops
them, and BPE then merges the bytes on either side as if they were adjacent: ``'!\\x04!'`` is the
one token ``!!``, ``'\\x04'`` alone is no token at all, and U+40000..U+BFFFF (lead byte 0xf1/0xf2)
become the tokens of their three continuation bytes, which decode to U+FFFD. Counts here are what
the model receives, so they include that; :meth:`ByteLevelBPE.lost_characters` says which
characters were (partly) lost, so that callers can report it instead of losing text silently.
"""

from __future__ import annotations

import json
import re
from typing import Any

TokenId = int


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class UnsupportedTokenizer(ValueError):
    """The tokenizer is not the byte-level BPE with the smollm pre-tokenizer this library implements."""


class PairTables:
    """Pair validity and the byte (or code point) tries of a BPE vocabulary: what the tables of
    :mod:`parrot.tokenizer.bpe_tables` ask of one. A subclass sets ``vocab_size``, ``token_str``,
    ``token_bytes``, ``radix``, ``_merges_model`` (BPE by merges alone), ``encode_bytes`` and the
    empty caches ``_pairs``, ``_reachable``, ``_suffix_trie`` and ``_prefix_trie``."""

    vocab_size: int
    radix: int
    token_str: list[str]
    token_bytes: list[Any]
    _merges_model: Any
    _pairs: dict[int, bool]
    _reachable: dict[TokenId, bool]
    _suffix_trie: tuple[dict[int, int], list[TokenId]] | None
    _prefix_trie: tuple[dict[int, int], list[TokenId]] | None

    def encode_bytes(self, data: Any) -> list[TokenId]:
        raise NotImplementedError

    def valid_pair(self, left: TokenId, right: TokenId) -> bool:
        """Whether BPE encodes the bytes of ``left`` + ``right`` as exactly these two tokens."""
        key = left * self.vocab_size + right
        ok = self._pairs.get(key)
        if ok is None:
            ids = self._merges_model.tokenize(self.token_str[left] + self.token_str[right])
            ok = len(ids) == 2 and ids[0].id == left and ids[1].id == right
            self._pairs[key] = ok
        return ok

    def reachable(self, token: TokenId) -> bool:
        """Whether BPE encodes the token's own bytes as that token (else it never occurs)."""
        ok = self._reachable.get(token)
        if ok is None:
            ok = self._reachable[token] = self.encode_bytes(self.token_bytes[token]) == [token]
        return ok

    def suffix_trie(self) -> tuple[dict[int, int], list[TokenId]]:
        """Trie of reversed token symbols: ``children[node * radix + symbol]``, ``token[node]`` (-1: none)."""
        if self._suffix_trie is None:
            self._suffix_trie = self._build_trie(reverse=True)
        return self._suffix_trie

    def prefix_trie(self) -> tuple[dict[int, int], list[TokenId]]:
        if self._prefix_trie is None:
            self._prefix_trie = self._build_trie(reverse=False)
        return self._prefix_trie

    def _build_trie(self, reverse: bool) -> tuple[dict[int, int], list[TokenId]]:
        children: dict[int, int] = {}
        token = [-1]
        radix = self.radix
        for tid, data in enumerate(self.token_bytes):
            node = 0
            for b in reversed(data) if reverse else data:
                key = node * radix + b
                child = children.get(key)
                if child is None:
                    child = len(token)
                    token.append(-1)
                    children[key] = child
                node = child
            if data:
                token[node] = tid
        return children, token


class ByteLevelBPE(PairTables):
    """Vocabulary, cached piece encoding and pair validity of one byte-level BPE tokenizer."""

    radix = 256  # the tables of parrot.tokenizer.bpe_tables walk bytes

    @staticmethod
    def buffer(data: bytes = b"") -> bytearray:
        return bytearray(data)

    def __init__(self, backend: Any, cache_size: int = 200_000) -> None:
        """``backend`` is a `tokenizers.Tokenizer` (``hf.backend_tokenizer``)."""
        config = json.loads(backend.to_str())
        _check_supported(config)
        model = config["model"]
        self._model = backend.model
        self._merges_model = backend.model
        self.special_tokens: dict[str, TokenId] = {t["content"]: t["id"] for t in config["added_tokens"]}
        vocab: dict[str, TokenId] = model["vocab"]
        self.vocab_size = max([*vocab.values(), *self.special_tokens.values()]) + 1
        byte_char = bytes_to_unicode()
        char_byte = {c: b for b, c in byte_char.items()}
        self.token_str: list[str] = [""] * self.vocab_size  # byte-level spelling, "" for added tokens
        self.token_bytes: list[bytes] = [b""] * self.vocab_size
        for s, tid in vocab.items():
            if tid not in self.special_tokens.values():
                self.token_str[tid] = s
                self.token_bytes[tid] = bytes(char_byte[c] for c in s)
        self.token_len = [len(b) for b in self.token_bytes]
        self.max_token_len = max(self.token_len)
        self.byte_token = {b: vocab[byte_char[b]] for b in range(256) if byte_char[b] in vocab}
        self.missing_bytes = bytes(b for b in range(256) if b not in self.byte_token)
        # latin-1 code point of each byte -> its byte-level character (str.translate is C speed)
        self._to_byte_level = {b: byte_char[b] for b in range(256)}
        self._lost_re = _lost_characters_re(set(self.missing_bytes))
        self._cache: dict[str, tuple[TokenId, ...]] = {}
        self._cache_size = cache_size
        self._pairs: dict[int, bool] = {}
        self._reachable: dict[TokenId, bool] = {}
        self._suffix_trie: tuple[dict[int, int], list[TokenId]] | None = None
        self._prefix_trie: tuple[dict[int, int], list[TokenId]] | None = None

    # -- encoding pieces -------------------------------------------------------------------------

    def byte_level(self, piece: str) -> str:
        return piece.encode("utf-8").decode("latin-1").translate(self._to_byte_level)

    def encode_piece(self, piece: str) -> tuple[TokenId, ...]:
        """BPE of one pre-tokenized piece (cached; the `tokenizers` model does the merging)."""
        ids = self._cache.get(piece)
        if ids is None:
            ids = tuple(t.id for t in self._model.tokenize(self.byte_level(piece)))
            if len(piece) <= 256:
                if len(self._cache) >= self._cache_size:
                    self._cache.clear()
                self._cache[piece] = ids
        return ids

    def encode_bytes(self, data: bytes) -> list[TokenId]:
        """BPE of raw bytes (missing bytes must already be removed)."""
        return [t.id for t in self._model.tokenize(data.decode("latin-1").translate(self._to_byte_level))]

    def model_bytes(self, piece: str) -> bytes:
        """The bytes of ``piece`` that BPE sees: UTF-8 without the bytes that have no token."""
        return piece.encode("utf-8").translate(None, self.missing_bytes)

    def byte_offsets(self, piece: str) -> list[int]:
        """For every character boundary 0..len(piece), the offset into :meth:`model_bytes`."""
        if piece.isascii() and not any(b < 128 for b in self.missing_bytes if chr(b) in piece):
            return list(range(len(piece) + 1))
        offsets = [0]
        pos = 0
        for ch in piece:
            pos += len(self.model_bytes(ch))
            offsets.append(pos)
        return offsets

    # -- lost text --------------------------------------------------------------------------------

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of the characters whose UTF-8 bytes (some or all) have no token, so that the
        model does not see them as written (see the module docstring)."""
        if self._lost_re is None:
            return []
        return [m.start() for m in self._lost_re.finditer(text)]


def _check_supported(config: dict[str, Any]) -> None:
    model = config.get("model") or {}
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    smollm = (
        len(steps) == 2
        and steps[0].get("type") == "Digits"
        and steps[0].get("individual_digits") is True
        and steps[1].get("type") == "ByteLevel"
        and steps[1].get("use_regex", True)
        and not steps[1].get("add_prefix_space", False)
    )
    problems = [
        what
        for what, bad in [
            ("model is not BPE", model.get("type") != "BPE"),
            ("BPE dropout", model.get("dropout") not in (None, 0.0)),
            ("byte fallback", bool(model.get("byte_fallback"))),
            ("ignore_merges", bool(model.get("ignore_merges"))),
            ("subword prefix/suffix", bool(model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"))),
            ("a normalizer", config.get("normalizer") is not None),
            ("pre-tokenizer is not Digits(individual) + ByteLevel", not smollm),
        ]
        if bad
    ]
    if problems:
        raise UnsupportedTokenizer("exact budgeting supports the smollm byte-level BPE only: " + ", ".join(problems))


def _lost_characters_re(missing: set[int]) -> re.Pattern[str] | None:
    """A character class of the code points whose UTF-8 encoding contains a missing byte."""
    if not missing:
        return None
    ranges: list[tuple[int, int]] = [(b, b) for b in sorted(missing) if b < 0x80]
    lead_ranges = {  # lead byte -> code points it starts
        **{b: ((b & 0x1F) << 6, ((b & 0x1F) << 6) | 0x3F) for b in range(0xC2, 0xE0)},
        **{b: (max(0x800, (b & 0x0F) << 12), ((b & 0x0F) << 12) | 0xFFF) for b in range(0xE0, 0xF0)},
        **{b: (max(0x10000, (b & 0x07) << 18), min(0x10FFFF, ((b & 0x07) << 18) | 0x3FFFF)) for b in range(0xF0, 0xF5)},
    }
    ranges += [lead_ranges[b] for b in sorted(missing) if b in lead_ranges]
    if any(0x80 <= b < 0xC0 for b in missing):  # a continuation byte: rare, so find them by brute force
        ranges += [(c, c) for c in range(0x80, 0x110000) if not 0xD800 <= c < 0xE000 and any(
            b in missing for b in chr(c).encode("utf-8"))]
    body = "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
    return re.compile(f"[{body}]")
