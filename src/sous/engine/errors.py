"""The engine's request-level exceptions (light: the server imports them without torch)."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request the engine cannot serve as asked (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # keeps `param` across processes (data parallel ranks)
        return type(self), (str(self), self.param)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or the server is shutting down): the server
    answers 503."""
