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

from server.engine.loader import resolve_source
from tokenizer.loader import UnsupportedTokenizerError, load_tokenizer


@lru_cache(maxsize=1)
def embedded_reader():
    from gguf import GGUFReader

    source = resolve_source("embedded")
    return GGUFReader(os.path.join(source.path, source.gguf_file or ""))


def tokenizer_only_gguf(directory: str, pre: str) -> str:
    from gguf import GGUFValueType, GGUFWriter

    reader = embedded_reader()
    path = os.path.join(directory, f"tokenizer-{pre}.gguf")
    writer = GGUFWriter(path, "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.pre":
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
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
