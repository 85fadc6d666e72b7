"""`VLLM_ENGINE_READY_TIMEOUT_S`: how long the server waits for its engine to start."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from sous.config.errors import ConfigError


class EngineStartTimeout(ConfigError):
    """The engine did not finish starting (loading weights, allocating the KV cache) within
    VLLM_ENGINE_READY_TIMEOUT_S seconds."""


class _Expired(BaseException):
    """Raised by the alarm inside the guarded block: a BaseException, so that no `except
    Exception` (or `except ValueError`) on the way swallows or rewraps it."""


@contextlib.contextmanager
def ready_deadline(seconds: float) -> Iterator[None]:
    """Raise EngineStartTimeout if the block runs past `seconds`.

    Uses SIGALRM, so it acts only in the main thread (elsewhere the block runs unbounded);
    the previous handler and timer are restored on exit."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def _expired(signum: int, frame: Any) -> None:
        raise _Expired

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise EngineStartTimeout(
            f"the engine did not start within VLLM_ENGINE_READY_TIMEOUT_S={seconds:g} s "
            "(raise it for large models)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
