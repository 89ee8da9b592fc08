"""The one GGUF reader (parrot/gguf_file.py) reads what the gguf package reads: every metadata
value and every tensor's type, shape and bytes, on the embedded model and on synthetic files of
each architecture the loader takes; arrays are decoded only when asked for."""

from __future__ import annotations

import numpy as np
import pytest

from parrot.engine.source import resolve_source
from parrot.gguf_file import GGUFFile, ValueType


def _agrees_with_the_gguf_package(path: str) -> int:
    from gguf import GGUFReader

    ours, theirs = GGUFFile(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the package's own header fields
    assert ours.keys() == keys
    for key in keys:
        value = ours.get(key)
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == theirs.fields[key].contents(), key
        assert ours.fields[key].type == theirs.fields[key].types[0], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.type == reference.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(reference.shape))
        assert mine.data.tobytes() == np.asarray(reference.data).tobytes(), mine.name
    return len(keys)


def test_the_embedded_model_reads_as_the_gguf_package_reads_it():
    source = resolve_source("embedded")
    assert source.gguf_path is not None
    assert _agrees_with_the_gguf_package(source.gguf_path) > 20
    gguf = GGUFFile(source.gguf_path)
    assert gguf.architecture == "llama" and len(gguf.get("tokenizer.ggml.tokens")) == 49152
    assert gguf.fields["tokenizer.ggml.tokens"].item_type == ValueType.STRING


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_files_read_as_the_gguf_package_reads_them(tmp_path, arch):
    from loadtests.make_synthetic_gguf import write

    path = str(tmp_path / f"{arch}.gguf")
    write(path, "tiny", "Q4_K_M", arch=arch)
    assert _agrees_with_the_gguf_package(path) > 20
    assert GGUFFile(path).architecture == arch


def test_arrays_are_decoded_when_asked_for_and_values_keep_their_types():
    source = resolve_source("embedded")
    gguf = GGUFFile(source.gguf_path or "")
    assert "tokenizer.ggml.tokens" not in gguf._values  # the header was walked, the vocabulary not decoded
    value, kind, item = gguf.typed("tokenizer.ggml.token_type")
    assert kind == ValueType.ARRAY and item == ValueType.INT32 and isinstance(value, list)
    assert gguf.get("no.such.key", 7) == 7


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
