"""`sous route`: an OpenAI-compatible front that routes each request over model servers with
an llm-d router config.

    sous route --config router-values.yaml \
        --endpoint prefill=http://127.0.0.1:8100 --endpoint decode=http://127.0.0.1:8200 ...

Endpoints: POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models
(from a healthy endpoint), GET /health (200 while an endpoint is healthy), GET /metrics (the
router's own, `sous.router.metrics`). Config and flag problems exit 2 naming them.

Public API: `main`, `build_app`, `make_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sous.router.config import RouterConfig, load_router_config
from sous.router.framework import Endpoint
from sous.router.metrics import RouterMetrics
from sous.router.plugins.registry import RouterConfigError
from sous.router.pool import EndpointPool, parse_endpoint
from sous.router.prompt import PromptTokenizer, load_prompt_tokenizer
from sous.router.proxy import Proxy
from sous.server.errors import error_body

__all__ = ["build_app", "main", "make_parser"]

logger = logging.getLogger("sous.router")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sous route", description=(
        "Route OpenAI traffic over sous/vLLM servers as the llm-d router does, from its "
        "config file (helm values or EndpointPickerConfig), including P/D disaggregation."))
    p.add_argument("--config", required=True, metavar="FILE",
                   help="llm-d router config (e.g. the recipe's router-values.yaml)")
    p.add_argument("--endpoint", action="append", required=True, metavar="[ROLE=]URL",
                   help="a model server and its llm-d.ai/role label (prefill, decode, both, "
                   "...); repeat for each. Without ROLE it is unlabelled (decode-capable). "
                   "A URL without a port stands for one endpoint per inference_pool.target_ports.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="GGUF file or model folder whose tokenizer and chat template the "
                   "prefix index uses (default: the bundled model)")
    p.add_argument("--refresh-metrics-interval", type=float, default=0.1, metavar="SECONDS",
                   help="how often each endpoint's /health and /metrics are scraped")
    return p


def build_app(config: RouterConfig, endpoints: Sequence[Endpoint], tokenizer: PromptTokenizer,
              interval: float = 0.1) -> FastAPI:
    metrics = RouterMetrics()
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits,
                                     trust_env=False) as client:
            pool = EndpointPool(endpoints, client, interval)
            await pool.scrape_all()
            pool.start()
            state["pool"] = pool
            state["proxy"] = Proxy(config, pool, tokenizer, metrics, client)
            try:
                yield
            finally:
                await pool.stop()

    app = FastAPI(title="sous route", lifespan=lifespan)

    async def forward(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(error_body(f"Request body is not valid JSON: {e}", 400),
                                status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("Request body must be a JSON object", 400),
                                status_code=400)
        headers = {k.lower(): v for k, v in request.headers.items()}
        return await state["proxy"].handle(path, body, headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        pool: EndpointPool = state["pool"]
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for endpoint in pool.healthy():
            with contextlib.suppress(httpx.HTTPError):
                r = await pool.client.get(endpoint.url + "/v1/models", headers=auth)
                return Response(r.content, r.status_code,
                                media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("No healthy endpoint", 503), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state["pool"].healthy() else 503)

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(metrics.render(state["pool"].endpoints),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def main(argv: Sequence[str]) -> int:
    """`sous route`; returns the exit status (2 for flag and config errors)."""
    args = make_parser().parse_args(list(argv))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        config = load_router_config(args.config)
        endpoints = [e for text in args.endpoint
                     for e in parse_endpoint(text, config.target_ports)]
        if len({e.url for e in endpoints}) != len(endpoints):
            raise RouterConfigError("--endpoint: the same URL is given twice")
        if args.refresh_metrics_interval <= 0:
            raise RouterConfigError("--refresh-metrics-interval must be > 0")
        tokenizer = load_prompt_tokenizer(args.tokenizer)
    except (RouterConfigError, FileNotFoundError) as e:
        print(f"sous route: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    for e in endpoints:
        logger.info("endpoint %s role=%s", e.url, e.role or "(none)")
    logger.info("profiles %s, failure mode %s", list(config.profiles), config.failure_mode)
    services = [p for p in config.plugins.values() if callable(getattr(p, "start", None))]
    try:
        for plugin in services:  # e.g. a KV-events subscriber binding its port
            plugin.start()
        app = build_app(config, endpoints, tokenizer, args.refresh_metrics_interval)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except RuntimeError as e:
        print(f"sous route: error: {e}", file=sys.stderr)
        return 2
    finally:
        for plugin in services:
            plugin.close()
    return 0
