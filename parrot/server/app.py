"""The FastAPI application: lifespan (model loads in the background), routers, limits, errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parrot.server.auth import KeyChecker, RequireKey, read_keys
from parrot.config import Config
from parrot.engine.engine import Engine
from parrot.engine.backend import LoadedModel
from parrot.engine.source import ModelNotFoundError, ModelTooLargeError
from parrot.engine.memory import share_one_heap
from parrot.engine.scheduler import Scheduler
from parrot.server.errors import APIError, install_error_handlers
from parrot.server.state import ServerState
from parrot.server.stats import Observers
from parrot.tokenizer.loader import UnsupportedTokenizerError

# Loading errors that are a verdict on the model, not a fault: logged as their message alone.
REFUSALS = (ModelNotFoundError, ModelTooLargeError, UnsupportedTokenizerError)

log = logging.getLogger("parrot.http")

EngineBuilder = Callable[[Config], tuple[LoadedModel, Engine]]


def _default_builder(config: Config) -> tuple[LoadedModel, Engine]:
    from parrot.engine.build import build_engine

    return build_engine(config)


class _HttpMiddleware:
    """An ASGI middleware of HTTP requests (``http``); anything else (lifespan) passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class BodyLimit(_HttpMiddleware):
    """Reject request bodies over ``limit`` bytes with 413 before reading them into memory."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        super().__init__(app)
        self.limit = limit

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
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


# Answered while draining: the health check says so, and monitoring keeps working.
_SERVED_WHILE_DRAINING = ("/health", "/metrics", "/v1/stats")


class Draining(_HttpMiddleware):
    """Counts the requests in flight (``state.in_flight``) and, once ``state.draining`` is set
    (SIGTERM, see ``DrainingServer``), answers new ones with 503 and ``Connection: close``."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        super().__init__(app)
        self.state = state

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.state.draining and scope.get("path") not in _SERVED_WHILE_DRAINING:
            refused = APIError(503, "the server is shutting down; retry on another instance", code="server_shutting_down",
                               headers={"Connection": "close"})
            await refused.response()(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once the response (a stream too) is sent
        finally:
            self.state.in_flight -= 1


class CountRequests(_HttpMiddleware):
    """Counts each response by route and status (``parrot_requests_total``) as it starts. Plain ASGI
    rather than ``@app.middleware("http")``: that one passes every chunk of a stream through a
    memory channel and a task of its own, work the event loop did per streamed token."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        super().__init__(app)
        self.state = state

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":  # the router has put the route in the scope by now
                endpoint = getattr(scope.get("route"), "path", "unmatched")
                self.state.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def freeze_startup_heap() -> None:
    """Move every object alive once the model is loaded (the tokenizer's vocabulary, the model's
    tables, the app) into Python's permanent generation, which the garbage collector never scans.
    A full collection walks every tracked object while holding the GIL, so it stalls the engine
    thread and every stream: over a loaded server's 257,000 objects it took 115-120 ms
    (Qwen2.5-Coder-1.5B, AMD EPYC Zen 4, 2026-11-29). vLLM freezes its heap after warm-up the same
    way (freeze_gc_heap); SGLang offers it as freeze_gc. Objects made later are collected as
    before; the app's shutdown unfreezes."""
    gc.collect()
    gc.freeze()
    log.debug("froze %d start-up objects out of the garbage collector's scans", gc.get_freeze_count())


def create_app(config: Config, builder: EngineBuilder | None = None) -> FastAPI:
    """The app. The model loads on a background thread at start-up; /health is 503 until then."""
    state = ServerState(config)
    build = builder or _default_builder

    def load_and_run() -> None:
        # One thread does all the model work, loading included: torch's OpenMP pool belongs to
        # the thread that first uses it, and two pools on a small machine fight each other.
        try:
            loaded, engine = build(config)
        except REFUSALS as exc:  # a model Parrot says it cannot serve: the reason is the message
            log.error("model refused: %s", exc)
            state.load_error = str(exc)
            return
        except Exception as exc:  # reported by /health and every route, not a crash
            log.exception("model failed to load")
            state.load_error = str(exc)
            return
        observers = Observers(state.metrics, state.stats)
        scheduler = Scheduler(engine, config.server.max_running, config.server.max_queue, observers)
        state.loaded, state.engine, state.scheduler = loaded, engine, scheduler
        state.metrics.model_loaded.set(1)
        state.metrics.kv_capacity = config.server.max_running * engine.forward.max_positions
        state.metrics.watch_prefix_cache(engine.prefix_cache)
        state.metrics.watch_cost_curve(engine.policy)
        freeze_startup_heap()
        log.info("ready: serving %s", loaded.name)
        scheduler.run()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        share_one_heap()  # before the engine thread's first allocation: see memory.py
        thread = threading.Thread(target=load_and_run, name="parrot-engine", daemon=True)
        thread.start()
        yield
        if state.scheduler is not None:
            state.scheduler.stop()
            await asyncio.to_thread(thread.join, 10)
        gc.unfreeze()  # what start-up froze can be collected again once the app is gone (tests run many)

    app = FastAPI(title="Parrot", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server with exact n-gram speculative decoding")
    app.state.parrot = state
    install_error_handlers(app)

    from parrot.server.routes import dashboard, openai_api, responses, system, tasks, tokens

    app.include_router(system.router)
    app.include_router(openai_api.router)
    app.include_router(responses.router)
    app.include_router(tasks.router)
    app.include_router(tokens.router)
    app.include_router(dashboard.router)

    app.add_middleware(CountRequests, state=state)
    app.add_middleware(BodyLimit, limit=config.server.max_body_bytes)
    checker = KeyChecker(read_keys(config.server))
    if checker:  # before the body is read; after draining (a draining server says so first)
        app.add_middleware(RequireKey, checker=checker, protect_monitoring=config.server.protect_monitoring)
    app.add_middleware(Draining, state=state)
    if config.server.max_completion_tokens:
        cap = config.server.max_completion_tokens

        def openapi() -> dict[str, Any]:
            schema = FastAPI.openapi(app)  # built once, then cached on the app
            bound_completion_budgets(schema, cap)
            return schema

        app.openapi = openapi  # type: ignore[method-assign]
    return app


def bound_completion_budgets(schema: dict[str, Any], cap: int) -> None:
    """Give every completion budget field (``COMPLETION_BUDGET`` in ``parrot.server.schemas``) of an
    OpenAPI schema the ``maximum`` the server enforces, so that clients and fuzzers see it."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        for prop in component.get("properties", {}).values():
            if prop.get("x-completion-budget"):
                for branch in prop.get("anyOf", [prop]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = cap


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM (or a first Ctrl-C) instead of stopping.

    ``drain()`` sets the state draining: ``/health`` and every new request get 503 (the socket
    stays open, so clients and load balancers are told rather than refused), and the requests in
    flight run to the end. Once none is left, or after ``server.drain_timeout_s`` (the engine
    then stops and ends what still runs with an error: 503, or an error event in a stream), the
    server shuts down as uvicorn does and the process exits with status 0. A second signal
    stops at once, as uvicorn's own handling does.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None
        self._engine_closed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None and not self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            self.drain()
        else:
            super().handle_exit(sig, frame)

    def drain(self) -> None:
        # Runs in a signal handler: only flags here; on_tick does the rest on the event loop.
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.state.config.server.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if counter % 10 == 0:
                scheduler = self.state.scheduler
                log.info("draining: %d requests in flight (%d running in the engine)", self.state.in_flight,
                         scheduler.running if scheduler is not None else 0)
            if self.state.in_flight == 0:
                log.info("drained: no request in flight; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline and not self._engine_closed:
                log.warning("drain timeout: ending the %d requests still in flight", self.state.in_flight)
                if self.state.scheduler is not None:
                    self.state.scheduler.close()  # they fail with EngineStopped, and answer so
                self._engine_closed = True
                self.drain_deadline += self.config.timeout_graceful_shutdown or 5
            elif time.monotonic() >= self.drain_deadline:  # a request that waits on no engine
                self.should_exit = True  # uvicorn cancels it after timeout_graceful_shutdown
        return await super().on_tick(counter)


def serve(config: Config, builder: EngineBuilder | None = None) -> int:
    app = create_app(config, builder)
    host, port = config.server.host, config.server.port
    log.info("Parrot listening on http://%s:%d (model %s)", host, port, config.model.source)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5),
                            app.state.parrot)
    server.run()
    return 0
