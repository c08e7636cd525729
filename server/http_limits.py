"""Connection-level guards: who may send a body, how big it may be, how much of all bodies is held at
once, and how long a client may take to send one.

A server that waits for ever on a half-sent request can be held open by a hundred idle sockets, one
that parses any body size can be made to hold gigabytes, and one that reads bodies before checking
the API key lets anyone make it hold them. Every guard answers with OpenAI-style JSON (401, 413, 429,
408) before the application sees the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpilot.server.error_body import error_body


async def _send_error(send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """With an API key set, every path but the probes' and the metrics' needs `Authorization: Bearer
    <key>`, checked from the headers alone: a request without it is answered before its body is read."""

    PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.PUBLIC_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            # compare_digest: the time taken must not tell how much of a guessed key was right
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(send, 401, "missing or invalid API key (send Authorization: Bearer <key>)", "invalid_api_key")
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body up front, at most max_bytes within timeout seconds, then hands it to the app
    in one message (later receive() calls still report a disconnect). Bodies still arriving count
    against max_buffered_bytes over all connections; one that would go past it gets a 429."""

    def __init__(self, app, max_bytes: int, timeout: float, max_buffered_bytes: int):
        self.app, self.max_bytes, self.timeout, self.max_buffered_bytes = app, max_bytes, timeout, max_buffered_bytes
        self.buffered = 0  # bytes of bodies being received now (one event loop: no lock)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, too_large, "request_too_large")
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return await _send_error(send, 408, f"the request body was not received within {self.timeout:g} s", "request_timeout")
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return await _send_error(send, 413, too_large, "request_too_large")
                if self.buffered + len(chunk) > self.max_buffered_bytes:
                    return await _send_error(send, 429, f"the server holds {self.buffered} bytes of request bodies still arriving "
                                                        f"(limit {self.max_buffered_bytes}); retry later", "server_busy",
                                             [(b"retry-after", b"1")])
                self.buffered += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        finally:
            self.buffered -= sum(len(c) for c in chunks)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def protocol_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all
    arrived `seconds` after it opened or after its previous response (uvicorn itself would wait for
    ever on a connection that sends a partial request)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._close_if_no_request)

        def _close_if_no_request(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
