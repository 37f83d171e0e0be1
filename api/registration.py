"""This replica in the registry `longctx route --replicas-from-redis` reads (`api.router.registry`).

Every `PUBLISH_S` the server publishes its URL (`--advertise-url`), its engine's queue depth and
the affinity keys and prompt-prefix fingerprints of the generation requests it served lately,
keyed as the router keys them (`api.router.affinity`: scoped by a hash of `Authorization`,
never the header). Device pages are evicted least recently used, so the newest keys, as many as
the device pool would hold (a request's tokens estimated at `BYTES_PER_TOKEN` of its body), are
most likely still there. The entry expires `TTL_S` after the last publish; a draining server
withdraws it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from api.router import registry
from api.router.affinity import (
    RESPONSE_ID,
    id_key,
    parse_body,
    prefix_fingerprints,
    request_key,
    tenant_of,
)
from api.served_log import BYTES_PER_TOKEN, ServedLog
from api.state import ServerState

log = logging.getLogger("longctx.serve")

GENERATION_PATHS = frozenset({"/v1/responses", "/v1/chat/completions"})
SNIFF_BYTES = 4096


def recorder(state: ServerState) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware factory: the generation requests answered below 400 go into `state.served`."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            served = state.served
            if scope["type"] != "http" or served is None or scope.get("method") != "POST":
                await app(scope, receive, send)
                return
            if scope["path"] not in GENERATION_PATHS:
                await app(scope, receive, send)
                return
            taken: list[Any] = []
            size, whole = 0, False
            while size <= state.options.max_body_bytes:
                message = await receive()
                taken.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    whole = True
                    break
            body = b"".join(m.get("body", b"") for m in taken) if whole else b""

            async def replay() -> ReceiveMessage:
                if taken:
                    first: ReceiveMessage = taken.pop(0)
                    return first
                return await receive()

            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            tenant = tenant_of(auth)
            data = parse_body(scope["path"], body)
            key = request_key(tenant, scope["path"], data)
            fingerprints = prefix_fingerprints(tenant, data) if key is None else []
            tokens = len(body) // BYTES_PER_TOKEN
            sniff: bytes | None = None

            async def sending(message: Message) -> None:
                nonlocal sniff
                if message["type"] == "http.response.start" and int(message["status"]) < 400:
                    served.record(key, fingerprints, tokens)
                    sniff = b"" if key is None else None
                elif message["type"] == "http.response.body" and sniff is not None:
                    sniff += message.get("body", b"")
                    m = RESPONSE_ID.search(sniff)
                    if m:
                        served.record(id_key(tenant, m.group(1).decode()), [], tokens)
                    if m or len(sniff) > SNIFF_BYTES:
                        sniff = None
                await send(message)

            served.in_flight += 1
            try:
                await app(scope, replay, sending)
            finally:
                served.in_flight -= 1

        return middleware

    return wrap


def advertised_url(state: ServerState) -> str:
    o = state.options
    if o.advertise_url:
        return o.advertise_url.rstrip("/")
    host = socket.gethostname() if o.host in ("0.0.0.0", "::", "") else o.host
    return f"http://[{host}]:{o.port}" if ":" in host else f"http://{host}:{o.port}"


def entry(state: ServerState, url: str) -> registry.Entry:
    served = state.served
    assert served is not None
    e = registry.Entry(url=url, in_flight=served.in_flight, capacity_tokens=served.capacity_tokens)
    engine = state.engine
    if engine is not None:
        snap = engine.snapshot()
        e.queued, e.running = snap.queued, snap.running
    e.keys, e.prefixes = list(served.keys), list(served.prefixes)
    return e


def configure(state: ServerState) -> None:
    """Record what this server serves and, once its routes start, publish it every `PUBLISH_S`."""
    state.served = ServedLog()
    task: asyncio.Task[None] | None = None
    url = advertised_url(state)
    prefix = state.options.store.prefix

    async def publishing() -> None:
        failing = False
        while not state.draining:
            try:
                assert state.redis is not None
                await registry.publish(state.redis, prefix, entry(state, url))
                failing = False
            except Exception as e:
                if not failing:
                    log.warning("cannot publish this replica in the registry: %s", e)
                failing = True
            await asyncio.sleep(registry.PUBLISH_S)
        await withdrawing(state)

    async def withdrawing(state: ServerState) -> None:
        if state.redis is not None:
            with contextlib.suppress(Exception):
                await registry.withdraw(state.redis, prefix, url)

    async def start(state: ServerState) -> None:
        nonlocal task
        assert state.served is not None
        if state.engine is not None:
            state.served.capacity_tokens = state.engine.capacity_tokens
        task = asyncio.create_task(publishing(), name="longctx-registry")
        log.info("registered as %s in %s:{replicas}", url, prefix)

    async def stop(state: ServerState) -> None:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await withdrawing(state)

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
