"""Every error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.tokenizer import UnsupportedTokenizer

log = logging.getLogger("parrot.http")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


_TYPE_MISMATCH = ("literal_error", "is_instance_of", "union_tag_invalid")


def _field_path(error: Any) -> tuple[Any, ...]:
    """An error's location without the union members pydantic reports as path parts (e.g. 'str',
    'list[int]')."""
    return tuple(p for p in error.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool"))))


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic problem, said plainly, with the parameter it concerns."""
    return validation_error_of(exc.errors())


def validation_error_of(errors: Sequence[Any]) -> APIError:
    """``validation_error`` of pydantic's error list (of a request or of a model built from one)."""
    if not errors:
        return APIError(400, "invalid request")
    # A value no member of a union takes has an error per member, the first one's first
    # ('messages[0].content': "Input should be a valid string", for a list of content parts):
    # the deepest error under the same field that is not just another member's type says what is
    # wrong ('messages[0].content[1].type').
    first = errors[0]
    loc = _field_path(first)
    for error in errors[1:]:
        deeper = _field_path(error)
        if (len(deeper) > len(loc) and deeper[: len(loc)] == loc and error.get("type") not in _TYPE_MISMATCH
                and not str(error.get("type", "")).endswith("_type")):
            first, loc = error, deeper
    kind = first.get("type", "")
    param = _param_of(loc)
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    if kind == "missing" and param is None:
        return APIError(400, "the request body is missing; send a JSON object", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(
            400, f"unrecognized request argument supplied: {param}", param=param, code="unsupported_parameter"
        )
    if kind == "missing":
        return APIError(400, f"'{param}' is a required property", param=param, code="missing_required_parameter")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param is None:
        return APIError(400, f"invalid request body: {message}", code="invalid_type")
    return APIError(400, f"invalid value for '{param}': {message}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(UnsupportedTokenizer)
    async def _unsupported_tokenizer(_: Request, exc: UnsupportedTokenizer) -> JSONResponse:
        # Raised where a route first uses the tokenizer's exact budget (/v1/tokenize, /v1/tokens/*,
        # /v1/summarize's max_input_tokens); the other endpoints never build one.
        message = f"this endpoint is not available for the served model's tokenizer ({exc})"
        return APIError(501, message, code="unsupported_tokenizer").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such endpoint; see GET /v1/models and the README for the API"
        elif exc.status_code == 405:
            message = "method not allowed for this endpoint"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal server error ({type(exc).__name__})").response()
