"""The gateway's HTTP side: OpenAI routes proxied to the engine pod `routing.choose` picks.

Before a request reaches the proxy, the engine's own connection guards (kvpilot.server.http_limits)
bound what a client can hold open: a connection whose request line and headers have not all arrived
within the header timeout is closed; a body must arrive whole within the body timeout (else 408), be
at most max_body_bytes (else 413), and fit, with the other bodies still arriving, under
max_buffered_request_bytes (else 429 with Retry-After). The gateway checks no API key, so these bounds
are all that keeps anyone's half-sent requests from holding its sockets and memory.

Bodies are parsed once, to find the model and the routing key (not JSON, or nested too deep to parse:
400), then forwarded as they came, less any kv_transfer_params: those tell a decode engine which pod to
pull KV blocks from, so only the gateway's own prefill sets them. Responses are streamed back chunk by
chunk as the engine sends them (SSE included, no buffering). A pod that refuses the connection, cannot
be reached, or answers 503 (draining, dead: it did no work) is skipped and the next one on the ring
tried; once a response has started nothing is retried (the engine may have produced tokens). The
Authorization header passes through untouched: the engines check the API key. Cookies pass neither
way: a client's Cookie header is not forwarded, and the HTTP client shared by all clients' requests
keeps no cookie an engine sets (it would send it on everyone's later requests).

A model served disaggregated (prefill pods beside its decode pods) has each request prefilled first:
the body as it came with max_tokens 1, not streamed, and kv_transfer_params.do_remote_decode goes to a
prefill pod (prefix affinity on the prefill pods' ring); the kv_transfer_params it answers are added
to the original body, which goes to a decode pod and is streamed back from there. A prefill that fails
(no prefill pod answers, or an engine error) costs time only: the decode pod computes the prompt; a
client error (4xx) is the answer.

A request for a model with no ready pod (scaled to zero, or every pod starting) is held — a bounded
number of them, for a bounded time — while the source asks for a pod (`wake`), then forwarded as soon
as one is Ready; past the bound or the time, 503 with Retry-After.

The Responses API: a stored response lives in the memory of the engine pod that made it, and its id
names that pod (server/response_ids.py). A request that continues one (previous_response_id), and GET
or DELETE /v1/responses/{id}, go to that pod; when it is gone the answer is a 404 that names the id,
never another pod's (and a scaled-to-zero model is not woken for it: a new pod would not hold it). An
id that names no pod (not a kvpilot engine's with POD_IP set) is continued by prefix affinity, and its
GET or DELETE is a 404: the client's API key is never sent to pods that may not hold the response. A new response is routed by
prefix affinity as a chat request is (its instructions and input); it is not split into prefill and
decode (the Responses API carries no kv_transfer_params).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Protocol

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpilot.operator.gateway.routing import PREFIX_CHARS, HashRing, choose, prefix_key
from kvpilot.server.error_body import error_body
from kvpilot.server.http_limits import BodyLimitMiddleware, protocol_with_header_timeout
from kvpilot.server.response_ids import id_pod_tag, pod_tag

log = logging.getLogger("kvpilot.gateway")
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", "cache-control")
NESTED_TOO_DEEP = "the request body is nested too deeply"


class EndpointSource(Protocol):
    def endpoints(self, model: str) -> list[str] | None:
        """The ready pods ("ip:port") serving `model`; [] when it exists but none is ready; None when unknown."""

    def models(self) -> list[str]: ...

    def prefill_endpoints(self, model: str) -> list[str]:
        """The ready prefill pods of a disaggregated model ([] when it is served by one pool)."""

    def wake(self, model: str) -> None:
        """`model` has no ready pod and a request waits: ask for one if it is scaled to zero (may block)."""


@dataclass
class StaticEndpoints:
    """A model -> endpoints map held in memory (tests, and a gateway pointed at known addresses)."""

    table: dict[str, list[str]]
    prefill: dict[str, list[str]] = field(default_factory=dict)
    woken: list[str] = field(default_factory=list)  # models a held request asked to wake

    def endpoints(self, model: str) -> list[str] | None:
        return list(self.table[model]) if model in self.table else None

    def prefill_endpoints(self, model: str) -> list[str]:
        return list(self.prefill.get(model, []))

    def models(self) -> list[str]:
        return sorted(self.table)

    def wake(self, model: str) -> None:
        self.woken.append(model)


@dataclass(frozen=True)
class GatewayConfig:
    max_body_bytes: int = 4 << 20
    max_buffered_request_bytes: int = 64 << 20   # bodies still arriving, all connections together; past it 429
    request_header_timeout_seconds: float = 10.0  # a connection without a whole request line and headers by then is closed
    request_body_timeout_seconds: float = 30.0    # a body not received whole by then gets 408
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 600.0
    max_attempts: int = 3           # pods tried for one request before 502 (only connection failures are retried)
    prefix_chars: int = PREFIX_CHARS
    retry_after_seconds: int = 5    # told to clients when a model has no ready pod
    hold_timeout_seconds: float = 300.0  # longest a request waits for a pod of a model that has none ready
    max_held_requests: int = 1000        # more waiting than this: 503 at once

    def __post_init__(self):
        if self.max_buffered_request_bytes < self.max_body_bytes:
            # else every body between the two sizes would get 429 "retry later" for ever
            raise ValueError("max_buffered_request_bytes must be >= max_body_bytes (one largest body must fit)")


def error(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status, headers=dict(headers or {}))


def response_not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(404, f"no response with id {response_id!r} can be found through this gateway: the engine pod that "
                                        "stored it is gone, or the id names no kvpilot engine pod it routes to", param, "response_not_found"),
                        status_code=404)


def holder(response_id: str, endpoints: list[str]) -> list[str] | None:
    """The endpoints that may hold a stored response: the pod its id names (none if gone); None: the id
    names no pod (not a kvpilot engine's with POD_IP set)."""
    tag = id_pod_tag(response_id)
    if tag is None:
        return None
    return [e for e in endpoints if pod_tag(e.rsplit(":", 1)[0].strip("[]")) == tag]


def model_not_found(model: str) -> JSONResponse:
    """As OpenAI (and the engines) answer an unknown model or adapter."""
    return JSONResponse({"error": {"message": f"the model '{model}' does not exist", "type": "invalid_request_error", "param": "model",
                                   "code": "model_not_found"}}, status_code=404)


class GatewayMetrics:
    """kvpilot_gateway_* series, in their own registry (served at /metrics)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.requests = Counter("kvpilot_gateway_requests", "Requests answered, by model and HTTP status.", ["model", "code"], registry=self.registry)
        self.routed = Counter("kvpilot_gateway_routed_requests", "Requests sent to an engine pod; decision: affinity (the key's own pod), "
                              "spill (the key's pod was over the load bound), retry (an earlier pod refused the connection).",
                              ["model", "endpoint", "decision"], registry=self.registry)
        self.in_flight = Gauge("kvpilot_gateway_in_flight_requests", "Requests being proxied, by engine pod.", ["model", "endpoint"],
                               registry=self.registry)
        self.held = Gauge("kvpilot_gateway_held_requests", "Requests waiting for a ready pod (scale from zero, cold start); "
                          "present, at 0, for every model the gateway knows.", ["model"], registry=self.registry)
        from prometheus_client import Histogram

        self.hold_seconds = Histogram("kvpilot_gateway_hold_seconds", "How long held requests waited for a ready pod (served ones).", ["model"],
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry)
        self.prefills = Counter("kvpilot_gateway_prefill_requests", "Requests of disaggregated models prefilled first; outcome: handed_off (a "
                                "decode pod got the prefill's kv_transfer_params), failed (the decode pod computed the prompt).",
                                ["model", "outcome"], registry=self.registry)
        self.cold_first_token = Histogram("kvpilot_gateway_cold_start_first_token_seconds", "Held requests (no ready pod when they came: "
                                          "scale from zero, cold start): arrival to the first byte of the engine's answer.", ["model"],
                                          buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry)


class Gateway:
    def __init__(self, source: EndpointSource, config: GatewayConfig = GatewayConfig()):
        self.source, self.config = source, config
        self.in_flight: Counter[str] = Counter()  # endpoint -> requests being proxied to it
        self.held = 0                             # requests waiting for a ready pod, all models
        self.metrics = GatewayMetrics()
        self._rings: dict[tuple[str, ...], HashRing] = {}
        # One client carries every client's requests: a cookie an engine set would go out with all later
        # ones, so its jar refuses every cookie (no domain is allowed).
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.read_timeout_seconds, connect=config.connect_timeout_seconds),
                                        cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))

    def ring(self, endpoints: list[str]) -> HashRing:
        key = tuple(sorted(endpoints))
        if key not in self._rings:
            if len(self._rings) > 256:
                self._rings.clear()
            self._rings[key] = HashRing(key)
        return self._rings[key]

    async def proxy(self, request: Request) -> Response:
        raw = await request.body()  # whole, size- and time-bounded: BodyLimitMiddleware read it
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        except RecursionError:
            return error(400, NESTED_TOO_DEEP, "invalid_request_error")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return error(400, "the request body must be a JSON object with a 'model' string", "invalid_request_error")
        if "kv_transfer_params" in body:
            # A client's would have a decode engine pull KV blocks from wherever it names. The engines
            # parse bodies with the same json module, so the key they would find is the one removed here.
            del body["kv_transfer_params"]
            raw = json.dumps(body).encode()
        model = body["model"]
        try:
            response = await self._route(request, raw, body, model)
        except RecursionError:
            # Parsed above, but encoded again for the engines (a prefill's body, a decode's with the
            # prefill's kv_transfer_params) in deeper frames, where the same nesting can pass the limit.
            response = error(400, NESTED_TOO_DEEP, "invalid_request_error")
        self.metrics.requests.labels(model if self.source.endpoints(model) is not None else "unknown", str(response.status_code)).inc()
        return response

    async def _hold(self, request: Request, model: str) -> list[str] | Response:
        """Wait for a ready pod of `model` (asking the source to wake it); its endpoints, or the error to answer."""
        unavailable = {"Retry-After": str(self.config.retry_after_seconds)}
        if self.held >= self.config.max_held_requests:
            return error(503, f"the model '{model}' has no ready replica and {self.held} requests already wait for one", "service_unavailable", unavailable)
        self.held += 1
        self.metrics.held.labels(model).inc()
        start = time.monotonic()
        try:
            while True:
                await asyncio.to_thread(self.source.wake, model)
                for _ in range(10):
                    await asyncio.sleep(0.1)
                    endpoints = self.source.endpoints(model)
                    if endpoints is None:
                        return model_not_found(model)
                    if endpoints:
                        self.metrics.hold_seconds.labels(model).observe(time.monotonic() - start)
                        return endpoints
                if time.monotonic() - start >= self.config.hold_timeout_seconds:
                    return error(503, f"no replica of '{model}' became ready within {self.config.hold_timeout_seconds:g}s", "service_unavailable", unavailable)
                if await request.is_disconnected():
                    return error(499, "the client went away while waiting for a replica", "client_closed_request")
        finally:
            self.held -= 1
            self.metrics.held.labels(model).dec()

    async def _route(self, request: Request, raw: bytes, body: dict, model: str) -> Response:
        endpoints = self.source.endpoints(model)
        if endpoints is None:
            return model_not_found(model)
        previous = body.get("previous_response_id") if request.url.path.endswith("/responses") else None
        if isinstance(previous, str) and id_pod_tag(previous) is not None and not holder(previous, endpoints):
            return response_not_found(previous, "previous_response_id")  # its pod is gone: a pod woken now would not hold it either
        held_since = None
        if not endpoints:
            held_since = time.monotonic()
            held = await self._hold(request, model)
            if isinstance(held, Response):
                return held
            endpoints = held
        key = prefix_key(request.url.path, body, self.config.prefix_chars)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        responses = request.url.path.endswith("/responses")
        held = holder(previous, endpoints) if isinstance(previous, str) else None
        if held:  # the continuation goes to the pod that stored the response it continues (an untagged id: by prefix)
            endpoints = held
        prefill = self.source.prefill_endpoints(model)
        if prefill and body.get("n", 1) == 1 and not responses:
            handed = await self._prefill(request, body, key, prefill, headers, model)
            if isinstance(handed, Response):
                return handed
            if handed is not None:
                raw = json.dumps({**body, "kv_transfer_params": handed}).encode()
        left = list(endpoints)
        for attempt in range(min(self.config.max_attempts, len(endpoints))):
            ring = self.ring(left)
            endpoint = choose(ring, key, self.in_flight)
            decision = "retry" if attempt else "affinity" if endpoint == next(ring.candidates(key)) else "spill"
            self.in_flight[endpoint] += 1
            try:
                upstream = await self.client.send(self.client.build_request(request.method, f"http://{endpoint}{request.url.path}",
                                                                            content=raw, headers=headers), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self.in_flight[endpoint] -= 1
                left.remove(endpoint)  # gone between the watch and now: the next pod on the ring
                continue
            except httpx.HTTPError as e:
                self.in_flight[endpoint] -= 1
                return error(502, f"the engine pod failed before answering ({type(e).__name__})", "bad_gateway")
            if upstream.status_code == 503 and attempt + 1 < min(self.config.max_attempts, len(endpoints)):
                # A draining or dead engine refuses new work with 503 before doing any: nothing was
                # generated, so the next pod on the ring gets the request.
                await upstream.aclose()
                self.in_flight[endpoint] -= 1
                left.remove(endpoint)
                continue
            self.metrics.routed.labels(model, endpoint, decision).inc()
            self.metrics.in_flight.labels(model, endpoint).inc()
            return StreamingResponse(self._relay(upstream, model, endpoint, held_since), status_code=upstream.status_code,
                                     headers={**{k: v for k, v in upstream.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS},
                                              "x-kvpilot-endpoint": endpoint})
        return error(502, f"no ready replica of '{model}' accepted the connection", "bad_gateway", {"Retry-After": str(self.config.retry_after_seconds)})

    async def _prefill(self, request: Request, body: dict, key: str, endpoints: list[str], headers: dict, model: str) -> dict | Response | None:
        """Run the request's prefill on a prefill pod: the kv_transfer_params its answer carries, the
        answer itself when it is the client's error, or None (the decode pod computes the prompt)."""
        limit = {"max_completion_tokens": 1} if "max_completion_tokens" in body else {"max_tokens": 1}
        prefill_body = {k: v for k, v in body.items() if k != "stream_options"} | limit | {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        left, why = list(endpoints), "no prefill pod"
        for _ in range(min(self.config.max_attempts, len(endpoints))):
            endpoint = choose(self.ring(left), key, self.in_flight)
            left.remove(endpoint)
            self.in_flight[endpoint] += 1
            try:
                answer = await self.client.post(f"http://{endpoint}{request.url.path}", json=prefill_body, headers=headers)
            except httpx.HTTPError as e:
                why = f"{endpoint}: {type(e).__name__}"
                continue
            finally:
                self.in_flight[endpoint] -= 1
            if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):  # the request's fault: the decode pod would say so too
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
            try:
                handed = answer.json().get("kv_transfer_params") if answer.status_code == 200 else None
            except ValueError:
                handed = None
            if isinstance(handed, dict):
                self.metrics.prefills.labels(model, "handed_off").inc()
                return handed
            why = f"{endpoint}: HTTP {answer.status_code}"
        self.metrics.prefills.labels(model, "failed").inc()
        log.warning("prefill of a %s request failed (%s): the decode pod computes its prompt", model, why)
        return None

    async def stored_response(self, request: Request) -> Response:
        """GET or DELETE /v1/responses/{id}: forwarded to the pod the id names, and to no other (a client's
        API key goes only where its response is); an id that names no pod here is a 404."""
        response_id = request.path_params["response_id"]
        every = sorted({e for model in self.source.models() for e in self.source.endpoints(model) or ()})
        candidates = holder(response_id, every)
        if not candidates:
            return response_not_found(response_id)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        try:
            answer = await self.client.request(request.method, f"http://{candidates[0]}{request.url.path}", headers=headers)
        except httpx.HTTPError as e:
            return error(502, f"the engine pod holding {response_id!r} failed to answer ({type(e).__name__})", "bad_gateway")
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    async def _relay(self, upstream: httpx.Response, model: str, endpoint: str, held_since: float | None = None):
        try:
            async for chunk in upstream.aiter_raw():
                if held_since is not None:
                    self.metrics.cold_first_token.labels(model).observe(time.monotonic() - held_since)
                    held_since = None
                yield chunk
        finally:
            await upstream.aclose()
            self.in_flight[endpoint] -= 1
            self.metrics.in_flight.labels(model, endpoint).dec()

    async def prometheus(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for model in self.source.models():
            self.metrics.held.labels(model)  # 0 when nothing waits: "no traffic" must read as 0, not as absent
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvpilot"} for m in self.source.models()]})

    async def health(self, request: Request) -> Response:
        return Response("ok", media_type="text/plain")


def build_app(source: EndpointSource, config: GatewayConfig = GatewayConfig()) -> Starlette:
    """The gateway's ASGI app; serve it with `uvicorn_settings` (the header timeout is uvicorn's part)."""
    gateway = Gateway(source, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await gateway.client.aclose()

    app = Starlette(routes=[Route("/v1/completions", gateway.proxy, methods=["POST"]),
                            Route("/v1/chat/completions", gateway.proxy, methods=["POST"]),
                            Route("/v1/responses", gateway.proxy, methods=["POST"]),
                            Route("/v1/responses/{response_id}", gateway.stored_response, methods=["GET", "DELETE"]),
                            Route("/v1/models", gateway.models, methods=["GET"]),
                            Route("/health", gateway.health, methods=["GET"]),
                            Route("/metrics", gateway.prometheus, methods=["GET"])],
                    middleware=[Middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.request_body_timeout_seconds,
                                           max_buffered_bytes=config.max_buffered_request_bytes)],
                    lifespan=lifespan)
    app.state.gateway = gateway
    return app


def uvicorn_settings(config: GatewayConfig) -> dict:
    """uvicorn's settings for serving the gateway, beyond the address: a connection whose request line
    and headers do not arrive within the header timeout is closed, and so is one kept alive idle as long."""
    return {"http": protocol_with_header_timeout(config.request_header_timeout_seconds),
            "timeout_keep_alive": int(config.request_header_timeout_seconds), "access_log": False}
