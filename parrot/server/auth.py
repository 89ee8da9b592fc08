"""API keys: with keys configured, every ``/v1/...`` request must send one as ``Authorization:
Bearer KEY``, or it gets a 401 in OpenAI's error shape.

Keys come from ``server.api_key`` (``--api-key``, ``PARROT_API_KEY`` or
``PARROT_SERVER_API_KEY``) and ``server.api_key_file`` (``--api-key-file``: one key per line,
blank lines and ``#`` comments ignored). Only their SHA-256 digests are kept, and a presented
key's digest is compared with every one of them by ``hmac.compare_digest``, with no early exit,
so the time taken says nothing about how much of a key matched, nor which key. As vLLM does,
the keys guard ``/v1/...`` (the API, the token endpoints, ``/v1/stats``); ``/health``,
``/metrics``, the OpenAPI page and the dashboard's page (which holds no data: it reads
``/v1/stats`` with the key given after ``#key=`` in its address) stay open unless
``server.protect_monitoring`` is on, which puts ``/health`` and ``/metrics`` behind the keys too.

With keys on, a request's tenant (session drafting, prefix cache scopes: ``parrot/server/sessions.py``)
is a key the server verified, so no client can claim another's cached prefixes by sending its
header.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from parrot.config import ServerConfig
from parrot.server.errors import APIError

MONITORING = ("/health", "/metrics")


def read_keys(config: ServerConfig) -> list[str]:
    """The configured keys; ValueError for a key file that cannot be read or holds none."""
    keys = [config.api_key] if config.api_key else []
    if config.api_key_file:
        path = Path(config.api_key_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"server.api_key_file: cannot read {path}: {exc}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"server.api_key_file: {path} holds no key")
        keys += found
    return keys


class KeyChecker:
    """Verifies presented keys against the configured ones' digests in constant time."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def verify(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode()).digest()
        matched = False
        for known in self._digests:  # every digest, whatever matched before it
            matched |= hmac.compare_digest(known, digest)
        return matched


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" and key.strip() else ""
    return None


class RequireKey:
    """ASGI middleware: 401 for a guarded path without a valid key (module docstring)."""

    def __init__(self, app: ASGIApp, checker: KeyChecker, protect_monitoring: bool) -> None:
        self.app = app
        self.checker = checker
        self.protect_monitoring = protect_monitoring

    def guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.protect_monitoring and path in MONITORING)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.guarded(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        key = _bearer(scope)
        if key is None or key == "":
            refused = APIError(401, "You didn't provide an API key. Provide it in an Authorization header using "
                               "Bearer auth (Authorization: Bearer YOUR_KEY).", type="invalid_request_error",
                               code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif not self.checker.verify(key):
            refused = APIError(401, "Incorrect API key provided.", type="invalid_request_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        else:
            await self.app(scope, receive, send)
            return
        await refused.response()(scope, receive, send)
