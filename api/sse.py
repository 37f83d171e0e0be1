"""Server-sent events: one `event:`/`data:` block per event, comments while nothing happens.

Each event is a JSON object with a `type` (a msgspec Struct or a dict); the SSE `event:`
line repeats that type, as OpenAI's streams do:

    event: response.output_text.delta
    data: {"type":"response.output_text.delta","sequence_number":4,...}

While the next event is slow to come (a request waiting for the engine, a long prefill), a
comment line `: keep-alive` goes out every `keepalive_s` seconds so proxies keep the
connection open (`LONGCTX_SSE_KEEPALIVE_S` in the environment changes the interval: tests use
a fraction of a second). When the client leaves, the event source is closed (`aclose`), so the code
producing it sees `GeneratorExit` and can abort its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import msgspec
from litestar.response import Stream

KEEPALIVE_S = float(os.environ.get("LONGCTX_SSE_KEEPALIVE_S") or 15.0)
COMMENT = b": keep-alive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # nginx: do not buffer the stream

_encoder = msgspec.json.Encoder()


def encode_event(event: Any) -> bytes:
    """One SSE block for `event` (a Struct or dict with a string `type`)."""
    kind = event.get("type") if isinstance(event, dict) else getattr(event, "type", None)
    if not isinstance(kind, str) or not kind or "\n" in kind:
        raise ValueError(f"an SSE event needs a one-line string `type`, got {kind!r}")
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"


async def sse_bytes(events: AsyncIterable[Any], keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """The encoded stream of `events`, with a comment after every `keepalive_s` of silence."""
    it = aiter(events)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            # The same __anext__ keeps running across keep-alives: cancelling it would cancel the source.
            pending = pending or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield COMMENT
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield encode_event(event)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


class EventStream(Stream):
    """A `Stream` that keeps its own `text/event-stream` type. Litestar passes the handler's media
    type (JSON for a handler annotated with a Struct) to `to_asgi_response`, and a passed type wins
    over the response's own, so a streamed reply went out as `application/json`."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)


def sse_response(events: AsyncIterable[Any], keepalive_s: float = KEEPALIVE_S, status_code: int = 200) -> Stream:
    """A Litestar response streaming `events` as `text/event-stream`."""
    return EventStream(
        sse_bytes(events, keepalive_s),
        media_type="text/event-stream",
        headers=HEADERS,
        status_code=status_code,
    )
