"""Loading checks that run before a model is read: a model that cannot fit is refused with a
clear message (never an OOM kill), and the CLI says so instead of starting a server."""

from __future__ import annotations

import os

import pytest

from parrot import cli
from parrot.engine import memory
from parrot.engine.memory import check_fits, gguf_load_bytes
from parrot.engine.source import ModelTooLargeError, resolve_source


def _embedded_gguf() -> str:
    source = resolve_source("embedded")
    assert source.gguf_file is not None
    return os.path.join(source.path, source.gguf_file)


def test_a_gguf_that_fits_passes_the_memory_check():
    check_fits("embedded", gguf_load_bytes(_embedded_gguf(), float32=True))  # 135M weights on a machine with gigabytes free


def test_a_gguf_that_cannot_fit_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * 2**20)
    # through transformers: every weight in float32 once (0.5 GiB)
    with pytest.raises(ModelTooLargeError, match=r"needs about 0\.\d GiB to load .* 0\.1 GiB is available"):
        check_fits("embedded", gguf_load_bytes(_embedded_gguf(), float32=True))
    check_fits("embedded", gguf_load_bytes(_embedded_gguf(), float32=False))  # onto the kernels: the file's 94 MB
    monkeypatch.setattr(memory, "available_bytes", lambda: 50 * 2**20)
    with pytest.raises(ModelTooLargeError, match="in the file's blocks"):
        check_fits("embedded", gguf_load_bytes(_embedded_gguf(), float32=False))


def test_serve_refuses_a_model_that_cannot_fit_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_bytes", lambda: 10 * 2**20)
    assert cli.main(["serve", "--model", _embedded_gguf(), "--port", "0"]) == 2
    assert "GiB is available" in capsys.readouterr().err


def test_serve_says_when_there_is_no_such_model(capsys, tmp_path):
    assert cli.main(["serve", "--model", str(tmp_path / "missing.gguf"), "--port", "0"]) == 2
    assert "parrot:" in capsys.readouterr().err


def test_a_gguf_loaded_onto_the_kernels_computes_what_the_transformers_path_does(embedded_engine):
    # load_onto_kernels keeps no float32 matrices (the blocks stay in the memory-mapped file; the
    # transformers model is weightless) and must give the same logits, bit for bit, as the
    # forward built from the transformers model and its verified blocks.
    import torch

    from parrot.config import ModelConfig
    from parrot.engine.backends.native import load_onto_kernels

    native = load_onto_kernels(resolve_source("embedded"), ModelConfig())
    assert native is not None and native.forward.native is not None and native.forward.embed is None
    ids = torch.randint(100, 20000, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    results = []
    for forward in (native.forward, embedded_engine.forward):
        cache = forward.new_cache(128)
        results.append(torch.cat([forward.forward([(cache, ids[:80], 2)])[0], forward.forward([(cache, ids[80:], 10)])[0]]))
    assert torch.equal(results[0], results[1])


def test_a_second_conversion_into_the_same_cache_directory_lands_beside_the_first(tmp_path):
    # The kernels' tokenizer-and-config conversion and transformers' full-model conversion of one
    # file share a cache directory; the second used to fail on the first's ("directory not
    # empty") and so converted again on every load.
    from parrot.engine.hf_loading import _publish

    target = tmp_path / "converted"
    for name, files in (("first", ["config.json", "tokenizer.json"]), ("second", ["model.safetensors", "config.json"])):
        staging = tmp_path / f".converting-{name}"
        staging.mkdir()
        for file in files:
            (staging / file).write_text(name)
        _publish(str(staging), str(target), last=files[0])
        assert not staging.exists()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (target / "model.safetensors").read_text() == "second" and (target / "tokenizer.json").read_text() == "first"


def test_a_new_conversion_removes_the_stale_copies_of_its_file(tmp_path, monkeypatch):
    # Reinstalling a model's package (a new modification time) or a new conversion version gives
    # the same file a new cache key; the old copy, up to 600 MB, would never be read again.
    from parrot.engine import hf_loading
    from parrot.engine.source import ModelSource

    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir()
    other = tmp_path / "models" / "other.gguf"
    gone = tmp_path / "models" / "gone.gguf"
    for path in (model, other, gone):
        path.write_bytes(b"GGUF")
    source = ModelSource(str(model.parent), "m.gguf")

    def convert(src: ModelSource) -> str:
        target = hf_loading._conversion_dir(src)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = os.path.join(os.path.dirname(target), ".converting-x")
        os.mkdir(staging)
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write("{}")
        hf_loading._publish(staging, target, last="config.json", source=src)
        return target

    first = convert(source)
    kept = convert(ModelSource(str(model.parent), "other.gguf"))
    stale_gone = convert(ModelSource(str(model.parent), "gone.gguf"))
    unrecorded = os.path.join(os.path.dirname(first), "older-0123456789abcdef")  # made before copies recorded their file
    os.makedirs(unrecorded)
    gone.unlink()
    os.utime(model, ns=(1, 1))  # the package reinstalled: same path, another key
    second = convert(source)
    assert second != first and os.path.isfile(os.path.join(second, "config.json"))
    assert not os.path.exists(first) and not os.path.exists(stale_gone)
    assert os.path.isdir(kept) and os.path.isdir(unrecorded)
    assert hf_loading._recorded_source(second)["path"] == os.path.realpath(model)
