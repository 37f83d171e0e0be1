"""WebSocket mode of `/v1/responses` (OpenAI's and the Open Responses spec's): one long-lived
connection, one `response.create` message per turn, the turn's events back as JSON text frames.

    client  {"type": "response.create", "model": ..., "input": [...], "previous_response_id": ...}
    server  {"type": "response.created", ...} ... {"type": "response.completed", "response": {...}}
            {"type": "error", "status": 400, "error": {"type", "code", "message", "param"}}

The body is that of `POST /v1/responses` (a body nested under `"response"` is read too); it is
always streamed, so `stream` is ignored, and `background` is refused. Messages are answered one
at a time, by the same `SessionService.create` as HTTP, so every field and check is the same.

The connection keeps its most recent completed (or incomplete) response: a next turn whose
`previous_response_id` names it continues from the items the connection holds, so `store: false`
chains work without anything stored (and, through the token cache, from the same KV pages). A
stored response is continued from Redis as over HTTP. An id neither the connection nor the store
knows is an `error` event with code `previous_response_not_found` (after a reconnect, a
`store: false` chain starts again from its full input). A continuation that fails evicts the
connection's response, so retrying the same id is `previous_response_not_found` as well; a turn
that starts without `previous_response_id` (after `/v1/responses/compact`, from its compaction
item) starts a new chain. Errors leave the connection open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from api.auth import tenant
from api.errors import spec_for
from api.metrics import METRICS
from api.state import ServerState
from sessions.errors import NotFound
from sessions.items import Item
from sessions.models import TERMINAL, Response
from sessions.requests import decode_request

log = logging.getLogger("longctx.serve")
_encoder = msgspec.json.Encoder()


@dataclass
class Chain:
    """The connection's most recent completed response and the items it continues from."""

    id: str | None = None
    items: list[Item] = field(default_factory=list)
    stored: bool = False

    def clear(self) -> None:
        self.id, self.items, self.stored = None, [], False


@websocket("/responses")
async def responses_socket(socket: WebSocket[Any, Any, Any]) -> None:
    """Responses over one WebSocket connection (see the module docstring)."""
    await socket.accept()
    chain = Chain()
    try:
        while True:
            raw = await socket.receive_text()
            await turn(socket, raw, chain)
    except WebSocketDisconnect:
        return


async def turn(socket: WebSocket[Any, Any, Any], raw: str, chain: Chain) -> None:
    """One `response.create`: its events, or one `error` event."""
    try:
        message = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        return await _error(socket, 400, "invalid_request_error", f"the message is not JSON: {e}", None, "invalid_json")
    if not isinstance(message, dict) or message.get("type") != "response.create":
        kind = message.get("type") if isinstance(message, dict) else None
        return await _error(
            socket,
            400,
            "invalid_request_error",
            f"unknown client event type {kind!r}; expected response.create",
            "type",
            "unknown_event",
        )
    body = message["response"] if isinstance(message.get("response"), dict) else message
    body = {k: v for k, v in body.items() if k not in ("type", "stream")}
    if body.get("background"):
        return await _error(
            socket,
            400,
            "invalid_request_error",
            "background responses are not supported over a WebSocket",
            "background",
            None,
        )
    prev = body.get("previous_response_id")
    continues = prev is not None and prev == chain.id
    history = chain.items if continues and not chain.stored else None
    state: ServerState = socket.app.state.server
    svc = state.sessions
    assert svc is not None  # the route runs once the server is ready
    try:
        req = decode_request(body | {"stream": True})
        events = await svc.create(tenant(socket), req, history=history)
        assert not isinstance(events, Response), "a streamed request gets its events"
    except Exception as e:
        if continues:
            chain.clear()
        return await _exception(socket, e)
    final: Response | None = None
    try:
        async for event in events:
            await socket.send_text(_encoder.encode(event).decode())
            if event["type"].removeprefix("response.") in TERMINAL:
                final = event["response"]
    finally:
        await events.aclose()
    if final is not None:
        METRICS.count_usage(tenant(socket), final.usage)
    if final is None or final.status not in ("completed", "incomplete"):
        if continues:
            chain.clear()
        return None
    chain.id, chain.stored = final.id, final.store
    chain.items = [*(history or []), *req.input_items, *final.output]
    return None


async def _exception(socket: WebSocket[Any, Any, Any], e: Exception) -> None:
    spec = spec_for(e)
    if spec is None:
        log.exception("WebSocket response.create failed", exc_info=e)
        return await _error(socket, 500, "server_error", "internal server error", None, "internal_error")
    param, code, status = spec.param(e), spec.code, spec.status
    if isinstance(e, NotFound) and param == "previous_response_id":
        status, code = 400, "previous_response_not_found"
    return await _error(socket, status, spec.type, str(e), param, code)


async def _error(
    socket: WebSocket[Any, Any, Any], status: int, type_: str, message: str, param: str | None, code: str | None
) -> None:
    error = {"type": type_, "code": code, "message": message, "param": param}
    await socket.send_text(_encoder.encode({"type": "error", "status": status, "error": error}).decode())
