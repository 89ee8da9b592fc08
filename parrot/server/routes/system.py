"""Health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while requests can be served, with the model and what its backend says about it
    (``Backend.describe``: kernel set, weight format); 503 while the model loads, after it failed
    to load or the engine stopped (with the reason), and while the server drains before exiting."""
    state = request.app.state.parrot
    status = state.status
    if status == "error":
        return JSONResponse({"status": status, "error": state.error}, status_code=503)
    if status == "loading":
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "5"})
    if status == "draining":
        return JSONResponse({"status": status}, status_code=503)
    loaded = state.loaded
    return JSONResponse({"status": status, "model": loaded.name, "backend": {"name": loaded.backend, **loaded.details}})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = request.app.state.parrot.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
