"""What stands between a connection and the handlers: the body-size limit, refusing work
while the server drains or the engine is dead, in-flight accounting, and the drain itself.

`ServerState` is shared by the middleware, the routes and `drain`; all of them run on the
server's event loop, so it needs no lock.

Drain (graceful shutdown, vLLM's `--shutdown-timeout` semantics): new work is refused (503),
requests in flight may finish for up to `timeout` seconds, then every one still running is
aborted with a proper last event (finish_reason "abort", then `data: [DONE]` for streams).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sous.server.errors import APIError

logger = logging.getLogger("sous.server")

UNGUARDED_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
"""Answered whatever the state (probes and scrapes); not counted as work."""
_AFTER_ABORT_WAIT_S = 10.0


class RequestTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than the server's limit of {limit} "
                         "bytes (--max-request-body-bytes).", 413)


@dataclass
class ServerState:
    """Server-wide state for the guard: draining, and the requests in flight."""

    draining: bool = False
    in_flight: int = 0
    _idle: asyncio.Event | None = field(default=None, repr=False)

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        self.in_flight += 1
        self._event().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._event().wait(), timeout)
        except TimeoutError:
            return False
        return True


class RequestGuard:
    """ASGI middleware. For every path but `UNGUARDED_PATHS`: 503 while draining or when the
    engine is dead; counts the request in flight until its response is complete. For every
    request: a body over `max_body_bytes` is a 413, by its Content-Length before anything is
    read, or as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, state: ServerState, engine: Any,
                 max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.engine = engine
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self._refusal(scope)
        if problem is not None:
            await JSONResponse(problem.body(), status_code=problem.status)(scope, receive, send)
            return
        receive = self._limited(receive)
        if scope.get("path", "") in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()

    def _refusal(self, scope: Scope) -> APIError | None:
        for name, value in scope.get("headers") or []:
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_body_bytes
                except ValueError:
                    return APIError("Invalid Content-Length header.", 400)
                if too_large:
                    return RequestTooLarge(self.max_body_bytes)
        if scope.get("path", "") in UNGUARDED_PATHS:
            return None
        if self.state.draining:
            return APIError("The server is shutting down.", 503)
        dead = getattr(self.engine, "dead_reason", None)
        if dead is not None:
            return APIError(dead, 503)
        return None

    def _limited(self, receive: Receive) -> Receive:
        limit = self.max_body_bytes
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit)
            return message

        return limited


async def drain(engine: Any, state: ServerState, timeout: float) -> None:
    """Refuse new work, let requests in flight finish for up to `timeout` seconds, then abort
    the rest (each gets its final event) and wait for their responses to complete."""
    state.draining = True
    logger.info("Shutting down: %d requests in flight; waiting up to %gs for them to finish "
                "(--shutdown-timeout).", state.in_flight, timeout)
    if await state.wait_idle(timeout):
        return
    engine.close_to_new("The server is shutting down.")
    aborted = await engine.abort_all()
    logger.info("Shutting down: aborted %d requests still running after %gs.", aborted, timeout)
    if not await state.wait_idle(_AFTER_ABORT_WAIT_S):
        logger.warning("Shutting down: %d responses still open after the abort.",
                       state.in_flight)
