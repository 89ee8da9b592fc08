"""Parrot on Ray Serve: N replicas of the server, each with its own engine, behind one gateway.

``parrot serve --ray --replicas N`` (or ``serve run parrot.server.ray_app:build replicas=N``) deploys an
application of two deployments:

- ``ParrotReplica``: Parrot's FastAPI app (``create_app``, unchanged: routes, limits, draining,
  metrics) with its engine, one per replica. Requests reach it as ASGI calls in its own process;
  its responses stream back chunk by chunk. Ray restarts a replica whose engine stopped
  (``check_health``).
- ``ParrotGateway``: the HTTP ingress (``serve.ingress``). It reads the request body, picks the
  request's affinity key and hands the request to a replica through a handle whose
  ``session_id`` is that key. The replicas' router is Ray's consistent-hash router: a key always
  maps to the same replica while the set of replicas stays the same, and to the next one on the
  ring when its own is full (``max_ongoing_requests``) or gone.

The affinity key (``affinity_key``): the request's tenant, its API key and ``user`` as session
drafting (``parrot/server/sessions.py``) names it, so that one agent's requests reach the replica that
holds its session texts; else a hash of the first ``PREFIX_CHARS`` characters of the prompt
(prefix affinity: requests that share a system prompt or document land together); else none,
and the request goes to any replica.

Replica failures: a request whose replica dies before its answer began is sent once more (it
lands on another replica once Ray has noticed; the answer then says ``x-parrot-resent: 1``), then
gets a 503 in OpenAI's shape with ``Retry-After``; a stream whose replica dies mid-way ends with an error event and ``[DONE]``, as
Parrot's own streams do when a step fails. Every response says which replica answered
(``x-parrot-replica``).

Autoscaling: with ``max_replicas`` above ``replicas``, Ray Serve scales between them on the
requests each replica has in hand, running or queued in its engine: the target is
``server.max_running`` per replica, so replicas are added once requests queue.

Nothing else in Parrot imports this module: a single-machine ``parrot serve`` never imports Ray.
"""

# No ``from __future__ import annotations``: FastAPI must see ``Request`` itself in the gateway's
# route signature, which Ray Serve rewrites for its class-based view.
import asyncio
import hashlib
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from parrot.config import Config, load_config
from parrot.server.errors import APIError
from parrot.server.sessions import tenant_key

log = logging.getLogger("parrot.ray")

PREFIX_CHARS = 256  # prompt characters hashed for prefix affinity
REPLICA_HEADER = "x-parrot-replica"
RESENT_HEADER = "x-parrot-resent"
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
# Hop-by-hop or recomputed headers a forwarded response does not copy.
_DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def affinity_key(headers: dict[str, str], body: bytes) -> str:
    """The key requests are routed by: ``tenant:<hash>``, ``prefix:<hash>`` or "" (none)."""
    try:
        payload = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        payload = None
    payload = payload if isinstance(payload, dict) else {}
    user = payload.get("user") if isinstance(payload.get("user"), str) else None
    tenant = tenant_key(headers.get("authorization", ""), user)
    if tenant is not None:
        return "tenant:" + hashlib.sha256(tenant.encode()).hexdigest()[:32]
    prefix = _prompt_text(payload)[:PREFIX_CHARS]
    if prefix:
        return "prefix:" + hashlib.sha256(prefix.encode()).hexdigest()[:32]
    return ""


def _prompt_text(payload: dict[str, Any]) -> str:
    """The start of a request's prompt, as far as the body says it: instructions, messages'
    texts, the prompt, or the Responses API's input."""
    parts: list[str] = []

    def add(value: Any) -> None:
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    add(item.get("content", item.get("text")))
                elif isinstance(item, (str, list)):
                    add(item)
                elif isinstance(item, int):  # token ids
                    parts.append(f"{item},")

    for field in ("instructions", "messages", "prompt", "input"):
        add(payload.get(field))
        if sum(map(len, parts)) >= PREFIX_CHARS:
            break
    return "".join(parts)


