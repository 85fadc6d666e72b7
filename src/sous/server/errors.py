"""OpenAI-shaped errors, as vLLM's OpenAI server sends them.

Body: `{"error": {"message": str, "type": str, "param": str | None, "code": int}}` where `type`
is vLLM's error class name (`BadRequestError`, `NotFoundError`, `InternalServerError`, ...)
and `code` the HTTP status.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type_for(status: int) -> str:
    """vLLM's `type` string for an HTTP status."""
    return _TYPE_BY_STATUS.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or error_type_for(status)

    def body(self) -> dict:
        """The JSON body (a plain dict)."""
        return error_body(self.message, self.status, self.param, self.err_type)

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as one SSE event, for errors after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def error_body(message: str, status: int = 400, param: str | None = None,
               err_type: str | None = None) -> dict:
    """`{"error": {...}}` for `status`."""
    return {"error": {"message": message, "type": err_type or error_type_for(status),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


def not_supported(what: str, param: str | None = None) -> APIError:
    """400 for a feature sous does not implement yet."""
    return APIError(f"{what} is not supported yet.", 400, param)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, "model")


def format_validation_error(errors: list[dict]) -> str:
    """`field: message (input: ...)` per invalid top-level field (the first error of a field
    wins, so a union field reports its first alternative at the fields' common location)."""
    groups: dict[str, list[dict]] = {}
    for err in errors:
        path = tuple(str(p) for p in err.get("loc", ()) if p != "body")
        groups.setdefault(path[0] if path else "", []).append({**err, "path": path})
    parts = []
    for group in groups.values():
        err = group[0]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"Invalid JSON in request body: {ctx.get('error', err.get('msg'))}")
            continue
        path = list(err["path"])
        for other in group[1:]:
            n = 0
            while n < min(len(path), len(other["path"])) and path[n] == other["path"][n]:
                n += 1
            path = path[:n]
        msg = err.get("msg", "invalid value")
        detail = f"{'.'.join(path)}: {msg}" if path else msg
        shown = err.get("input")
        if shown is not None and not isinstance(shown, dict | list):
            detail += f" (input: {shown!r})"
        parts.append(detail)
    return "; ".join(parts) or "Invalid request."
