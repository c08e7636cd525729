"""The FastAPI app (OpenAI routes, health, metrics, tokenize) and `kvpilot serve` with our own SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpilot.server import startup
from kvpilot.server.adapters import AdapterError
from kvpilot.server.api import errors
from kvpilot.server.api.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestTooLargeError, ServerShutdownError
from kvpilot.server.api.constraint_compiles import ConstraintCompiles
from kvpilot.server.api.errors import APIError, param_of
from kvpilot.server.api.metrics import EngineMetrics
from kvpilot.server.api.openai_serving import ClientDisconnected, OpenAIServing
from kvpilot.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    template_variables,
)
from kvpilot.server.api.responses import ResponsesRequest, ResponsesServing, ResponseStore
from kvpilot.server.api.tokenizer_pool import TokenizerPool
from kvpilot.server.config import EngineConfig, ServerConfig, generation_defaults, load_chat_template
from kvpilot.server.engine.limits import ModelNotFound, RequestRejected
from kvpilot.server.http_limits import ApiKeyMiddleware, BodyLimitMiddleware, protocol_with_header_timeout

log = logging.getLogger("kvpilot.server")
VERSION = "0.1.0"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    engine: AsyncEngine
    serving: OpenAIServing
    metrics: EngineMetrics
    config: ServerConfig
    draining: bool = False
    started: float = field(default_factory=time.time)


IGNORED_FIELDS_HEADER = "x-kvpilot-ignored-fields"
MAX_NAMED_IGNORED_FIELDS = 16  # a header stays small however many fields a body holds,
MAX_IGNORED_NAME_CHARS = 64    # and however long their names (each cut here, as encoded)


class EventStream(StreamingResponse):
    """Server-sent events whose engine requests are released however the response ends, even when
    the client left before the first byte (the body generator is then never started)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has closed the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_of(request: Request) -> str:
    """Whose a request is, for per-client bounds: its peer's address (behind a gateway, the gateway's)."""
    return request.client.host if request.client else "unknown"


