"""Domain errors and their one mapping to OpenAI-style HTTP error bodies."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("wire.errors")


class APIError(Exception):
    """An error a client caused (or may retry): status, OpenAI error type, param, code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_headers(err: APIError) -> dict[str, str]:
    """The error's own headers, plus ``x-should-retry: false`` on deterministic client
    errors (every 4xx but 408, 409 and 429)."""
    headers = dict(err.headers)
    if 400 <= err.status < 500 and err.status not in (408, 409, 429):
        headers.setdefault("x-should-retry", "false")
    return headers


def too_large(limit: int) -> APIError:
    """The 413 for a request body over ``limit`` bytes."""
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=error_headers(err))


def invalid(errors: list) -> APIError:
    """A 400 naming the first of pydantic's validation ``errors`` (``exc.errors()``)."""
    message, param = _validation_message(errors)
    return APIError(400, message, param=param)


def _validation_message(errors: list) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(invalid(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal error", type="server_error"))
