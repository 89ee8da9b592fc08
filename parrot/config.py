"""One typed configuration object, loaded once: TOML file, then environment, then flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from parrot.drafting import drafter_methods

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.toml"
ENV_PREFIX = "PARROT_"
# Shorter names users know from other servers (vLLM's VLLM_API_KEY); the PARROT_<SECTION>_<KEY>
# name wins where both are set.
ENV_ALIASES = {"PARROT_API_KEY": ("server", "api_key")}


@dataclass(frozen=True)
class ModelConfig:
    source: str = "embedded"
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    threads: int = 0
    activations: str = "q8"
    chat_template: str = ""  # a Jinja chat template's path, or the template itself ("": the model's own)

    def __post_init__(self) -> None:
        _check_choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if not self.backend:  # a registered backend's name; the loader checks which exist
            raise ValueError("model.backend must be auto or a backend's name (native, hf)")
        _check_choice("model.activations", self.activations, ("q8", "float32"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.threads < 0:
            raise ValueError("model.threads must be >= 0")


@dataclass(frozen=True)
class DraftingConfig:
    enabled: bool = True
    method: str = "suffix"
    min_n: int = 1
    max_n: int = 8
    max_draft: int = 16
    threshold: float = 0.1
    adaptive: bool = True
    track_cost: bool = True

    def __post_init__(self) -> None:
        _check_choice("drafting.method", self.method, drafter_methods())
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("drafting needs 1 <= min_n <= max_n")
        if not 0 <= self.max_draft <= 64:
            raise ValueError("drafting.max_draft must be in [0, 64]")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("drafting.threshold must be in (0, 1]")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    max_running: int = 8
    request_timeout_s: float = 300.0
    max_body_bytes: int = 4 * 1024 * 1024
    prefill_chunk: int = 512
    prefill_chunk_busy: int = 128
    # Cross-request drafting (parrot/server/sessions.py): opt-in here, then per request.
    session_drafting: bool = False
    session_tokens: int = 8192
    session_tenants: int = 256
    # Responses API: responses kept for previous_response_id (the least recently used go first; 0: none).
    stored_responses: int = 1024
    # API keys (parrot/server/auth.py): a key, and/or a file of keys (one per line); none: no keys asked.
    api_key: str = ""
    api_key_file: str = ""
    # With keys: guard /health and /metrics too (they are open by default, for probes and scrapers).
    protect_monitoring: bool = False
    # JSON schemas with keywords a grammar cannot enforce: served (the rest enforced, the output
    # checked against the whole schema afterwards) unless this is on, then refused with a 400.
    strict_schemas: bool = False
    # SIGTERM drains: new requests get 503, in-flight ones run to the end for at most this long.
    drain_timeout_s: float = 60.0
    # The most tokens one completion may generate (0: what the context window leaves): the
    # default when a request sets none, a 400 above it, and the maximum in the OpenAPI schema.
    max_completion_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("server.port must be in [0, 65535]")
        for name in ("max_queue", "max_running", "max_body_bytes", "prefill_chunk", "prefill_chunk_busy",
                     "session_tokens", "session_tenants"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1")
        if self.request_timeout_s <= 0:
            raise ValueError("server.request_timeout_s must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("server.drain_timeout_s must be >= 0")
        if self.stored_responses < 0:
            raise ValueError("server.stored_responses must be >= 0")
        if self.max_completion_tokens < 0:
            raise ValueError("server.max_completion_tokens must be >= 0 (0: no limit but the context window)")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """KV blocks kept across requests (parrot/engine/prefix_cache.py)."""

    bytes: int = -1  # the budget in host memory; -1: a share of the memory free after loading; 0: off
    block_tokens: int = 4
    # A prompt prefix every tenant may share (a system prompt the operator sends to all), or "".
    shared_prompt: str = ""

    def __post_init__(self) -> None:
        if self.bytes < -1:
            raise ValueError("prefix_cache.bytes must be >= 0, or -1 for the automatic budget")
        if not 1 <= self.block_tokens <= 1024:
            raise ValueError("prefix_cache.block_tokens must be in [1, 1024]")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _coerce(section: str, key: str, kind: type, raw: Any) -> Any:
    """Turn a TOML or environment value into the field's type, or say clearly why not."""
    where = f"{section}.{key}"
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{where}: expected true/false, got {raw!r}")
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{where}: expected {kind.__name__}, got {raw!r}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {type(raw).__name__}")
    return raw


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Defaults < TOML file < ``PARROT_<SECTION>_<KEY>`` environment < explicit overrides."""
    env = os.environ if env is None else env
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        data = tomllib.loads(path.read_text()) if path.exists() else {}
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not path.exists() and path != DEFAULT_CONFIG_PATH:
        raise FileNotFoundError(f"config file not found: {path}")
    sections: dict[str, Any] = {}
    section_types: dict[str, type[Any]] = {"model": ModelConfig, "drafting": DraftingConfig, "server": ServerConfig,
                                           "prefix_cache": PrefixCacheConfig}
    for name, section_type in section_types.items():
        known = {f.name: f for f in fields(section_type)}
        values: dict[str, Any] = {}
        table = data.pop(name, {})
        unknown = set(table) - set(known)
        if unknown:
            raise ValueError(f"{path}: unknown keys in [{name}]: {', '.join(sorted(unknown))}")
        for key, raw in table.items():
            values[key] = _coerce(name, key, _field_type(known[key]), raw)
        for key, f in known.items():
            env_name = f"{ENV_PREFIX}{name}_{key}".upper()
            alias = next((a for a, target in ENV_ALIASES.items() if target == (name, key) and a in env), None)
            if env_name in env or alias is not None:
                values[key] = _coerce(name, key, _field_type(f), env[env_name if env_name in env else alias])
        for key, raw in (overrides or {}).get(name, {}).items():
            if raw is None:
                continue
            if key not in known:
                raise ValueError(f"unknown setting {name}.{key}")
            values[key] = _coerce(name, key, _field_type(known[key]), raw)
        sections[name] = section_type(**values)
    if data:
        raise ValueError(f"{path}: unknown sections: {', '.join(sorted(data))}")
    return Config(**sections)


def _field_type(f: dataclasses.Field[Any]) -> type:
    return {"str": str, "int": int, "float": float, "bool": bool}[str(f.type)]