def build_app(state: ServerState) -> FastAPI:
    # The schema and its UI are served by our own routes below, behind the API key when one is set.
    app = FastAPI(title="kvpilot", version=VERSION, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kv = state
    errors.install(app)
    config = state.config
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes, timeout=config.request_body_timeout_seconds,
                       max_buffered_bytes=config.max_buffered_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # added last = runs first: no body is read before the key is checked
    serving = state.serving

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, e: QueueFullError):
        state.metrics.queue_full.inc()
        return errors.error_response(429, f"server overloaded: {e}; retry later", code="queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return errors.error_response(503, str(e), code="engine_unavailable")

    @app.exception_handler(RequestTooLargeError)
    async def _too_large(request: Request, e: RequestTooLargeError):
        return errors.error_response(400, str(e), "n", "request_too_large")

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, e: RequestRejected):
        return errors.error_response(404 if isinstance(e, ModelNotFound) else 400, str(e), e.param, e.code)

    @app.exception_handler(ValueError)
    async def _value(request: Request, e: ValueError):
        return errors.error_response(400, str(e), param_of(e))

    async def accepting() -> None:
        if state.draining:
            raise APIError(503, "server is shutting down", code="draining", headers={"Connection": "close"})
        if not state.engine.alive:
            raise EngineDeadError("the engine is not running")

    def ignoring(req) -> dict[str, str]:
        """The request's fields this server does not know: refused (--reject-unknown-fields), or named in
        a response header and a log line, and ignored."""
        ignored = req.ignored_fields()
        if not ignored:
            return {}
        if state.config.reject_unknown_fields:
            raise APIError(400, f"unknown parameter '{ignored[0]}'", ignored[0], "unknown_parameter")
        named = ", ".join(name if len(name) <= MAX_IGNORED_NAME_CHARS else name[:MAX_IGNORED_NAME_CHARS] + "..."
                          for name in ignored[:MAX_NAMED_IGNORED_FIELDS])
        if len(ignored) > MAX_NAMED_IGNORED_FIELDS:
            named += f", (+{len(ignored) - MAX_NAMED_IGNORED_FIELDS} more)"
        log.warning("ignored request fields: %s", named)
        return {IGNORED_FIELDS_HEADER: named}

    def respond(result, headers: dict[str, str]):
        if isinstance(result, dict):
            return JSONResponse(result, headers=headers)
        response = EventStream(result.events, on_close=lambda: state.engine.release(result.job_ids))
        response.headers.update(headers)
        return response

    guarded = [Depends(accepting)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, request: Request):
        ignored = ignoring(req)
        adapter = serving.check_model(req.model)
        params = req.with_defaults(serving.generation_defaults).params()
        prompts = req.prompts()
        return respond(await serving.completions(prompts, params, req.stream, req.stream_options, lambda: wait_for_disconnect(request),
                                                 client_of(request), adapter, req.echo, req.prompt_only, req.prompt_logprobs is not None), ignored)

    async def answer_chat(req: ChatCompletionRequest, request: Request):
        adapter = serving.check_model(req.model)
        params = req.with_defaults(serving.generation_defaults).params(serving.tool_format)
        messages = [m.as_template_dict() for m in req.messages]
        variables = template_variables(req.chat_template_kwargs, req.reasoning_effort)
        return await serving.chat(messages, req.add_generation_prompt, params, req.stream, req.stream_options, req.top_logprobs or 0,
                                  lambda: wait_for_disconnect(request), client_of(request), req.tool_use(), adapter,
                                  variables=variables, include_reasoning=req.include_reasoning)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(req: ChatCompletionRequest, request: Request):
        ignored = ignoring(req)
        return respond(await answer_chat(req, request), ignored)

    # OpenAI's Responses API, over the chat path (api/responses.py)
    responses = ResponsesServing(serving, ResponseStore(config.responses_store_max_responses, config.responses_store_max_bytes,
                                                        config.responses_store_ttl_seconds))

    @app.post("/v1/responses", dependencies=guarded)
    async def create_response(req: ResponsesRequest, request: Request):
        ignored = ignoring(req)
        return respond(await responses.create(req, lambda chat_req: answer_chat(chat_req, request)), ignored)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    # vLLM's render endpoints: what a request becomes (its token ids, its resolved parameters), checked as the
    # request itself would be and not run; routers hash the ids (llm-d's precise prefix-cache scorer).
    @app.post("/v1/completions/render", dependencies=guarded)
    async def render_completions(req: CompletionRequest, request: Request):
        ignored = ignoring(req)
        adapter = serving.check_model(req.model)
        params = req.with_defaults(serving.generation_defaults).params()
        return JSONResponse(await serving.render_completions(req.prompts(), params, client_of(request), adapter, req.stream, req.stream_options),
                            headers=ignored)

    @app.post("/v1/chat/completions/render", dependencies=guarded)
    async def render_chat(req: ChatCompletionRequest, request: Request):
        ignored = ignoring(req)
        adapter = serving.check_model(req.model)
        params = req.with_defaults(serving.generation_defaults).params(serving.tool_format)
        messages = [m.as_template_dict() for m in req.messages]
        variables = template_variables(req.chat_template_kwargs, req.reasoning_effort)
        return JSONResponse(await serving.render_chat(messages, req.add_generation_prompt, params, client_of(request), req.tool_use(), adapter,
                                                      variables, req.stream, req.stream_options), headers=ignored)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvpilot API")

    @app.get("/v1/models")
    async def models():
        base = {"id": serving.model_name, "object": "model", "created": int(state.started), "owned_by": "kvpilot",
                "root": serving.model_name, "parent": None, "max_model_len": serving.max_model_len}
        adapters = [{**base, "id": a.name, "root": a.source, "parent": serving.model_name, "created": int(a.loaded_at)}
                    for a in state.engine.adapters()]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter", dependencies=guarded)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        runtime_lora()
        try:  # read and checked off the step loop; registered on it
            rank = await state.engine.load_adapter(req.lora_name, req.lora_path, config.lora_dir)
        except AdapterError as e:
            raise APIError(400, str(e), e.param, "invalid_adapter") from None
        log.info("LoRA adapter %r loaded (rank %d)", req.lora_name, rank)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        runtime_lora()
        try:
            await state.engine.unload_adapter(req.lora_name)
        except KeyError:
            raise APIError(404, f"no LoRA adapter named '{req.lora_name}' is loaded", "lora_name", "model_not_found") from None
        log.info("LoRA adapter %r unloaded", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def runtime_lora() -> None:
        if not state.engine.lora_enabled or not config.allow_runtime_lora:
            raise APIError(400, "run-time LoRA loading is off (the server needs --enable-lora, --allow-runtime-lora and --lora-dir)",
                           code="runtime_lora_disabled")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        """vLLM's: the prefix cache forgets every block (behind the API key, as every path but the probes'
        and the metrics'). Running requests never stop a reset here (they keep their blocks, unfindable),
        so reset_running_requests has nothing left to do and success is always true; reset_external: the
        KV tiers are emptied too."""
        forgotten = await state.engine.reset_prefix_cache(reset_external)
        log.info("prefix cache reset by request: %d blocks forgotten", forgotten)
        return {"success": True}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if req.prompt is not None and req.chat_template_kwargs is not None:
            raise APIError(400, "chat_template_kwargs: only with 'messages'", "chat_template_kwargs")
        messages = None if req.messages is None else [m.as_template_dict() for m in req.messages]
        return await serving.tokenize(req.prompt, messages, req.add_generation_prompt, template_variables(req.chat_template_kwargs),
                                      req.add_special_tokens, req.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        return await serving.detokenize(req.tokens)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    if state.config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            """vLLM's: what a client needs to tokenize as this server does (lm-eval's remote tokenizer)."""
            return serving.tokenizer_info()

    def engine_unavailable() -> Response | None:
        """The probes' answer when the engine cannot serve: its loop ended, or it made no progress for
        engine_stall_timeout_seconds with requests open (a hung step, a stopped core: every request
        would hang while the pod looked healthy; the liveness probe then restarts it)."""
        if not state.engine.alive:
            return errors.error_response(503, "engine loop is not running", code="engine_unavailable")
        stalled = state.engine.stalled_seconds()
        if stalled > state.config.engine_stall_timeout_seconds:
            return errors.error_response(503, f"the engine loop has made no progress for {stalled:.0f} s with requests open", code="engine_stalled")
        return None

    @app.get("/health")
    async def health():
        return engine_unavailable() or PlainTextResponse("ok")

    @app.get("/ready")
    async def ready():
        if state.draining:
            return errors.error_response(503, "draining", code="draining")
        return engine_unavailable() or PlainTextResponse("ready")

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if state.metrics.core is not None:  # the engine core's own families, read from its process now
            state.metrics.core.text = await state.engine.scrape()
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def create_state(engine_config: EngineConfig, server_config: ServerConfig, show_progress: bool = True) -> ServerState:
    if server_config.allow_runtime_lora and not engine_config.enable_lora:
        raise ValueError("allow_runtime_lora needs the engine's enable_lora")
    # Read before the engine starts: a bad file must stop start-up, not leave an engine core running.
    chat_template = load_chat_template(server_config.chat_template) if server_config.chat_template is not None else None
    defaults = {}
    if server_config.generation_config != "vllm":  # --generation-config: request defaults from a generation_config.json
        from kvpilot.server.model_files import engine_model_path

        try:
            model_path = str(engine_model_path(engine_config))
        except FileNotFoundError:  # no model there: the engine's load says so, in its own terms (the core's included)
            model_path = None
        defaults = generation_defaults(server_config.generation_config, model_path)
    if server_config.engine_core_process:
        from kvpilot.server.api.core_client import EngineCoreClient

        async_engine = EngineCoreClient.launch_core(engine_config, server_config.max_waiting_requests, server_config.log_level)
        tokenizer, name, limits, engine = async_engine.tokenizer, async_engine.served_model_name, async_engine.limits, None
    else:
        from kvpilot.server.engine.llm_engine import LLMEngine

        async_engine = AsyncEngine.launch(lambda: LLMEngine(engine_config, show_progress=show_progress), server_config.max_waiting_requests)
        engine = async_engine.engine
        tokenizer, name, limits = engine.tokenizer, engine.served_model_name, engine.limits
    metrics = EngineMetrics(engine, name, limits.max_model_len, pending=lambda: async_engine._pending)
    async_engine.on_step = lambda _engine, outputs, _dt: metrics.observe(outputs)
    pool = TokenizerPool(server_config.tokenizer_workers, server_config.max_pending_tokenizations)
    compiles = None if limits.grammars is None else \
        ConstraintCompiles(limits.grammars, pool, server_config.max_compiles_per_client, server_config.max_pending_compiles)
    if chat_template is not None:  # --chat-template: instead of the model's (before the tool format is read from it)
        tokenizer.chat_template = chat_template
    serving = OpenAIServing(async_engine, tokenizer, name, limits, pool, compiles, server_config.tool_call_parser, server_config.reasoning_parser)
    serving.generation_defaults = defaults
    return ServerState(async_engine, serving, metrics, server_config)


def run_server(ns) -> int:
    """`kvpilot serve`: load, serve until SIGTERM/SIGINT, drain, exit 0."""
    import uvicorn

    engine_config = EngineConfig(**{k: getattr(ns, k) for k in EngineConfig.model_fields if getattr(ns, k, None) is not None})
    server_values = {k: getattr(ns, k) for k in ServerConfig.model_fields if getattr(ns, k, None) is not None}
    server_values.setdefault("api_key", os.environ.get("KVPILOT_API_KEY") or None)
    server_config = ServerConfig(**server_values)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if server_config.host is None and server_config.bind_host == "0.0.0.0" and not server_config.api_key:
        log.warning("serving on every interface (in a Kubernetes pod, --host unset) with no --api-key: anyone who reaches the pod's IP "
                    "can send requests; give --host 127.0.0.1 or --api-key to restrict it")
    if not server_config.enable_log_requests:  # (--disable-log-requests) the per-request lines are openai_serving.RequestLog's
        logging.getLogger("kvpilot.requests").setLevel(logging.WARNING)
    if server_config.ssl_certfile is not None:  # a bad file is an error naming its flag now, not after the model loads
        load_tls(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), server_config)
    state = create_state(engine_config, server_config)
    app = build_app(state)
    config = uvicorn.Config(app, host=server_config.bind_host, port=server_config.port, log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False, lifespan="off",
                            http=protocol_with_header_timeout(server_config.request_header_timeout_seconds),
                            timeout_keep_alive=int(server_config.request_header_timeout_seconds),
                            ssl_certfile=server_config.ssl_certfile, ssl_keyfile=server_config.ssl_keyfile,
                            ssl_ca_certs=server_config.ssl_ca_certs, ssl_cert_reqs=server_config.ssl_cert_reqs)
    server = DrainingServer(config, state)
    server.run()
    state.engine.stop()
    state.serving.pool.shutdown()
    return 0


TLS_REFRESH_SECONDS = 1.0  # --enable-ssl-refresh: how often the files are looked at


def load_tls(context: ssl.SSLContext, config: ServerConfig) -> None:
    """Loads --ssl-certfile/--ssl-keyfile (and --ssl-ca-certs) into `context`; a file that is missing,
    unreadable or not what its flag names is a ValueError naming that flag (the CLI's exit 2)."""
    files = (("--ssl-certfile", config.ssl_certfile), ("--ssl-keyfile", config.ssl_keyfile), ("--ssl-ca-certs", config.ssl_ca_certs))
    for flag, path in files:
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path}: not readable")
    keyfile = config.ssl_keyfile or config.ssl_certfile

    def encrypted_key() -> str:  # called by OpenSSL only for an encrypted key (instead of prompting on a terminal)
        raise ValueError(f"--ssl-keyfile {keyfile}: the key is encrypted (give an unencrypted PEM key)")

    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, encrypted_key)
    except ssl.SSLError as e:
        try:  # which file: the certificate file holds a certificate, or it is the key
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=config.ssl_certfile)
        except ssl.SSLError:
            raise ValueError(f"--ssl-certfile {config.ssl_certfile}: not a PEM certificate ({e})") from None
        if config.ssl_keyfile is None:
            raise ValueError(f"--ssl-certfile {keyfile}: holds no PEM private key of its certificate (give --ssl-keyfile) ({e})") from None
        raise ValueError(f"--ssl-keyfile {keyfile}: not the PEM private key of --ssl-certfile's certificate ({e})") from None
    if config.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(cafile=config.ssl_ca_certs)
        except ssl.SSLError as e:
            raise ValueError(f"--ssl-ca-certs {config.ssl_ca_certs}: not PEM certificates ({e})") from None


