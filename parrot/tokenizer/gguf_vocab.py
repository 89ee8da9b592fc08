"""A GGUF's vocabulary as its family's own tokenizer has it.

transformers converts a GGUF vocabulary into a `tokenizers` tokenizer, and gets several families
wrong in ways that change token ids silently; each was found with llama.cpp's tokenizer tests
(``models/ggml-vocab-*.gguf`` with the ids each family's own tokenizer gives; ``make
check-vocabs``) and is fixed here, after the conversion:

- the pre-tokenizer named by ``tokenizer.ggml.pre`` is dropped for some families (SmolLM2 splits
  digits one by one before GPT-2's regex: without it ``'a  1'`` is ``a, Ġ, Ġ, 1`` instead of
  ``a, ĠĠ, 1``; DeepSeek's lists of regexes);
- Llama 3's ``ignore_merges`` is dropped, and so is its BOS where the file does not name it;
- SentencePiece vocabularies (Llama 2, Mistral) prepend ``▁`` only where the text does not
  start with a space;
- control tokens whose text is not ASCII (DeepSeek's ``<｜end▁of▁sentence｜>``) are spelled as
  byte-level text and added again under new ids beyond the model's vocabulary, and tokens the
  file does not have are added (``<|endoftext|>`` after Llama 3's 128,256).

A byte-level BPE vocabulary whose pre-tokenizer Parrot does not know is refused by name rather
than split with GPT-2's regex.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from tokenizers import Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from parrot.gguf_file import GGUFFile

# llama.cpp's token types (gguf's TokenType)
CONTROL, USER_DEFINED = 3, 4


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Digits one by one, then GPT-2's byte-level regex (SmolLM, StarCoder, Refact, Command-R)."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _regex_splits(*patterns: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    """Split by each regex in turn (matches kept as pieces of their own), then bytes as they are:
    how llama.cpp's unicode.cpp applies a family's list of regexes, and the family's own
    tokenizer.json spells them."""
    def build() -> pre_tokenizers.PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return build


# DeepSeek LLM's and DeepSeek Coder's lists (Llama-architecture models), from llama.cpp's
# llama-vocab.cpp; checked against its ggml-vocab-deepseek-{llm,coder} tests (make check-vocabs).
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)

# GGUF `tokenizer.ggml.pre` values whose pre-tokenizer transformers does not reproduce, mapped to
# the pre-tokenizer the model was trained with.
_PRE_TOKENIZER_FIXES: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "command-r": _digits_then_gpt2,
    "deepseek-llm": _regex_splits("[\r\n]", _DEEPSEEK_LETTERS,
                                  "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                                  "\\s+$", _CJK, "\\p{N}+"),
    "deepseek-coder": _regex_splits("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}"),
}


# Byte-level BPE pre-tokenizers that transformers' GGUF conversion keeps as they are: GPT-2's regex.
_GPT2_PRE = ("default", "gpt-2", "gpt2")

# Vocabularies whose trained tokenizer takes a whole pre-tokenized word that is in the vocabulary
# as one token before merging (tokenizer.json's ``ignore_merges``, as llama.cpp's llama-vocab.cpp
# sets it for these ``tokenizer.ggml.pre`` values). transformers' GGUF conversion drops it: Llama
# 3's ``'Cửa Việt'`` then encodes as 5 tokens instead of 3 (llama.cpp's ggml-vocab-llama-bpe test).
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                "midm-2.0", "lfm2", "jina-v5-nano", "tekken"})

# Vocabularies that begin every text with BOS when the file does not say (no
# ``tokenizer.ggml.add_bos_token``), as llama.cpp reads them; transformers' conversion adds none.
_ADD_BOS_PRE = _IGNORE_MERGES_PRE | {"chameleon"}


class UnsupportedTokenizerError(ValueError):
    """A GGUF's tokenizer that Parrot cannot reproduce exactly as the model was trained with it."""


