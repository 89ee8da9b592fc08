"""The state every route reads: config, observers, and the model once it has loaded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from parrot.config import Config
from parrot.engine.engine import Engine
from parrot.engine.backend import LoadedModel
from parrot.engine.scheduler import Scheduler
from parrot.server.errors import APIError
from parrot.server.metrics import Metrics
from parrot.server.response_store import ResponseStore
from parrot.server.sessions import SessionStore
from parrot.server.stats import StatsCollector


@dataclass
class ServerState:
    """Everything a route needs, reachable as ``request.app.state.parrot``."""

    config: Config
    metrics: Metrics = field(default_factory=Metrics)
    stats: StatsCollector = field(default_factory=StatsCollector)
    loaded: LoadedModel | None = None
    engine: Engine | None = None
    scheduler: Scheduler | None = None
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    sessions: SessionStore | None = None  # cross-request drafting, when the config turns it on
    responses: ResponseStore | None = None  # for previous_response_id (server.stored_responses)
    draining: bool = False  # SIGTERM: in-flight requests finish, new ones get 503 (parrot/server/app.py)
    in_flight: int = 0  # HTTP requests being answered (the event loop's count, app.Draining)
    _grammar: Any = None
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock)
    _shared_prefixes: list[list[int]] | None = None

    def __post_init__(self) -> None:
        server = self.config.server
        if server.session_drafting and self.sessions is None:
            self.sessions = SessionStore(server.session_tenants, server.session_tokens)
        if self.responses is None:
            self.responses = ResponseStore(server.stored_responses)

    def grammar_compiler(self) -> Any:
        """The GrammarCompiler for the served tokenizer (built on first use: about 1 s)."""
        from parrot.constrain.grammar import GrammarCompiler

        with self._grammar_lock:
            if self._grammar is None:
                loaded, _ = self.require_ready()
                self._grammar = GrammarCompiler(loaded.tokenizer)
            return self._grammar

    def shared_prefix_tokens(self, ids: list[int]) -> int:
        """How many leading tokens of the prompt ``ids`` are the prefix the configuration shares
        across tenants in the prefix cache (``prefix_cache.shared_prompt``): as a chat's system
        message, or as a completion's text (with and without the vocabulary's BOS); 0 if none."""
        text = self.config.prefix_cache.shared_prompt
        if not text or self.loaded is None:
            return 0
        if self._shared_prefixes is None:
            tokenizer = self.loaded.tokenizer
            candidates = [tokenizer.encode(text, add_special_tokens=False), tokenizer.encode(text)]
            try:
                candidates.append(tokenizer.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False))
            except Exception:  # a template that refuses a lone system message: completions still share
                pass
            self._shared_prefixes = sorted((c for c in candidates if c), key=len, reverse=True)
        return next((len(p) for p in self._shared_prefixes if ids[: len(p)] == p), 0)

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    @property
    def status(self) -> str:
        """What ``/health`` says: ok (200), or loading, draining, error (503)."""
        if self.load_error is not None or (self.scheduler is not None and self.scheduler.failure is not None):
            return "error"
        if self.scheduler is None:
            return "loading"
        return "draining" if self.draining else "ok"

    @property
    def error(self) -> str | None:
        """Why the server cannot serve, when it failed: the model did not load, or the engine stopped."""
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.scheduler is not None and self.scheduler.failure is not None:
            return f"the engine has stopped: {self.scheduler.failure}"
        return None

    def require_ready(self) -> tuple[LoadedModel, Scheduler]:
        error = self.error
        if error is not None:
            raise APIError(503, error)
        if self.loaded is None or self.scheduler is None:
            raise APIError(503, "the model is still loading; retry shortly (GET /health turns 200 when ready)",
                           headers={"Retry-After": "5"})
        return self.loaded, self.scheduler


def state_of(request: Request) -> ServerState:
    """The server's state, typed (FastAPI's ``app.state`` is not)."""
    return request.app.state.parrot  # type: ignore[no-any-return]