async def refresh_tls(context: ssl.SSLContext, config: ServerConfig) -> None:
    """--enable-ssl-refresh: when the TLS files change (another inode, size or modification time; a
    Kubernetes Secret volume swaps a symlink), loads them into the server's own context, so new
    connections get the new certificate. A set that does not load (a rotation half written) is logged
    and tried again each time round; until it loads, the old certificate is served."""
    paths = [p for p in (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) if p is not None]

    def stamp() -> tuple:
        out = []
        for path in paths:
            try:
                st = os.stat(path)
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    loaded = reported = stamp()
    while True:
        await asyncio.sleep(TLS_REFRESH_SECONDS)
        now = stamp()
        if now == loaded:
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="kvpilot-tls-") as private:  # mkdtemp: mode 0700
                # One copy of the files, read once: what the scratch context accepted is what the server's loads
                # (the files read twice could change in between: a new certificate with the old key).
                copied = config.model_copy(update={name: shutil.copy(getattr(config, name), os.path.join(private, name))
                                                   for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs") if getattr(config, name)})
                load_tls(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), copied)  # a scratch context first: a bad set never reaches the server's
                load_tls(context, copied)
        except (ValueError, OSError) as e:  # OSError: a file gone between the look and the load
            if now != reported:
                log.warning("TLS files changed but do not load; still serving the previous certificate: %s", e)
                reported = now
            continue
        loaded = reported = now
        log.info("TLS certificate reloaded from %s", config.ssl_certfile)


class DrainingServer:
    """uvicorn, but SIGTERM/SIGINT first drains: /ready turns 503 and new requests get 503 at once,
    in-flight requests get up to shutdown_grace_seconds to finish, then the server exits.
    (uvicorn's own handler would stop accepting connections at once.)"""

    def __init__(self, config, state: ServerState):
        import uvicorn

        drain = self._drain_requested

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # called by uvicorn's signal capture
                drain(sig)

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:  # marked before the loop can answer a first request (/ready then implies it)
                    startup.mark("listening")

        self.state = state
        self.server = _Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._signals = 0

    def _drain_requested(self, sig) -> None:
        self._signals += 1
        if self._signals > 1:  # a second signal: stop now
            self.server.should_exit = True
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        serve = asyncio.create_task(self.server.serve())
        while not self.server.started and not serve.done():
            await asyncio.sleep(0.05)
        if self.server.started:
            sock = self.server.servers[0].sockets[0].getsockname() if self.server.servers else None
            host, port = (sock[0], sock[1]) if sock else (self.server.config.host, self.server.config.port)
            scheme = "https" if self.server.config.ssl is not None else "http"
            print(f"kvpilot: serving {self.state.serving.model_name} — ready at {scheme}://{host}:{port}", file=sys.stderr, flush=True)
        refresher = None
        if self.state.config.enable_ssl_refresh and self.server.started and self.server.config.ssl is not None:
            refresher = asyncio.create_task(refresh_tls(self.server.config.ssl, self.state.config))
        waiter = asyncio.create_task(self._stop.wait())
        await asyncio.wait({serve, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if self._stop.is_set() and not serve.done():
            self.state.draining = True
            grace = self.state.config.shutdown_grace_seconds
            log.info("shutdown requested: draining %d in-flight requests (grace %.0fs)", self.state.engine.num_in_flight(), grace)
            deadline = time.monotonic() + grace
            while self.state.engine.num_in_flight() and time.monotonic() < deadline and not self.server.should_exit:
                await asyncio.sleep(0.1)
            if self.state.engine.num_in_flight():  # grace is over: streams still open end with an error event and [DONE]
                log.warning("shutdown grace over: ending %d open requests", self.state.engine.num_in_flight())
                self.state.engine.close_all(ServerShutdownError("the server is shutting down and this request did not finish in time"))
                flush_deadline = time.monotonic() + 2
                while self.state.engine.num_in_flight() and time.monotonic() < flush_deadline:
                    await asyncio.sleep(0.05)
            self.server.should_exit = True
            await serve
        waiter.cancel()
        if refresher is not None:
            refresher.cancel()
