"""Health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """503 while the model loads (or if it failed to), 200 once requests can be served."""
    state = request.app.state.parrot
    if state.load_error is not None:
        return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    if not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok", "model": state.loaded.name})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = request.app.state.parrot.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
