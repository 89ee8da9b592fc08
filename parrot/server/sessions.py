"""Cross-request drafting: earlier requests' prompts and outputs as drafting context for the next.

An agent sends a file, gets an edit back, then asks for a second edit of the same file in a new
request: the n-gram drafter can copy the second answer from the first, if it may see it. With
``server.session_drafting`` on, a request that opts in (``"speculation": {"session": true}``)
gets its tenant's recent texts as drafting context (indexed by the drafter, never fed to the
model, so outputs do not change), and its own prompt and output join them when it ends.

Tenants: the request's API key (a hash of the bearer token; the key itself is not kept) and its
``user`` field together, so that one key's clients cannot name another key's users; a request
with neither has no session. A tenant only ever drafts from its own texts (acceptance rates, and
so timings, would otherwise tell one tenant about another's text). Memory is bounded: at most ``session_tokens`` tokens per tenant (the oldest texts go
first) and ``session_tenants`` tenants (the least recently used goes first).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict

from fastapi import Request

TokenId = int


class SessionStore:
    """Recent token texts per tenant, bounded per tenant and in tenants (LRU). Thread-safe."""

    def __init__(self, max_tenants: int, max_tokens: int) -> None:
        self.max_tenants = max_tenants
        self.max_tokens = max_tokens
        self._texts: OrderedDict[str, list[array[int]]] = OrderedDict()  # tenant -> texts, oldest first
        self._lock = threading.Lock()

    def context(self, tenant: str) -> list[list[TokenId]]:
        """The tenant's texts, oldest first (the drafter prefers the most recent match)."""
        with self._lock:
            texts = self._texts.get(tenant)
            if texts is None:
                return []
            self._texts.move_to_end(tenant)
            return [list(t) for t in texts]

    def add(self, tenant: str, tokens: list[TokenId]) -> None:
        """Remember ``tokens`` for the tenant (its last ``max_tokens`` if longer)."""
        if not tokens or self.max_tokens <= 0:
            return
        text = array("i", tokens[-self.max_tokens :])
        with self._lock:
            texts = self._texts.setdefault(tenant, [])
            self._texts.move_to_end(tenant)
            texts.append(text)
            total = sum(len(t) for t in texts)
            while total > self.max_tokens:
                total -= len(texts.pop(0))
            while len(self._texts) > self.max_tenants:
                self._texts.popitem(last=False)

    def tokens(self) -> int:
        """Tokens held, over all tenants."""
        with self._lock:
            return sum(len(t) for texts in self._texts.values() for t in texts)


def tenant_of(http: Request, user: str | None) -> str | None:
    """The tenant a request drafts as: its API key's hash and its ``user``; None with neither."""
    return tenant_key(http.headers.get("authorization", ""), user)


def tenant_key(authorization: str, user: str | None) -> str | None:
    """``tenant_of`` from the ``Authorization`` header's value (the Ray gateway routes by it)."""
    scheme, _, key = authorization.partition(" ")
    key_hash = hashlib.sha256(key.strip().encode()).hexdigest() if scheme.lower() == "bearer" and key.strip() else ""
    if not key_hash and not user:
        return None
    return f"{key_hash}/{user or ''}"
