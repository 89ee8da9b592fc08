"""A tokenizer that exact budgeting does not implement gets 501 from the token endpoints, in
OpenAI's error shape, instead of a 500; the endpoints that do not budget still answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from parrot.config import Config
from parrot.server.errors import install_error_handlers
from parrot.server.routes import tokens
from parrot.server.state import ServerState
from parrot.tokenizer import Tokenizer


def word_level_tokenizer() -> Tokenizer:
    """A real tokenizer, but word-level rather than SmolLM2's byte-level BPE."""
    backend = Backend(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(hf=PreTrainedTokenizerFast(tokenizer_object=backend), eos_token_ids=frozenset(), name="words")


@pytest.fixture(scope="module")
def client():
    state = ServerState(Config())
    # The token routes read only these of the loaded model; no scheduler runs (none is needed;
    # readiness asks it for a failure).
    state.loaded = SimpleNamespace(tokenizer=word_level_tokenizer(), name="words", context_window=64)  # type: ignore[assignment]
    state.scheduler = SimpleNamespace(failure=None)  # type: ignore[assignment]
    app = FastAPI()
    app.state.parrot = state
    install_error_handlers(app)
    app.include_router(tokens.router)
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("path, body", [
    ("/v1/tokenize", {"prompt": "hello world"}),
    ("/v1/tokens/count", {"text": "hello world"}),
    ("/v1/tokens/truncate", {"text": "hello world", "max_tokens": 1}),
    ("/v1/tokens/chunk", {"text": "hello world", "max_tokens": 1}),
])
def test_budgeting_endpoints_answer_501_naming_the_unsupported_tokenizer(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 501, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_tokenizer" and error["type"] == "not_implemented_error"
    assert error["param"] is None
    assert "not available for the served model's tokenizer" in error["message"]
    assert "model is not BPE" in error["message"]  # what the budget found wrong


def test_detokenize_still_works_with_that_tokenizer(client):
    r = client.post("/v1/detokenize", json={"tokens": [1, 2]})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
