"""GGUFs of other model families: a byte-level BPE vocabulary loads when Parrot reproduces its
pre-tokenizer rule (``tokenizer.ggml.pre``) and is refused, naming the rule, when it does not.

The files are metadata only: the embedded model's tokenizer fields with ``tokenizer.ggml.pre``
set to another family's value (no such file is on disk offline; the vocabulary does not matter
for which pre-tokenizer is chosen)."""

from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest

from parrot.engine.source import resolve_source
from parrot.tokenizer.loader import UnsupportedTokenizerError, load_tokenizer


@lru_cache(maxsize=1)
def embedded_reader():
    from parrot.gguf_file import GGUFFile

    source = resolve_source("embedded")
    return GGUFFile(os.path.join(source.path, source.gguf_file or ""))


def tokenizer_only_gguf(directory: str, pre: str) -> str:
    from gguf import GGUFValueType, GGUFWriter

    reader = embedded_reader()
    path = os.path.join(directory, f"tokenizer-{pre}.gguf")
    writer = GGUFWriter(path, "llama")
    for key in reader.keys():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.pre":
            value, vtype, sub = reader.typed(key)
            writer.add_key_value(key, value, GGUFValueType(vtype), None if sub is None else GGUFValueType(sub))
    writer.add_key_value("tokenizer.ggml.pre", pre, GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_pre_tokenizer_parrot_cannot_reproduce_is_refused_by_name(tmp_path):
    # Guards against loading it with GPT-2's regex, as SmolLM2's digit rule was once dropped:
    # counts and outputs would be silently wrong.
    path = tokenizer_only_gguf(str(tmp_path), "some-new-family")
    with pytest.raises(UnsupportedTokenizerError, match="'some-new-family'"):
        load_tokenizer(str(tmp_path), os.path.basename(path))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_vocabularies_get_their_own_split_rule(tmp_path, pre):
    path = tokenizer_only_gguf(str(tmp_path), pre)
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(path))
    rule = json.loads(tokenizer.hf.backend_tokenizer.to_str())["pre_tokenizer"]
    assert rule["type"] == "Sequence" and rule["pretokenizers"][0]["type"] == "Split"
    # Llama 3 and Qwen2 split digits into runs of 1 to 3 and 1 (SmolLM2: 1), unlike GPT-2's regex.
    assert "\\p{N}" in json.dumps(rule)
    assert tokenizer.encode("hello world") == tokenizer.hf.encode("hello world", add_special_tokens=False)


