"""The router's relay of the Responses WebSocket mode (`api/ws.py`): one client connection, one
replica connection, frames passed both ways as they come until either side closes.

- **Choosing**: at the handshake the router opens the replica's socket first (the least-loaded
  replica in rotation; one that refuses the connection leaves the rotation and the next is
  tried), so a replica's refusal (403 for a missing or wrong key) reaches the client as the same
  HTTP answer, and the accepted handshake names the replica in `x-longctx-replica`. The first
  `response.create` then picks by the HTTP affinity rules (its `conversation`,
  `previous_response_id` or `prompt_cache_key`, scoped per tenant by the `Authorization` hash):
  when its key belongs to another healthy replica, the connection moves there before anything
  is sent (the connection holds no state yet; the handshake named the first replica).
- **Passing through**: the client's headers go to the replica unchanged (`Authorization`
  included; hop-by-hop and handshake headers aside); each message is relayed whole as it comes.
  Each `response.create` counts as a request of the replica and is in flight until its terminal
  event; the keys and response ids seen are learnt as over HTTP, so later HTTP turns follow.
- **A replica that dies** (its connection drops without a close frame): the client gets an
  `error` event (status 502, code `replica_failed`) and close code 1011, the replica leaves the
  rotation, and the next connection goes to another. A close frame from either side is passed on
  with its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any, Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from api.router.affinity import RESPONSE_ID, AffinityTable, id_key, parse_body, request_key, tenant_of
from api.router.asgi import Receive, Scope, Send
from api.router.keys import refusal
from api.router.metrics import RouterCounters
from api.router.replicas import OVERLOADED, Replica, Replicas


class Router(Protocol):
    """What the relay uses of `api.router.proxy.Router`: its replicas, keys, affinity table and counters."""

    replicas: Replicas
    keys: dict[str, str] | None
    table: AffinityTable
    counters: RouterCounters


# a replica's events begin with their type (`api/ws.py` encodes `type` first)
ENDS_TURN = re.compile(r'^\{"type":"(?:response\.(?:completed|incomplete|failed|cancelled)|error)"')
HANDSHAKE = {"host", "connection", "upgrade", "keep-alive", "proxy-connection", "te", "transfer-encoding",
             "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
             "sec-websocket-accept"}  # fmt: skip
OPEN_TIMEOUT_S = 5.0
REPLICA_FAILED = 1011  # close code to the client when its replica's connection dropped
SNIFF_CHARS = 4096


class DenialNoise(logging.Filter):
    """Drops uvicorn's "returned without completing handshake" error, which its sans-I/O
    WebSocket protocol logs after a handshake refused with an HTTP answer (`_deny`), as ASGI's
    `websocket.http.response` extension allows: the answer was sent."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing handshake" not in record.getMessage()


class Link:
    """One relayed connection: its replica's socket and the turns in flight on it."""

    def __init__(self, router: Router, tenant: str, replica: Replica, upstream: ClientConnection):
        self.router, self.tenant = router, tenant
        self.replica, self.upstream = replica, upstream
        self.client_gone = False
        self.pending = 0  # response.create messages sent whose terminal event has not come back

    def sent(self, text: str | None) -> None:
        """A client message went to the replica: a turn starts; its key is learnt."""
        self.replica.requests += 1
        self.replica.in_flight += 1
        self.pending += 1
        key = _key(self.tenant, text)
        if key is not None:
            self.router.table.put(key, self.replica.url)

    def received(self, text: str) -> None:
        m = RESPONSE_ID.search(text[:SNIFF_CHARS].encode())
        if m:
            self.router.table.put(id_key(self.tenant, m.group(1).decode()), self.replica.url)
        if self.pending and ENDS_TURN.match(text):
            self.pending -= 1
            self.replica.in_flight -= 1

    def release(self) -> None:
        self.replica.in_flight -= self.pending
        self.pending = 0


def _key(tenant: str, text: str | None) -> str | None:
    data = parse_body("/v1/responses", text.encode()) if text else None
    if data is not None and isinstance(data.get("response"), dict):
        data = data["response"]
    return request_key(tenant, "/v1/responses", data)


