"""`ServerHandle`: run the OpenAI server in a background thread (tests, benchmarks, notebooks).

    with ServerHandle(engine) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")

The engine is not owned by the handle: the caller shuts it down (`begin_drain` stops its
step loop once the drain is over).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from sous.config.server import ServerConfig
from sous.engine.cpu_threads import unpin_current_thread
from sous.server.api_server import build_app
from sous.server.guard import drain

logger = logging.getLogger("sous.server")


class _Server(uvicorn.Server):
    """uvicorn's server, remembering its event loop (for `ServerHandle.begin_drain`)."""

    loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)


class ServerHandle:
    """uvicorn serving `build_app(engine, server_config)` on a thread, on a free port."""

    def __init__(self, engine: Any, server_config: ServerConfig | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.config = server_config or ServerConfig(host=host, port=port,
                                                    uvicorn_log_level="warning")
        self.app = build_app(engine, self.config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = _Server(uvicorn.Config(
            self.app, log_level=self.config.uvicorn_log_level, timeout_keep_alive=5,
            timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None
        self._drain_task: asyncio.Future | None = None
        self.drain_requested = False
        """Set by `begin_drain`: the server was asked to stop, so its thread ending during
        `start` is not a start-up failure."""

    def _serve(self) -> None:
        # A thread started by the engine's CPU-pinned thread inherits its one CPU: the front end
        # runs on the CPUs the OpenMP binding leaves free (all of them when it uses them all).
        unpin_current_thread()
        self._server.run(sockets=[self._sock])

    @property
    def url(self) -> str:
        """`http://host:port` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI client's base URL: `http://host:port/v1`."""
        return self.url + "/v1"

    def start(self, timeout: float = 60.0) -> ServerHandle:
        """Start serving; returns once /health would answer 200, or once the server has stopped
        after `begin_drain` (a signal during start-up). Raises RuntimeError if the server
        thread exits otherwise, TimeoutError if it is not healthy within `timeout`."""
        self._thread = threading.Thread(target=self._serve, name="sous-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                if self.drain_requested:
                    return self
                raise RuntimeError("The server thread exited during start-up.")
            # uvicorn sets `started` once it listens; then /health is the engine's health
            if self._server.started and self.engine.is_healthy():
                return self
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"The server did not become healthy within {timeout:.0f}s.")

    def begin_drain(self, timeout: float) -> bool:
        """Start a graceful shutdown (`sous.server.guard.drain`) on the server's loop; when
        it is over, stop the engine's step loop and the server. Returns False if the server
        is not running. Safe to call from a signal handler (only `call_soon_threadsafe`)."""
        loop = self._server.loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(self._start_drain, timeout)
        except RuntimeError:  # the loop closed meanwhile
            return False
        self.drain_requested = True
        return True

    def _start_drain(self, timeout: float) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        try:
            await drain(self.engine, self.app.state.serving.state, timeout)
        except Exception:
            logger.exception("Graceful shutdown failed; stopping now")
        finally:
            stop = getattr(self.engine, "stop", None)
            if stop is not None:
                stop()
            self._server.should_exit = True

    def stop(self, timeout: float = 10.0, force: bool = False) -> None:
        """Stop serving and join the thread (`force`: without waiting for open responses)."""
        self._server.should_exit = True
        if force:
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
