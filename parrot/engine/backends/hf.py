"""The hf backend: transformers' own forward (``hf_runner.py``) for any model transformers loads.

The fallback for what the native forward does not run (other architectures), on any device and
dtype. Its KV of a position depends on how the prompt was chunked, so it serves without the
prefix cache (``Forward.kv_layout`` is None).
"""

from __future__ import annotations

from typing import Any

from parrot.config import ModelConfig
from parrot.engine.backend import LoadedModel, context_window
from parrot.engine.backends.registry import register_backend
from parrot.engine.hf_loading import load_transformers, transformers_config
from parrot.engine.hf_runner import HFForward
from parrot.engine.memory import gguf_load_bytes
from parrot.engine.source import ModelSource


class HFBackend:
    name = "hf"

    def unsupported(self, source: ModelSource, config: ModelConfig) -> str | None:
        if source.gguf_file is not None or source.is_hub_id:
            return None  # transformers' own error on loading says what it cannot read
        try:
            transformers_config(source)
        except (OSError, ValueError) as exc:
            return f"transformers cannot read its config ({str(exc).splitlines()[0][:200]})"
        return None

    def memory_needed(self, source: ModelSource, config: ModelConfig) -> tuple[int, str] | None:
        return None if source.gguf_path is None else gguf_load_bytes(source.gguf_path, float32=True)

    def load(self, source: ModelSource, config: ModelConfig) -> LoadedModel:
        source, tokenizer, hf_model = load_transformers(config, source)
        wrapped = self.wrap(hf_model, tokenizer, source.display_name, {}, config.activations)
        assert wrapped is not None
        return wrapped

    def wrap(self, hf_model: Any, tokenizer: Any, name: str, blocks: dict[str, Any], activations: str) -> LoadedModel | None:
        forward = HFForward(hf_model, context_window(hf_model.config))
        return LoadedModel(forward=forward, tokenizer=tokenizer, name=name, device=forward.device, dtype=forward.dtype,
                           backend=self.name, context_window=forward.max_positions)

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        return {"summary": f"transformers' forward on {loaded.device.type}, SDPA attention"}


register_backend(HFBackend())
