"""A backend is one module that registers itself: the toy backend below, defined in this file
only, loads a model through the real loader and serves requests through the real engine builder
and HTTP routes (``backends/registry.py``).

The toy model counts: after token t it predicts t + 1 (the tiny tokenizer's letters, so "abc"
continues "defg..."). Its forward keeps nothing but a position count per sequence."""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx
import pytest
import torch

from parrot.config import Config, DraftingConfig, ModelConfig
from parrot.engine import backends
from parrot.engine.backend import Forward, KVCache, LoadedModel
from tests.conftest import RunningServer, free_port
from tests.tiny import TinyTokenizer

VOCAB = 64


class CountingCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self.last = 0  # the token at the last position

    def crop(self, length: int) -> None:
        self.length = length


class CountingForward:
    """Logits after token t put all their weight on t + 1 (mod the vocabulary, skipping EOS 0)."""

    max_positions = 256
    vocab_size = VOCAB
    kv_layout = None

    def new_cache(self, capacity: int) -> CountingCache:
        return CountingCache(capacity)

    def forward(self, batch: Sequence[tuple[CountingCache, Sequence[int], int]]) -> list[torch.Tensor]:
        out = []
        for cache, tokens, num_logits in batch:
            cache.length += len(tokens)
            logits = torch.zeros(num_logits, VOCAB)
            for row, token in enumerate(tokens[len(tokens) - num_logits:]):
                logits[row, token % (VOCAB - 1) + 1] = 10.0
            out.append(logits)
        return out


class ToyBackend:
    name = "toy"

    def unsupported(self, source, config) -> str | None:
        try:
            with open(f"{source.path}/config.json") as f:
                kind = json.load(f).get("model_type")
        except OSError:
            return "no config.json"
        return None if kind == "counter" else f"model type {kind!r} is not a counter"

    def memory_needed(self, source, config):
        return (1 << 20, "a count per sequence")

    def load(self, source, config) -> LoadedModel:
        return LoadedModel(forward=CountingForward(), tokenizer=TinyTokenizer(VOCAB), name="counter",  # type: ignore[arg-type]
                           device=torch.device("cpu"), dtype=torch.float32, backend=self.name,
                           context_window=CountingForward.max_positions)

    def wrap(self, hf_model, tokenizer, name, blocks, activations):
        return None

    def describe(self, loaded: LoadedModel) -> dict:
        return {"summary": "counts upwards", "counts": True}


@pytest.fixture
def toy_backend():
    backends.register_backend(ToyBackend())
    yield
    backends.unregister_backend("toy")


@pytest.fixture
def counter_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "counter"}))
    return str(tmp_path)


def test_the_toy_forward_and_cache_meet_the_protocols():
    forward = CountingForward()
    assert isinstance(forward, Forward) and isinstance(forward.new_cache(4), KVCache)


@pytest.mark.parametrize("choice", ["toy", "auto"])
def test_a_backend_registered_in_a_test_file_serves_requests(toy_backend, counter_model, choice):
    # "auto": the built-in backends say they cannot load a model type transformers does not know,
    # so the registry comes to the toy one.
    config = Config(model=ModelConfig(source=counter_model, backend=choice), drafting=DraftingConfig(adaptive=False))
    from parrot.server.app import create_app

    running = RunningServer(create_app(config), free_port()).start()  # the real loader and engine builder
    try:
        health = httpx.get(running.url + "/health").json()
        assert health["backend"] == {"name": "toy", "summary": "counts upwards", "counts": True}
        r = httpx.post(running.url + "/v1/completions", json={"model": "counter", "prompt": "abc", "max_tokens": 6,
                                                              "temperature": 0}, timeout=60).json()
        assert r["choices"][0]["text"] == "defghi"
        assert r["usage"]["completion_tokens"] == 6
    finally:
        running.stop()


def test_a_backend_that_cannot_load_the_source_says_why(toy_backend, tmp_path):
    from parrot.engine.loader import preflight

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "abacus"}))
    with pytest.raises(ValueError, match="toy: model type 'abacus' is not a counter"):
        preflight(ModelConfig(source=str(tmp_path), backend="toy"))
    with pytest.raises(ValueError, match="'nonesuch' is not a backend: give auto or one of native, hf, toy"):
        preflight(ModelConfig(source=str(tmp_path), backend="nonesuch"))


def test_the_built_in_backends_register_in_the_order_auto_tries_them():
    assert backends.backend_names()[:2] == ["native", "hf"]


class BrokenBackend(ToyBackend):
    name = "broken"

    def load(self, source, config) -> LoadedModel:
        raise OSError("the counter's weights are unreadable")


def test_a_backend_that_fails_to_load_is_reported_by_health(counter_model):
    backends.register_backend(BrokenBackend())
    try:
        config = Config(model=ModelConfig(source=counter_model, backend="broken"), drafting=DraftingConfig(adaptive=False))
        from parrot.server.app import create_app

        with pytest.raises(RuntimeError, match="failed to start: .*the counter's weights are unreadable"):
            RunningServer(create_app(config), free_port()).start()
    finally:
        backends.unregister_backend("broken")
