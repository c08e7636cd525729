"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} (no web framework: the gateway uses them too)."""

from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable_error"}


def _printable(text: str | None) -> str | None:
    """Messages echo client input, which may hold lone surrogates: written as escapes, the body stays encodable."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # OpenAI answers an unknown model or response with a 404 of type invalid_request_error (code model_not_found, response_not_found).
    kind = "invalid_request_error" if code in ("model_not_found", "response_not_found") else _TYPES.get(status, "server_error")
    return {"error": {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}}
