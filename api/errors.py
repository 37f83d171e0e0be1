"""Every error the server answers, as OpenAI's error object, mapped in one place.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Domain errors are registered by class *name* (`register`), so this module imports none of
the layers below it and an exception raised anywhere (engine, tools, sessions) maps the
same way; the first registered name found along the exception's MRO wins. Route modules
add their own with `register`. Litestar's own errors keep their status: validation errors
from msgspec decoding become 400 naming the field in `param`, malformed JSON 400, unknown
routes 404. Anything else is a 500 that logs its traceback and tells the client nothing more.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

log = logging.getLogger("longctx.http")

_AT_PATH = re.compile(r"\s*-\s*at `\$\.?([^`]*)`$")  # msgspec's "... - at `$.text.format`"


@dataclass(frozen=True)
class ErrorSpec:
    """How one exception class is answered.

    Args:
        status: HTTP status.
        type: OpenAI's error `type`.
        code: OpenAI's error `code` (None: none).
        param: the request parameter at fault, read from the exception (None: none).
        headers: extra response headers, read from the exception.
    """

    status: int
    type: str = "invalid_request_error"
    code: str | None = None
    param: Callable[[BaseException], str | None] = lambda e: getattr(e, "param", None)
    headers: Callable[[BaseException], dict[str, str]] = field(default=lambda e: {})


ERRORS: dict[str, ErrorSpec] = {}


def register(name: str, spec: ErrorSpec) -> None:
    """Answer exceptions of class `name` (or a subclass of it) with `spec`."""
    ERRORS[name] = spec


def retry_after_headers(e: BaseException) -> dict[str, str]:
    seconds = max(1, round(float(getattr(e, "retry_after_s", 1))))
    return {"Retry-After": str(seconds), "x-should-retry": "true"}


def _schema_param(e: BaseException) -> str | None:
    return getattr(e, "param", None) or getattr(e, "where", None)


# engine
register("ContextTooLong", ErrorSpec(400, code="context_length_exceeded"))
register("EngineOverloaded", ErrorSpec(429, "rate_limit_error", "engine_overloaded", headers=retry_after_headers))
register("EngineStopped", ErrorSpec(503, "server_error", "shutting_down"))
# tools
register("InvalidSchema", ErrorSpec(400, code="invalid_schema", param=_schema_param))
register("InvalidTool", ErrorSpec(400, code="invalid_tool", param=_schema_param))
# sessions
register("InvalidItem", ErrorSpec(400, code="invalid_item"))
register("NotFound", ErrorSpec(404, code="not_found"))
register("ModelNotFound", ErrorSpec(404, code="model_not_found"))
register(
    "ConversationBusy",
    ErrorSpec(409, code="conversation_busy", headers=lambda e: {"x-should-retry": "false"}),
)
register("LeaseLost", ErrorSpec(409, code="lease_lost"))
register("Conflict", ErrorSpec(409, code="conflict"))
register("ChainTooLong", ErrorSpec(400, code="chain_too_long", param=lambda e: "previous_response_id"))
register("StoreUnavailable", ErrorSpec(503, "server_error", "store_unavailable"))
register("NotReady", ErrorSpec(503, "server_error", "not_ready"))


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def spec_for(exc: BaseException) -> ErrorSpec | None:
    for cls in type(exc).__mro__:
        spec = ERRORS.get(cls.__name__)
        if spec is not None:
            return spec
    return None


def _validation(exc: ValidationException) -> tuple[str, str | None]:
    """(message, param) of a msgspec decoding error as Litestar reports it."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    if not extra or not isinstance(extra[0], dict):
        return str(exc.detail), None
    first = extra[0]
    message, key = str(first.get("message", exc.detail)), first.get("key")
    m = _AT_PATH.search(message)
    if m:  # a nested field: msgspec names its JSON path
        message, key = message[: m.start()], m.group(1) or key
    elif key == "data":  # the body as a whole, not one field
        key = None
    if message == "'data'":
        message = "the request body is missing or is not JSON"
    elif key is None:
        message = f"the request body: {message}"
    return (f"{message} at '{key}'" if key else message), key


def _http(exc: HTTPException, request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    status = exc.status_code
    param: str | None = None
    code: str | None = None
    if isinstance(exc, ValidationException):
        message, param = _validation(exc)
        code = "invalid_value" if param else "invalid_json"
    elif status == 404 and exc.detail == "Not Found":
        message, code = f"no route for {request.method} {request.url.path}", "not_found"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
        if isinstance(exc.__cause__, SerializationException):  # the body is not JSON
            message, code = f"the request body is not valid JSON: {message}", "invalid_json"
    type_ = "invalid_request_error" if status < 500 else "server_error"
    headers = {k: v for k, v in (exc.headers or {}).items()}
    return Response(error_body(message, type_, param, code), status_code=status, headers=headers)


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Litestar's handler for every exception: the one place errors become HTTP."""
    spec = spec_for(exc)
    if spec is not None:
        headers = spec.headers(exc)
        return Response(
            error_body(str(exc), spec.type, spec.param(exc), spec.code), status_code=spec.status, headers=headers
        )
    if isinstance(exc, HTTPException):
        return _http(exc, request)
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return Response(error_body("internal server error", "server_error", None, "internal_error"), status_code=500)
