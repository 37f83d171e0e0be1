"""Bodies over `--max-body-bytes`: a 413 with OpenAI's error object that the client can read.

Answering as soon as the length is known and closing would reset the connection of a client
still sending (the kernel answers unread data with a reset), so clients such as Python's urllib
would see a connection error instead of the answer. `body_limit` therefore reads a body whose
`Content-Length` is over the limit to its end, discarding it (up to `DRAIN_BYTES`; beyond that
the connection is closed as before), and only then answers 413. A body sent without a length
(chunked) is cut off by Litestar's own `request_max_body_size` check.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from litestar.types import ASGIApp, Receive, Scope, Send

from api.errors import error_body

DRAIN_BYTES = 1 << 30  # read and dropped before answering; a larger body gets its connection closed


def body_limit(max_bytes: int) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware factory: 413 (after draining) for declared lengths over `max_bytes`."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            length = _content_length(scope)
            if length is None or length <= max_bytes:
                await app(scope, receive, send)
                return
            drained = 0
            while drained <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = json.dumps(
                error_body(
                    f"the request body is {length} bytes; this server takes at most {max_bytes} (--max-body-bytes)",
                    "invalid_request_error",
                    None,
                    "request_too_large",
                )
            ).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if drained > DRAIN_BYTES:
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": 413, "headers": headers})  # type: ignore[arg-type]
            await send({"type": "http.response.body", "body": body})  # type: ignore[arg-type]

        return middleware

    return wrap


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