def supported_pre_tokenizers() -> set[str]:
    """``tokenizer.ggml.pre`` values of byte-level BPE vocabularies whose pre-tokenizer Parrot
    reproduces: its own fixes, the splits transformers' GGUF conversion sets, and GPT-2's."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # another transformers version: only what Parrot itself knows
        GGUF_PRE_TOKENIZER_SPLITS = {}
    return set(_PRE_TOKENIZER_FIXES) | set(GGUF_PRE_TOKENIZER_SPLITS) | set(_GPT2_PRE)


def check_gguf_tokenizer(model: str | None, pre: str | None) -> None:
    """Raise UnsupportedTokenizerError for a byte-level BPE vocabulary whose pre-tokenizer rule
    Parrot does not know: transformers would fall back to GPT-2's regex, so text would be split
    differently from how the model was trained (as SmolLM2's digit rule was dropped) and token
    counts and outputs would be silently wrong. SentencePiece vocabularies (``llama``) and the
    others transformers converts carry no such rule; transformers refuses those it cannot build."""
    if model == "gpt2" and pre is not None and pre not in supported_pre_tokenizers():
        raise UnsupportedTokenizerError(
            f"the GGUF's tokenizer is byte-level BPE with tokenizer.ggml.pre = {pre!r}, a pre-tokenizer "
            f"Parrot cannot reproduce exactly (supported: {', '.join(sorted(supported_pre_tokenizers()))}); "
            "serve the model's Hugging Face directory (with its tokenizer.json) instead")


def _fix_sentencepiece(backend: Any, add_space_prefix: bool) -> None:
    """A SentencePiece (``tokenizer.ggml.model = llama``) vocabulary as llama.cpp tokenizes it and
    as Llama 2's and Mistral's own tokenizer.json do: every text segment gets a ``▁`` prepended
    (when ``add_space_prefix``) and spaces become ``▁``. transformers' GGUF conversion uses
    Metaspace with ``prepend_scheme='first'``, which prepends only where the text does not
    already start with a space: ``' Hello'`` became ``[▁Hello]`` instead of ``[▁, ▁Hello]``, and
    every run of leading spaces lost one (15 of llama.cpp's 47 ggml-vocab-llama-spm tests)."""
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    if not add_space_prefix:  # nothing was prepended, so decoding strips nothing
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


@dataclass
class GGUFVocabulary:
    """What a GGUF says about its tokenizer (read once; the token texts and types only where a
    fix needs them)."""

    model: str | None  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre
    add_space_prefix: bool  # tokenizer.ggml.add_space_prefix (true when absent, as llama.cpp reads it)
    add_bos: bool | None  # tokenizer.ggml.add_bos_token (None when absent)
    tokens: list[str]
    types: list[int]

    @classmethod
    def read(cls, gguf_path: str) -> GGUFVocabulary:
        gguf = GGUFFile(gguf_path)
        space = gguf.get("tokenizer.ggml.add_space_prefix")
        add_bos = gguf.get("tokenizer.ggml.add_bos_token")
        return cls(
            model=gguf.get("tokenizer.ggml.model"), pre=gguf.get("tokenizer.ggml.pre"),
            add_space_prefix=True if space is None else bool(space), add_bos=None if add_bos is None else bool(add_bos),
            tokens=list(gguf.get("tokenizer.ggml.tokens", [])),
            types=[int(t) for t in gguf.get("tokenizer.ggml.token_type", [])],
        )


def fix_gguf_tokenizer(hf: Any, vocabulary: GGUFVocabulary) -> None:
    """Make ``hf`` (transformers' conversion of the GGUF) tokenize as the family's own tokenizer."""
    fix = _PRE_TOKENIZER_FIXES.get(vocabulary.pre or "")
    if fix is not None:
        current = json.loads(hf.backend_tokenizer.to_str())["pre_tokenizer"]
        if current is None or current.get("type") == "ByteLevel":
            hf.backend_tokenizer.pre_tokenizer = fix()
    if vocabulary.pre in _IGNORE_MERGES_PRE:
        hf.backend_tokenizer.model.ignore_merges = True
    if vocabulary.add_bos is None and vocabulary.pre in _ADD_BOS_PRE:
        hf.add_bos_token = True  # Llama 3's own tokenizer begins every text with <|begin_of_text|>
    if vocabulary.model == "llama":
        _fix_sentencepiece(hf.backend_tokenizer, vocabulary.add_space_prefix)
    _fix_added_tokens(hf, vocabulary)


def _fix_added_tokens(hf: Any, vocabulary: GGUFVocabulary) -> None:
    """Control and user-defined tokens at the ids the file gives them, spelled as the file spells
    them, and no token beyond the file's vocabulary (the model has no row for it: a prompt with
    the text ``<|endoftext|>`` became id 128,256 on a Llama 3 file). In a SentencePiece vocabulary
    every user-defined token is matched whole before the pieces are merged, longest first, as
    SentencePiece and llama.cpp match them: Gemma's runs of 2-31 spaces are user-defined, and 3,000
    spaces tokenize as runs of 31, where merging stopped at runs of 16. Only what is wrong changes."""
    tokens, types = vocabulary.tokens, vocabulary.types
    size = len(tokens)
    spm = vocabulary.model == "llama"

    def spelling(i: int) -> str:  # SentencePiece spells spaces as ▁; Gemma's files store real spaces
        return tokens[i].replace(" ", "▁") if spm else tokens[i]

    misplaced = {i: tokens[i] for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)
                 and hf.convert_tokens_to_ids(tokens[i]) != i and hf.convert_tokens_to_ids(spelling(i)) != i}
    unmatched = [i for i, kind in enumerate(types) if spm and kind == USER_DEFINED and i not in misplaced
                 and i not in hf.added_tokens_decoder]
    beyond = [i for i in hf.added_tokens_decoder if i >= size]
    if not misplaced and not beyond and not unmatched:
        return
    state = json.loads(hf.backend_tokenizer.to_str())
    vocab = state["model"].get("vocab")
    if misplaced and not isinstance(vocab, dict):
        raise UnsupportedTokenizerError(
            f"the GGUF's special tokens {sorted(misplaced.values())[:3]} do not convert to their ids, "
            "and Parrot can only respell them in a BPE vocabulary")
    if misplaced:
        spelled = {tid: text for text, tid in vocab.items()}
        for tid, text in misplaced.items():
            vocab.pop(spelled.get(tid, text), None)
            vocab[text] = tid
    added = [a for a in state["added_tokens"] if a["id"] < size and a["id"] not in misplaced]
    added += [{"id": tid, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": types[tid] == CONTROL} for tid, text in misplaced.items()]
    # matched in the normalized text, where spaces are already ▁
    added += [{"id": tid, "content": spelling(tid), "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": True, "special": False} for tid in unmatched]
    state["added_tokens"] = sorted(added, key=lambda a: a["id"])
    ids = {text: tid for tid, text in misplaced.items()}
    for entry in _post_processor_tokens(state.get("post_processor")):  # BOS added by the template
        if entry.get("id") in ids:
            entry["ids"] = [ids[entry["id"]]]
    hf._tokenizer = Backend.from_str(json.dumps(state))


def _post_processor_tokens(processor: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The special-token entries (``{"id": text, "ids": [...]}``) of a post-processor's JSON."""
    if not processor:
        return []
    if processor.get("type") == "Sequence":
        return [entry for step in processor.get("processors", []) for entry in _post_processor_tokens(step)]
    return list((processor.get("special_tokens") or {}).values())