def vocabulary_gguf(path: str, model: str, tokens: list[str], types: list[int], pre: str | None = None,
                    merges: list[str] | None = None, eos: int = 2, add_space_prefix: bool | None = None,
                    arch: str = "llama") -> str:
    """A GGUF holding only a made-up vocabulary (token types: 1 normal, 2 unknown, 3 control,
    4 user-defined, 6 byte)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])  # earlier tokens merge first
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if model == "llama":
        writer.add_add_bos_token(True)  # as Llama 2's and Mistral's files say
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_gguf(directory: str, add_space_prefix: bool | None = None) -> str:
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "ll", "▁He", "▁Hell", "▁Hello",
              "▁w", "▁wo", "▁wor", "▁worl", "▁world", "▁▁", "▁▁▁"]  # space runs merge last, as in Llama 2
    tokens = specials + byte_tokens + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return vocabulary_gguf(os.path.join(directory, "spm.gguf"), "llama", tokens, types,
                           add_space_prefix=add_space_prefix)


def test_gemma_whitespace_tokens_are_matched_whole_and_longest_first(tmp_path):
    # Gemma's files store its user-defined runs of spaces with real spaces, and SentencePiece and
    # llama.cpp match user-defined tokens whole, longest first, before any merging: four spaces
    # and x are [three spaces, ▁x]. Merging alone gave [▁▁, ▁▁, x] (on the real Gemma 3, 3,000
    # spaces came out in runs of 16 instead of 31). Loading a Gemma file failed on them before.
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "x", "▁x", "  ", "   "]
    types = [3, 3, 3, 2] + [6] * 256 + [1, 1, 1, 4, 4]
    path = vocabulary_gguf(str(tmp_path / "gemma.gguf"), "llama", specials + byte_tokens + pieces, types, eos=1,
                           add_space_prefix=False, arch="gemma3")
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(path))
    ids = {token: i for i, token in enumerate(specials + byte_tokens + pieces)}
    assert tokenizer.encode("    x") == [ids["   "], ids["▁x"]]
    assert tokenizer.encode("x  x") == [ids["x"], ids["  "], ids["x"]]
    assert tokenizer.encode(" x") == [ids["▁x"]]
    for text in ("    x", "x  x", "  ", "       "):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_sentencepiece_vocabularies_prepend_a_space_to_every_text_as_llama_cpp_does(tmp_path):
    # Llama 2's and Mistral's tokenizers (and llama.cpp on their GGUFs) turn ' Hello' into
    # '▁▁Hello' -> [▁, ▁Hello]; transformers' conversion prepended only where the text did not
    # start with a space, so leading spaces lost one '▁' (llama.cpp's ggml-vocab-llama-spm tests:
    # 15 of 47 were wrong; `make check-vocabs` runs them all).
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(sentencepiece_gguf(str(tmp_path))))
    pieces = lambda text: tokenizer.hf.convert_ids_to_tokens(tokenizer.encode(text))  # noqa: E731
    assert pieces("Hello") == ["▁Hello"]
    assert pieces(" Hello") == ["▁", "▁Hello"]
    assert pieces("  Hello world") == ["▁▁", "▁Hello", "▁world"]
    assert pieces("Hello  world") == ["▁Hello", "▁", "▁world"]
    for text in ["Hello", " Hello", "  Hello world", "Hello\nworld"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # a completion's prompt gets the vocabulary's BOS (vLLM's add_special_tokens, llama.cpp too)
    assert tokenizer.encode("Hello", add_special_tokens=True) == [1, *tokenizer.encode("Hello")]


def test_a_sentencepiece_vocabulary_without_a_space_prefix_gets_none(tmp_path):
    path = sentencepiece_gguf(str(tmp_path), add_space_prefix=False)
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(path))
    pieces = lambda text: tokenizer.hf.convert_ids_to_tokens(tokenizer.encode(text))  # noqa: E731
    assert pieces(" Hello") == ["▁Hello"]
    assert pieces("He") == ["H", "e"]
    for text in ["Hello", " Hello world"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def byte_level_gguf(directory: str, pre: str, specials: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>")) -> str:
    from parrot.tokenizer.bpe import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    tokens = [*byte_chars, "ab", "abc", *specials]
    types = [1] * (len(byte_chars) + 2) + [3] * len(specials)
    return vocabulary_gguf(os.path.join(directory, f"bytes-{pre}-{len(specials)}.gguf"), "gpt2", tokens, types,
                           pre=pre, merges=["a b"], eos=tokens.index(specials[0]))


@pytest.mark.parametrize("pre, whole_word", [("llama-bpe", True), ("gpt2", False)])
def test_llama3_vocabularies_take_a_word_in_the_vocabulary_whole(tmp_path, pre, whole_word):
    # Llama 3's tokenizer.json sets ignore_merges: a pre-tokenized word that is a token is that
    # token even where the merges never build it ('abc' here; 'Cửa Việt' in Llama 3's vocabulary,
    # llama.cpp's ggml-vocab-llama-bpe test). GPT-2's vocabulary merges as usual.
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(byte_level_gguf(str(tmp_path), pre)))
    pieces = tokenizer.hf.convert_ids_to_tokens(tokenizer.encode("abc"))
    assert pieces == (["abc"] if whole_word else ["ab", "c"])
    # Llama 3's begins a completion's prompt with BOS (id 1 here) though the file does not say so,
    # as llama.cpp reads it; GPT-2's adds nothing.
    plain = tokenizer.encode("abc")
    assert tokenizer.encode("abc", add_special_tokens=True) == ([1, *plain] if whole_word else plain)
    assert tokenizer.decode(tokenizer.encode("abc abc")) == "abc abc"


def test_special_end_of_turn_tokens_end_generation_beside_eos(tmp_path):
    # A Qwen2 GGUF's EOS is <|endoftext|> while its chat turns end with <|im_end|>.
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(byte_level_gguf(str(tmp_path), "gpt2")))
    names = tokenizer.hf.convert_ids_to_tokens(sorted(tokenizer.eos_token_ids))
    assert sorted(names) == ["<|endoftext|>", "<|im_end|>"]


def test_vocabularies_with_every_byte_lose_no_character(tmp_path):
    # /v1/tokenize reports lost characters: none where every byte has a token (SentencePiece
    # byte fallback here, on the general budget; Llama 3's and Qwen2's byte-level vocabularies
    # likewise).
    from parrot.tokenizer.general import GeneralBudget

    spm = load_tokenizer(str(tmp_path), os.path.basename(sentencepiece_gguf(str(tmp_path))))
    assert isinstance(spm.budget, GeneralBudget)
    assert spm.covers_every_byte and spm.lost_characters("Hello \x04 wörld") == []
    partial = load_tokenizer(str(tmp_path), os.path.basename(byte_level_gguf(str(tmp_path), "llama-bpe")))
    assert partial.covers_every_byte  # all 256 byte characters are in it


def test_special_tokens_keep_the_files_ids_and_no_token_is_added(tmp_path):
    # DeepSeek's control tokens are not ASCII: transformers spelled them as byte-level text and
    # added them again beyond the vocabulary (EOS and BOS ids the model has no row for); and it
    # adds <|endoftext|> to a vocabulary without one (Llama 3's), so that the text became id
    # 128,256. Both found with llama.cpp's vocabularies (make check-vocabs).
    specials = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>")
    path = byte_level_gguf(str(tmp_path), "llama-bpe", specials)
    tokenizer = load_tokenizer(str(tmp_path), os.path.basename(path))
    size = 256 + 2 + len(specials)
    assert len(tokenizer.hf) == size and max(tokenizer.hf.added_tokens_decoder) < size
    end = size - 2
    assert tokenizer.encode("ab<｜end▁of▁sentence｜>") == [256, end]
    assert tokenizer.eos_token_ids == {end}
    assert all(t < 256 for t in tokenizer.encode("<|endoftext|>"))  # plain text here


def test_a_new_file_is_converted_in_a_child_process_and_a_refusal_comes_back(tmp_path, monkeypatch):
    # The first load of a GGUF parses its tokenizer and config with transformers in a child
    # process (its modelling imports would otherwise stay resident in the server), and reads the
    # cached copy here; a tokenizer the child refuses is refused here, by name.
    from loadtests.make_synthetic_gguf import write
    from parrot.engine import hf_loading as loader

    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "cache"))
    children = []
    real_run = loader.subprocess.run
    monkeypatch.setattr(loader.subprocess, "run", lambda *a, **k: children.append(a[0]) or real_run(*a, **k))
    write(str(tmp_path / "good.gguf"), "tiny", "Q8_0")
    source = loader.ModelSource(str(tmp_path), "good.gguf")
    tokenizer, config = loader.gguf_tokenizer_and_config(source)
    assert len(children) == 1 and os.path.isfile(os.path.join(loader._conversion_dir(source), "config.json"))
    assert config.num_hidden_layers == 2 and tokenizer.encode("a  1") == embedded_tokenizer().encode("a  1")
    loader.gguf_tokenizer_and_config(source)  # now from the cache: no child
    assert len(children) == 1

    write(str(tmp_path / "odd.gguf"), "tiny", "Q8_0", vocab_file=tokenizer_only_gguf(str(tmp_path), "some-new-family"))
    with pytest.raises(UnsupportedTokenizerError, match="'some-new-family'"):
        loader.gguf_tokenizer_and_config(loader.ModelSource(str(tmp_path), "odd.gguf"))
    assert len(children) == 2


@lru_cache(maxsize=1)
def embedded_tokenizer():
    source = resolve_source("embedded")
    return load_tokenizer(source.path, source.gguf_file)


def test_merges_saved_as_strings_read_to_the_same_tokenizer(tmp_path, embedded_tokenizer):
    """The conversion cache writes BPE merges as "a b" strings (2.3 MB less resident when read);
    tokenizers must read them to the very tokenizer the pairs give: serialised again, the two
    are the same JSON. A merge whose parts hold a space keeps the pair form."""
    from tokenizers import Tokenizer

    from parrot.tokenizer.loader import write_merges_as_strings

    embedded_tokenizer.hf.save_pretrained(tmp_path)
    path = str(tmp_path / "tokenizer.json")
    pairs = Tokenizer.from_file(path)
    assert isinstance(json.loads(pairs.to_str())["model"]["merges"][0], list)
    assert write_merges_as_strings(path)
    with open(path, encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    assert len(merges) > 40_000 and all(isinstance(m, str) for m in merges)
    assert Tokenizer.from_file(path).to_str() == pairs.to_str()

    data = json.loads(pairs.to_str())
    data["model"]["merges"][0] = ["a b", "c"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    assert not write_merges_as_strings(path)
