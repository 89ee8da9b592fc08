"""Load the served model: resolve the source, check it fits, and ask the backends (``backends/``).

Which backend loads what is theirs to say; this module only runs the sequence, logs it, and
checks what every backend's result must satisfy.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch

from parrot.config import ModelConfig
from parrot.engine import backends
from parrot.engine.backend import LoadedModel
from parrot.engine.memory import check_fits, release_free_memory, resident_bytes
from parrot.engine.source import ModelSource, resolve_source
from parrot.tokenizer import Tokenizer
from parrot.tokenizer.loader import read_chat_template
from parrot.tokenizer.gguf_vocab import UnsupportedTokenizerError

log = logging.getLogger("parrot.engine")


def preflight(config: ModelConfig) -> None:
    """The checks worth making before a server starts: the model exists, a backend can load it,
    and it would fit."""
    if config.chat_template:
        read_chat_template(config.chat_template)
    source = resolve_source(config.source)
    first = next(backends.candidates(source, config))
    check_fits(source.display_name, first.memory_needed(source, config))


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the model named by ``config.source`` once, with the first backend that can (or the
    one ``config.backend`` names); raise ModelNotFoundError if there is no such model."""
    begin = time.perf_counter()
    baseline = resident_bytes()
    if config.threads:
        torch.set_num_threads(config.threads)
    source = resolve_source(config.source)
    loaded = None
    for backend in backends.candidates(source, config):
        check_fits(source.display_name, backend.memory_needed(source, config))
        try:
            loaded = backend.load(source, config)
            break
        except backends.BackendDeclined as exc:
            log.info("backend %s cannot run %s: %s", backend.name, source.display_name, exc)
    if loaded is None:
        raise ValueError(f"no backend could load {source.display_name} (the reasons are logged above)")
    gc.collect()
    release_free_memory()  # the copies loading freed
    loaded.load_seconds = time.perf_counter() - begin
    if len(loaded.tokenizer.hf) > loaded.forward.vocab_size:  # ids the model has no row for
        raise UnsupportedTokenizerError(
            f"the tokenizer has {len(loaded.tokenizer.hf)} tokens and the model {loaded.forward.vocab_size} rows: "
            "text could encode to ids the model cannot read")
    if config.chat_template:
        loaded.tokenizer.use_chat_template(read_chat_template(config.chat_template))
        log.info("chats rendered with the chat template of model.chat_template, not the model's own")
    loaded.details = backends.get_backend(loaded.backend).describe(loaded)
    log.info("loaded in %.1f s: backend %s, %s, context window %d",
             loaded.load_seconds, loaded.backend, loaded.details["summary"], loaded.context_window)
    gguf_size = os.path.getsize(source.gguf_path) if source.gguf_path else 0
    log.info("resident memory %.0f MB (%.0f MB before loading%s)", resident_bytes() / 2**20, baseline / 2**20,
             f"; GGUF file {gguf_size / 2**20:.0f} MB" if gguf_size else "")
    return loaded


def prepare(hf_model: Any, tokenizer: Tokenizer, name: str, backend: str = "auto",
            blocks: dict[str, Any] | None = None, activations: str = "q8") -> LoadedModel:
    """A transformers model already in memory behind a backend's forward: the one named, or the
    first that runs it (tests and benchmarks compare backends on one loaded model)."""
    names = backends.backend_names() if backend == "auto" else [backend]
    for candidate in names:
        loaded = backends.get_backend(candidate).wrap(hf_model, tokenizer, name, blocks or {}, activations)
        if loaded is not None:
            loaded.details = backends.get_backend(candidate).describe(loaded)
            return loaded
    raise ValueError(f"backend {backend!r} cannot run {name}")


__all__ = ["ModelSource", "load_model", "preflight", "prepare", "resolve_source"]