async def _deny(scope: Scope, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse the handshake with an HTTP answer (a plain 403 where the server cannot send one)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        return await send({"type": "websocket.close", "code": 1008})
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def _open(replica: Replica, target: str, headers: list[tuple[str, str]]) -> ClientConnection:
    url = replica.url.replace("http", "ws", 1) + target
    return await connect(
        url, additional_headers=headers, user_agent_header=None, open_timeout=OPEN_TIMEOUT_S, max_size=None,
        compression=None, proxy=None,
    )  # fmt: skip


async def relay_socket(router: Router, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one client WebSocket through a replica (see the module docstring)."""
    if (await receive())["type"] != "websocket.connect":
        return
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    headers = [(k, v) for k, v in headers if k.lower() not in HANDSHAKE]
    auth = next((v for k, v in headers if k.lower() == "authorization"), None)
    if refusal(router.keys, auth) is not None:
        return await _deny(scope, send, 403, b"", [])
    target = scope["path"] + ("?" + scope["query_string"].decode() if scope.get("query_string") else "")
    tried: set[str] = set()
    while True:
        replica = router.replicas.least_loaded(tried)
        if replica is None:
            router.counters.no_replica += 1
            body = b'{"error":{"message":"no replica is ready","code":"no_replica"}}'
            return await _deny(scope, send, 503, body, [(b"content-type", b"application/json")])
        tried.add(replica.url)
        try:
            upstream = await _open(replica, target, headers)
            break
        except InvalidStatus as e:  # the replica answered the handshake: pass its answer on
            out = [(k.lower().encode(), v.encode()) for k, v in e.response.headers.raw_items()]
            out = [(k, v) for k, v in out if k.decode() not in HANDSHAKE | {"content-length"}]
            out.append((b"x-longctx-replica", replica.url.encode()))
            return await _deny(scope, send, e.response.status_code, bytes(e.response.body or b""), out)
        except (OSError, TimeoutError, InvalidHandshake) as e:
            router.replicas.mark_down(replica, f"WebSocket connect failed: {type(e).__name__}: {e}")
            router.counters.failovers += 1
    await send({"type": "websocket.accept", "headers": [(b"x-longctx-replica", replica.url.encode())]})
    link = Link(router, tenant_of(auth), replica, upstream)
    try:
        await _relay(link, receive, send, target, headers)
    finally:
        link.release()
        await link.upstream.close()


async def _first(link: Link, msg: dict[str, Any], target: str, headers: list[tuple[str, str]]) -> None:
    """The first client message: move to its key's replica when that is another healthy one."""
    router = link.router
    key = _key(link.tenant, msg.get("text"))
    if key is None:
        return
    url = router.table.get(key)
    r = router.replicas.by_url.get(url) if url is not None else router.replicas.holder(key)
    if r is None:
        router.counters.affinity_misses += 1
        return
    if r is link.replica or not r.healthy or r.in_flight >= OVERLOADED:
        if r is link.replica:
            router.counters.affinity_hits += 1
        else:
            router.counters.failovers += 1
        return
    try:
        moved = await _open(r, target, headers)
    except InvalidStatus:  # it refused this client: stay where the handshake went
        router.counters.failovers += 1
        return
    except (OSError, TimeoutError, InvalidHandshake) as e:
        router.replicas.mark_down(r, f"WebSocket connect failed: {type(e).__name__}: {e}")
        router.counters.failovers += 1
        return
    await link.upstream.close()
    link.replica, link.upstream = r, moved
    router.counters.affinity_hits += 1


async def _relay(link: Link, receive: Receive, send: Send, target: str, headers: list[tuple[str, str]]) -> None:
    msg = await receive()
    if msg["type"] == "websocket.disconnect":
        return
    await _first(link, msg, target, headers)
    up = asyncio.create_task(_from_replica(link, send))
    down = asyncio.create_task(_from_client(link, receive, msg))
    done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    for task in (up, down):
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    for task in done:
        task.result()


async def _from_client(link: Link, receive: Receive, msg: dict[str, Any]) -> None:
    while msg["type"] == "websocket.receive":
        text, data = msg.get("text"), msg.get("bytes")
        with contextlib.suppress(ConnectionClosed):  # the other pump reports the replica's end
            await link.upstream.send(text if text is not None else data or b"")
        link.sent(text)
        msg = await receive()
    link.client_gone = True
    code = msg.get("code") or 1000
    await link.upstream.close(code=code if code not in (1005, 1006) else 1000)


async def _from_replica(link: Link, send: Send) -> None:
    try:
        async for frame in link.upstream:
            if isinstance(frame, str):
                link.received(frame)
                await send({"type": "websocket.send", "text": frame})
            else:
                await send({"type": "websocket.send", "bytes": frame})
    except ConnectionClosed:
        pass
    except OSError:  # the client went away (uvicorn's ClientDisconnected): the client's pump ends it
        return
    if link.client_gone:
        return
    rcvd = link.upstream.protocol.close_rcvd
    if rcvd is None:  # no close frame: the replica (or the way to it) died
        link.router.replicas.mark_down(link.replica, "its WebSocket dropped")
        link.router.counters.failovers += 1
        error = {"type": "server_error", "code": "replica_failed", "param": None,
                 "message": "the replica serving this connection failed"}  # fmt: skip
        await send({"type": "websocket.send", "text": json.dumps({"type": "error", "status": 502, "error": error})})
        await send({"type": "websocket.close", "code": REPLICA_FAILED, "reason": "replica failed"})
        return
    code = rcvd.code if rcvd.code not in (1005, 1006) else 1000  # codes a close frame may not carry
    await send({"type": "websocket.close", "code": code, "reason": rcvd.reason})
