"""The OpenAI-compatible HTTP server (FastAPI): `build_app(engine, server_config)` and
`run_server(engine_config, server_config)`.

Endpoints: GET /health (200 empty; 503 when the engine is dead or the server is shutting
down), GET /version, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions; with VLLM_SERVER_DEV_MODE=1 (as vLLM) also
POST /reset_prefix_cache. Every error is OpenAI-shaped (`sous.server.errors`); request-body
problems are 400 (never FastAPI's 422), bodies over --max-request-body-bytes 413, and every
endpoint but /health, /metrics and /version answers 503 at once when the engine is dead or
the server drains (`sous.server.guard`). With an API key (ServerConfig.api_key or env
VLLM_API_KEY) every /v1 path needs `Authorization: Bearer <key>` (as vLLM: only /v1).
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import sous
from sous.config.server import ServerConfig
from sous.server.errors import APIError, error_body, format_validation_error
from sous.server.guard import RequestGuard
from sous.server.metrics import ServerMetrics
from sous.server.serving_chat import ChatServing
from sous.server.serving_common import ServingContext
from sous.server.serving_completion import CompletionServing

logger = logging.getLogger("sous.server")


class APIKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <key>` (OPTIONS is let through)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and scope.get("path", "").startswith("/v1")):
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body("Unauthorized", 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(format_validation_error(list(exc.errors())), 400),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}",
                                       500), status_code=500)


def _model_card(engine: Any) -> dict:
    created = int(time.time())
    return {
        "id": engine.served_model_name, "object": "model", "created": created,
        "owned_by": "sous", "root": engine.served_model_name, "parent": None,
        "max_model_len": engine.max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}],
    }


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine
    completions = CompletionServing(ctx)
    chat = ChatServing(ctx)

    @app.get("/health")
    async def health() -> Response:
        ok = engine.is_healthy() and not ctx.state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": sous.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = engine.get_engine_stats()
        except Exception:  # a dead engine still gets its counters scraped
            stats = None
        return Response(ctx.metrics.render(stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    if dev_mode_enabled():
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            if not await engine.reset_prefix_cache():
                raise APIError("Cannot reset the prefix cache while requests hold KV blocks; "
                               "retry when the server is idle.", status=409,
                               err_type="ConflictError")
            return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(engine)]}

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.handle(request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.handle(request)


def build_app(engine: Any, server_config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncLLM` or anything with its interface)."""
    config = server_config or ServerConfig()
    app = FastAPI(title="sous OpenAI-compatible server", version=sous.__version__)
    metrics = ServerMetrics(engine.served_model_name, engine.max_model_len,
                            getattr(engine, "cache_info", None))
    ctx = ServingContext(engine=engine, config=config, metrics=metrics)
    app.state.serving = ctx
    core = getattr(engine, "core", None)
    if config.reasoning_parser and core is not None:
        connect_reasoning_to_structured_output(core, config.reasoning_parser)
    _install_error_handlers(app)
    _add_routes(app, ctx)
    api_key = config.api_key or os.environ.get("VLLM_API_KEY")
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestGuard, state=ctx.state, engine=engine,
                       max_body_bytes=config.max_request_body_bytes)
    # vLLM's defaults (--allowed-origins/methods/headers '*'); added last, so it runs first
    # and CORS preflights never need the API key.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                       allow_headers=["*"], allow_credentials=False)
    return app


def connect_reasoning_to_structured_output(core: Any, reasoning_parser: str) -> None:
    """With `--reasoning-parser`, `core`'s structured output starts only once reasoning has
    ended (every engine core that serves requests, data parallel ranks included)."""
    from sous.server import reasoning
    from sous.server.reasoning.token_end import reasoning_end_detector

    parser = reasoning.get(reasoning_parser)
    core.structured_output_manager.set_reasoner(reasoning_end_detector(parser, core.tokenizer))


def dev_mode_enabled() -> bool:
    """VLLM_SERVER_DEV_MODE=1: expose the endpoints that change engine state for development
    (/reset_prefix_cache), as vLLM does."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")


def run_server(engine_config: Any, server_config: ServerConfig | None = None) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, then shut down gracefully: new requests
    get 503, those in flight may finish for `--shutdown-timeout` seconds, the rest are
    aborted with a last event; a second signal exits at once. Returns the exit status: 0
    after a signal, 1 when the engine died. An engine that does not start within
    `engine_ready_timeout_s` (VLLM_ENGINE_READY_TIMEOUT_S) raises EngineStartTimeout.

    The engine's step loop runs on the main thread and uvicorn on a background thread."""
    from sous.engine.core import freeze_startup_heap
    from sous.engine.ready import ready_deadline
    from sous.server.handle import ServerHandle

    config = server_config or ServerConfig()
    logger.info("Loading engine ...")
    with ready_deadline(engine_config.engine_ready_timeout_s):
        engine = _make_engine(engine_config, config)
    freeze_startup_heap()
    handle = ServerHandle(engine, config, host=config.host, port=config.port)
    on_signal = _OnSignal(lambda: handle.begin_drain(config.shutdown_timeout))
    # Installed explicitly: a background job's SIGINT may arrive ignored (SIG_IGN) otherwise.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    forced = False
    try:
        handle.start()
        if not handle.drain_requested:
            logger.info("Serving model %r (max_model_len=%d) on http://%s:%d",
                        engine.served_model_name, engine.max_model_len, handle.host, handle.port)
        engine.run_engine_loop()  # returns at once when a signal's drain has stopped it
    except KeyboardInterrupt:
        forced = on_signal.count > 1
    finally:
        logger.info("Shutting down%s.", " at once (second signal)" if forced else "")
        handle.stop(force=forced or on_signal.count == 0)
        engine.shutdown()
    return 1 if engine.died else 0


def _make_engine(engine_config: Any, config: ServerConfig) -> Any:
    """`AsyncLLM` on one engine core here, or `DPAsyncLLM` over --data-parallel-size ranks
    (unless --data-parallel-rank makes this server one rank behind an external balancer;
    with --enable-expert-parallel such a rank steps in lockstep with the other servers')."""
    par = engine_config.parallel
    if par.data_parallel_size > 1 and par.data_parallel_rank is None:
        from sous.engine.dp.client import DPAsyncLLM

        return DPAsyncLLM(engine_config, config.reasoning_parser)
    from sous.engine.async_llm import AsyncLLM

    if not par.expert_parallel_active:
        return AsyncLLM.from_config(engine_config, start_thread=False)
    from sous.engine.dp.lockstep import join_external_ep_group

    step_sync = join_external_ep_group(engine_config)  # before loading: experts are placed
    engine = AsyncLLM.from_config(engine_config, start_thread=False)
    engine.core.step_sync = step_sync
    return engine


class _OnSignal:
    """SIGINT/SIGTERM handler (main thread): the first starts the drain on the server's
    event loop (only `call_soon_threadsafe`, safe inside a signal handler); a second one,
    or one before the server runs, raises KeyboardInterrupt to stop at once."""

    def __init__(self, begin_drain: Any) -> None:
        self.begin_drain = begin_drain
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1 or not self.begin_drain():
            raise KeyboardInterrupt
