"""The live dashboard: ``GET /dashboard`` (one self-contained page) and ``GET /v1/stats`` (its data).

``GET /v1/stats`` answers with windowed aggregates from ``parrot/server/stats.py``; it works while the
model is still loading (the numbers are zero then). Fields, times in seconds, rates per second:

- ``status``: ``loading``, ``ok`` or ``error``; ``model``: the served model's name or null.
- ``time``: Unix time of the snapshot; ``uptime_s``; ``window_s`` (300) and ``bucket_s`` (5).
- ``current``: ``waiting`` (queued requests) and ``running`` (being generated) right now.
- ``window``: aggregates over the last ``window_s`` seconds (``span_s``, shorter right after
  start-up): ``requests`` (finished, by ``ok`` / ``cancelled`` / ``error``), ``request_rate``,
  ``admitted``, ``output_tokens``, ``output_tokens_per_s``, ``forward_passes``,
  ``drafted_tokens``, ``accepted_tokens``, ``forced_tokens``, ``accepted_per_pass`` (accepted
  draft tokens per forward pass), ``tokens_per_pass`` (output tokens per forward pass, the mean
  acceptance length), ``acceptance_rate`` (accepted / drafted), ``ttft_s``, ``itl_s`` and
  ``e2e_s`` (each ``{"p50", "p99", "count"}``; null percentiles when there is no sample),
  ``max_waiting``, ``max_running``, ``prefix_cache_queried_tokens`` (prompt tokens of
  requests that looked the prefix cache up, counted at their first token),
  ``prefix_cache_hit_tokens`` (of which found there) and ``prefix_cache_hit_rate`` (their ratio,
  null without queries).
- ``series``: one point per bucket, oldest first: ``t`` (bucket start, Unix time),
  ``request_rate``, ``errors``, ``output_tokens_per_s``, ``ttft_p50`` / ``ttft_p99``,
  ``itl_p50`` / ``itl_p99``, ``e2e_p50`` / ``e2e_p99``, ``accepted_per_pass``,
  ``tokens_per_pass``, ``drafted_tokens``, ``accepted_tokens``, ``forced_tokens``, and the
  largest ``waiting`` and ``running`` seen in the bucket, ``prefix_cache_hit_rate``.

A "request" is one generated sequence: a completion with ``n=3`` counts three.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter()

_PAGE = Path(__file__).resolve().parent.parent / "static" / "dashboard.html"


@lru_cache(maxsize=1)
def _page() -> str:
    return _PAGE.read_text(encoding="utf-8")


@router.get("/v1/stats")
async def stats(request: Request) -> dict[str, Any]:
    """Windowed serving statistics (the dashboard's data); see the module docstring for fields."""
    state = request.app.state.parrot
    status = state.status
    model = state.loaded.name if state.loaded is not None else None
    return {"status": status, "model": model, **state.stats.snapshot()}


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live dashboard: a static page that polls ``/v1/stats`` and draws on canvas."""
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})
