"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.server.error_body import error_body

_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|.*\[.*\])$")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    return f"data: {json.dumps(error_body(status, message, param, code))}\n\n"


def status_of(error: BaseException) -> int:
    """The HTTP status that an exception raised while serving a request stands for."""
    from kvpilot.server.api.async_engine import EngineDeadError, QueueFullError, ServerShutdownError

    if isinstance(error, APIError):
        return error.status
    if isinstance(error, QueueFullError):
        return 429
    if isinstance(error, (EngineDeadError, ServerShutdownError)):
        return 503
    if isinstance(error, ValueError):
        return 400
    return 500  # RequestFailedError and anything unforeseen: the server's failure


def param_of(error: ValueError) -> str | None:
    """Our ValueErrors start with the offending field's name (SamplingParams.validate)."""
    param = getattr(error, "param", None)
    if param:
        return param
    first = str(error).split(" ", 1)[0].rstrip(":")
    return first if first.isidentifier() else None


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        # pydantic adds union-branch tags (`str`, `list[int]`, …) to locations: they are not field names
        loc = [str(x) for x in first.get("loc", []) if x != "body" and not _TYPE_TAG.match(str(x))]
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), None, "invalid_json")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown parameter '{'.'.join(loc)}'", ".".join(loc) or None, "unknown_parameter")
        parts = [f"{'.'.join(str(x) for x in err.get('loc', []) if x != 'body') or 'body'}: {err.get('msg')}" for err in errs[:5]]
        return error_response(400, "; ".join(parts), ".".join(loc) or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # Anything not mapped above is our bug, not the client's: logged with its trace, answered as JSON.
        logging.getLogger("kvpilot.server").exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(e).__name__}); the server logged the details", code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, message, headers=getattr(e, "headers", None))
