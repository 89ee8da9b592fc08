"""The FastAPI application: lifespan (model loads in the background), routers, limits, errors."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import Config
from server.engine.engine import Engine
from server.engine.loader import LoadedModel
from server.engine.scheduler import Scheduler
from server.errors import APIError, install_error_handlers
from server.state import ServerState
from server.stats import Observers

log = logging.getLogger("parrot.http")

EngineBuilder = Callable[[Config], tuple[LoadedModel, Engine]]


def _default_builder(config: Config) -> tuple[LoadedModel, Engine]:
    from server.engine.build import build_engine

    return build_engine(config)


class BodyLimit:
    """Reject request bodies over ``limit`` bytes with 413 before reading them into memory."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body exceeds {self.limit} bytes", code="request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await too_large.response()(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_large.response()(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def create_app(config: Config, builder: EngineBuilder | None = None) -> FastAPI:
    """The app. The model loads on a background thread at start-up; /health is 503 until then."""
    state = ServerState(config)
    build = builder or _default_builder

    def load_and_run() -> None:
        # One thread does all the model work, loading included: torch's OpenMP pool belongs to
        # the thread that first uses it, and two pools on a small machine fight each other.
        try:
            loaded, engine = build(config)
        except Exception as exc:  # reported by /health and every route, not a crash
            log.exception("model failed to load")
            state.load_error = str(exc)
            return
        observers = Observers(state.metrics, state.stats)
        scheduler = Scheduler(engine, config.server.max_running, config.server.max_queue, observers)
        state.loaded, state.engine, state.scheduler = loaded, engine, scheduler
        state.metrics.model_loaded.set(1)
        log.info("ready: serving %s", loaded.name)
        scheduler.run()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=load_and_run, name="parrot-engine", daemon=True)
        thread.start()
        yield
        if state.scheduler is not None:
            state.scheduler.stop()
            await asyncio.to_thread(thread.join, 10)

    app = FastAPI(title="Parrot", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server with exact n-gram speculative decoding")
    app.state.parrot = state
    install_error_handlers(app)

    from server.routes import dashboard, openai_api, responses, system, tasks, tokens

    app.include_router(system.router)
    app.include_router(openai_api.router)
    app.include_router(responses.router)
    app.include_router(tasks.router)
    app.include_router(tokens.router)
    app.include_router(dashboard.router)

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        state.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    app.add_middleware(BodyLimit, limit=config.server.max_body_bytes)
    return app


def serve(config: Config) -> int:
    import uvicorn

    app = create_app(config)
    host, port = config.server.host, config.server.port
    log.info("Parrot listening on http://%s:%d (model %s)", host, port, config.model.source)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    return 0
