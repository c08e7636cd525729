"""`kvpilot-gateway` (or `python -m kvpilot.operator.gateway`): the prefix-aware OpenAI proxy in
front of the InferenceServices' engine pods."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from kvpilot.operator.gateway.proxy import GatewayConfig
    from kvpilot.operator.gateway.routing import PREFIX_CHARS
    from kvpilot.server.config import parse_size

    ap = argparse.ArgumentParser(prog="kvpilot-gateway")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--namespace", action="append", default=[], help="route to InferenceServices of these namespaces only (repeatable); default: all")
    ap.add_argument("--prefix-chars", type=int, default=PREFIX_CHARS, help="prompt characters that decide the route")
    ap.add_argument("--max-request-body", default="4MiB", help="largest request body (then 413)")
    ap.add_argument("--max-buffered-request-bytes", default="64MiB",
                    help="most bytes of request bodies held at once over all connections while they arrive; then 429 with Retry-After")
    ap.add_argument("--request-header-timeout-seconds", type=float, default=10.0,
                    help="a connection that has not sent a whole request line and headers in this time is closed")
    ap.add_argument("--request-body-timeout-seconds", type=float, default=30.0, help="a request body not received in full in this time gets 408")
    ap.add_argument("--read-timeout-seconds", type=float, default=600.0, help="longest wait for an engine's next bytes")
    ap.add_argument("--hold-timeout-seconds", type=float, default=300.0,
                    help="longest a request waits for a ready pod of a model that has none (scaled to zero, starting); then 503")
    ap.add_argument("--max-held-requests", type=int, default=1000, help="requests that may wait for pods at once; more: 503 at once")
    ap.add_argument("--log-level", default=os.environ.get("KVPILOT_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        config = GatewayConfig(max_body_bytes=parse_size(args.max_request_body), max_buffered_request_bytes=parse_size(args.max_buffered_request_bytes),
                               request_header_timeout_seconds=args.request_header_timeout_seconds,
                               request_body_timeout_seconds=args.request_body_timeout_seconds, read_timeout_seconds=args.read_timeout_seconds,
                               prefix_chars=args.prefix_chars, hold_timeout_seconds=args.hold_timeout_seconds,
                               max_held_requests=args.max_held_requests)
    except ValueError as e:
        ap.error(str(e))

    import uvicorn

    from kvpilot.operator.gateway.discovery import KubeEndpoints
    from kvpilot.operator.gateway.proxy import build_app, uvicorn_settings

    source = KubeEndpoints(args.namespace)
    uvicorn.run(build_app(source, config), host=args.host, port=args.port, log_level=args.log_level.lower(), **uvicorn_settings(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