class ParrotReplica:
    """One Parrot server (app and engine) in a Ray Serve replica, called by ``ParrotGateway``."""

    async def __init__(self, config: Config) -> None:
        from parrot.server.app import create_app

        self.app = create_app(config)
        self.state = self.app.state.parrot
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread, which loads the model
        while self.state.status == "loading":
            await asyncio.sleep(0.1)
        if self.state.status == "error":
            raise RuntimeError(self.state.error)
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id if context is not None else "local"
        log.info("replica %s ready: %s", self.name, self.state.loaded.name)

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose check raises: the model's engine has stopped."""
        if self.state.status == "error":
            raise RuntimeError(self.state.error)

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[Any]:
        """Run one HTTP request through the app: yields the response's status and headers (a
        dict), then its body chunks (bytes). Cancelled (the gateway's client left), it tells the
        app the client disconnected, which frees the request's KV cache."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("parrot", 80)}
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                                                    for k, v in message.get("headers", [])],
                           "replica": self.name}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            else:
                task.result()  # the app raised before answering: the gateway says 500
        finally:
            disconnected.set()


_DONE = b"data: [DONE]\n\n"  # how every Parrot stream ends


def _is_event_stream(headers: list[tuple[str, str]]) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)


def _response_headers(start: dict[str, Any], attempt: int) -> dict[str, str]:
    headers = {k: v for k, v in start["headers"] if k.lower() not in _DROPPED_HEADERS}
    headers[REPLICA_HEADER] = start["replica"]
    if attempt > 1:  # resent after its first replica was lost
        headers[RESENT_HEADER] = str(attempt - 1)
    return headers


async def _relay(stream: Any, first: bytes) -> AsyncIterator[bytes]:
    """A streamed answer's chunks; a replica lost mid-stream ends it with an error event. A replica
    lost after its stream's ``[DONE]`` (the app had sent it all but the call had not returned yet)
    has answered in full: nothing is added after the ``[DONE]``."""
    tail = b""  # the stream's last bytes, to see whether it ended
    try:
        if first:
            tail = first[-len(_DONE):]
            yield first
        async for chunk in stream:
            tail = (tail + chunk)[-len(_DONE):]
            yield chunk
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayTaskError) as exc:
        if tail == _DONE:
            log.info("replica lost after its stream ended: %s", type(exc).__name__)
            return
        log.warning("replica lost mid-stream: %s", type(exc).__name__)
        error = APIError(503, "the replica serving this stream stopped; retry", code="replica_unavailable")
        yield f"data: {json.dumps(error.body())}\n\n".encode() + _DONE
    finally:
        stream.cancel()


# The gateway's own app: one catch-all route (the replicas' apps answer 404 and 405 themselves,
# and serve /docs and /openapi.json). serve.ingress pickles the class as it decorates it, so what
# its methods call is defined above.
_gateway_app = FastAPI(title="Parrot on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(_gateway_app)
class ParrotGateway:
    """The HTTP ingress: routes each request to a replica by its affinity key, streams the answer."""

    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int) -> None:
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes

    @_gateway_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                            include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers = {k.lower(): v for k, v in request.headers.items()}
        key = affinity_key(headers, body)
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):  # an application under a route prefix: the app's own path
            path = path[len(root):] or "/"
        args = (request.method, path, request.url.query.encode(), request.headers.raw, body)
        for attempt in (1, 2):
            stream = self.replicas.options(stream=True, session_id=key).forward.remote(*args)
            try:
                start = await stream.__anext__()
                if _is_event_stream(start["headers"]):
                    first = await anext(stream, b"")
                    return StreamingResponse(_relay(stream, first), status_code=start["status"],
                                             headers=_response_headers(start, attempt))
                content = b"".join([chunk async for chunk in stream])
                return Response(content, status_code=start["status"], headers=_response_headers(start, attempt))
            except ray.exceptions.RayTaskError:  # forward itself raised: a bug
                log.exception("a replica failed to answer %s %s", request.method, request.url.path)
                return APIError(500, "internal error in the replica").response()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                stream.cancel()
                log.warning("replica lost before answering (attempt %d): %s", attempt, type(exc).__name__)
            except BaseException:  # the client left (Ray cancels the request): cancel the replica's
                stream.cancel()
                raise
        return APIError(503, "the replica serving this request stopped; retry", code="replica_unavailable",
                        headers={"Retry-After": "1"}).response()

    async def _body(self, request: Request) -> bytes | Response:
        """The request body, or a 413 past ``server.max_body_bytes`` (as the server says it)."""
        too_large = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return too_large.response()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return too_large.response()
            chunks.append(chunk)
        return b"".join(chunks)


def build_app(config: Config, replicas: int = 1, max_replicas: int | None = None,
              num_cpus: float = 0.0) -> serve.Application:
    """The application: ``replicas`` Parrot replicas (autoscaled up to ``max_replicas``) behind
    one gateway. ``num_cpus``: CPUs Ray reserves per replica (0: none, so that replicas sharing a
    small machine all start; the engine's threads are ``model.threads``)."""
    if replicas < 1 or (max_replicas is not None and max_replicas < replicas):
        raise ValueError("need 1 <= replicas <= max_replicas")
    options: dict[str, Any] = {
        # Requests a replica takes before the router tries the next one on the ring: its running
        # slots and as many waiting, so a busy session's overflow spills instead of queueing.
        "max_ongoing_requests": 2 * config.server.max_running,
        "request_router_config": RequestRouterConfig(request_router_class=CONSISTENT_HASH_ROUTER),
        "ray_actor_options": {"num_cpus": num_cpus},
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": config.server.drain_timeout_s,
    }
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": config.server.max_running}
    else:
        options["num_replicas"] = replicas
    replica = serve.deployment(name="ParrotReplica", **options)(ParrotReplica).bind(config)
    gateway = serve.deployment(name="ParrotGateway", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1000)(ParrotGateway)
    return gateway.bind(replica, config.server.max_body_bytes)


def build(args: dict[str, Any]) -> serve.Application:
    """``serve run parrot.server.ray_app:build replicas=2 max_replicas=4 model=embedded threads=1``
    (or a Serve config's ``import_path`` and ``args``): keys ``config`` (a TOML file),
    ``model``, ``threads``, ``replicas``, ``max_replicas``."""
    model: dict[str, Any] = {}
    if args.get("model"):
        model["source"] = str(args["model"])
    if args.get("threads") is not None:
        model["threads"] = int(args["threads"])
    config = load_config(args.get("config"), overrides={"model": model})
    max_replicas = args.get("max_replicas")
    # On a cluster each replica reserves the CPUs its engine uses, so Ray places replicas by
    # cores and asks for worker nodes when they run out.
    num_cpus = float(args.get("num_cpus", config.model.threads))
    return build_app(config, int(args.get("replicas", 1)), int(max_replicas) if max_replicas is not None else None,
                     num_cpus=num_cpus)


def run(config: Config, replicas: int, max_replicas: int | None) -> int:
    """``parrot serve --ray``: a local Ray instance (or the cluster ``RAY_ADDRESS`` names), the
    application on ``server.host:server.port``, until Ctrl-C or SIGTERM; then Ray Serve stops the
    replicas gracefully (each waits for its requests in flight) and the local Ray instance ends."""
    if config.model.threads == 0:  # replicas on this machine share its cores
        threads = max(1, (os.cpu_count() or 1) // replicas)
        config = _with_threads(config, threads)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    log.info("Parrot on Ray Serve: %d replica(s)%s on http://%s:%d", replicas,
             f" (autoscaled up to {max_replicas})" if max_replicas else "", config.server.host, config.server.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.run(build_app(config, replicas, max_replicas), name="parrot", route_prefix="/")
        while not stop.wait(1):
            pass
        log.info("stopping: the replicas finish what they are answering (at most server.drain_timeout_s)")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _with_threads(config: Config, threads: int) -> Config:
    import dataclasses

    return dataclasses.replace(config, model=dataclasses.replace(config.model, threads=threads))
