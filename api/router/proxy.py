"""The router's ASGI app: pick a replica (`Router.choose`), pass the request through with its
headers unchanged (`Authorization` included: the replica authenticates), relay the answer as it
arrives (SSE chunks are sent on at once, never buffered), learn where the request's key and
its new response id went, retry a 429 once on another replica, and move off a replica whose
connection fails (it leaves the rotation; a stream cut mid-way ends with an `error` event).

A request with an affinity key goes to the replica that served the key last (this router's
table, else the replica that published the key); one without goes to the replica, among the
least loaded (within `BALANCE_SLACK`), that served the longest run of its prefix fingerprints.

Every answer carries `x-longctx-replica: <replica URL>`. Own routes, open as a replica's:
`/health`, `/ready` (200 while a replica is in rotation), `/metrics` (`api.router.metrics`).
With the replicas' keys (`--api-keys-file`) a `/v1` request without one is refused here, as a
replica refuses it. WebSockets are relayed by `api.router.ws_relay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from api.auth import is_loopback, load_keys
from api.router.affinity import (
    RESPONSE_ID,
    AffinityTable,
    id_key,
    matched_chunks,
    parse_body,
    prefix_fingerprints,
    request_key,
    tenant_of,
)
from api.router.asgi import Receive, Scope, Send
from api.router.keys import refusal
from api.router.metrics import RouterCounters, render
from api.router.registry import Entry
from api.router.replicas import OVERLOADED, Replica, Replicas
from api.router.ws_relay import DenialNoise, relay_socket

log = logging.getLogger("longctx.route")

HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
SNIFF_BYTES = 4096  # of an answer, searched for the new response's id
BALANCE_SLACK = 2  # a keyless request goes for its cached prefix to a replica this much busier at most
Registry = Callable[[], Awaitable[list[Entry]]]


class Router:
    def __init__(self, urls: list[str], registry: Registry | None = None, keys: dict[str, str] | None = None):
        self.replicas = Replicas(urls)
        self.keys = keys  # --api-keys-file: KEY -> tenant; None: the replicas check keys alone
        self.registry = registry
        self.table = AffinityTable()
        self.prefixes = AffinityTable()  # prefix fingerprint -> replica URL this router sent it to
        self.counters = RouterCounters()
        self.client: httpx.AsyncClient | None = None
        self._watch: asyncio.Task[None] | None = None

    # ---- choosing ----

    def choose(self, key: str | None, fingerprints: list[str], exclude: set[str]) -> Replica | None:
        if key is not None:
            url = self.table.get(key)
            r = self.replicas.by_url.get(url) if url is not None else self.replicas.holder(key)
            if r is not None and r.healthy and r.url not in exclude and r.in_flight < OVERLOADED:
                self.counters.affinity_hits += 1
                return r
            if r is None:
                self.counters.affinity_misses += 1
            else:
                self.counters.failovers += 1
        elif fingerprints:
            r = self.by_prefix(fingerprints, exclude)
            if r is not None:
                self.counters.prefix_hits += 1
                return r
        return self.replicas.least_loaded(exclude)

    def by_prefix(self, fingerprints: list[str], exclude: set[str]) -> Replica | None:
        """Among the replicas at most `BALANCE_SLACK` busier than the least loaded, the one that
        served (by this router's table or its own published list) the longest run of
        `fingerprints`; None when none served any."""
        up = [r for r in self.replicas.healthy(exclude) if r.in_flight < OVERLOADED]
        if not up:
            return None
        floor = min(r.load for r in up)
        sent = {fp: url for fp in fingerprints if (url := self.prefixes.get(fp)) is not None}
        best, best_n = None, 0
        for r in sorted(up, key=lambda r: (r.load, r.requests)):
            if r.load > floor + BALANCE_SLACK:
                continue
            mine = {fp for fp, url in sent.items() if url == r.url}
            n = max(matched_chunks(fingerprints, r.prefixes), matched_chunks(fingerprints, mine))
            if n > best_n:
                best, best_n = r, n
        return best

    # ---- ASGI ----

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await relay_socket(self, scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(
                    timeout=httpx.Timeout(None, connect=2.0),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                )
                if self.registry is not None:
                    with contextlib.suppress(Exception):  # the watch logs a registry that fails
                        self.replicas.sync(await self.registry())
                await self.replicas.poll(self.client)
                self._watch = asyncio.create_task(self.replicas.watch(self.client, self.registry))
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._watch is not None:
                    self._watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._watch
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _own(self, send: Send, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == "/health":
            return await self._own(send, 200, b'{"status":"ok"}')
        if path == "/ready":
            up = len(self.replicas.healthy())
            body = json.dumps({"status": "ready" if up else "no replica", "replicas_up": up}).encode()
            return await self._own(send, 200 if up else 503, body)
        if path == "/metrics":
            return await self._own(
                send, 200, render(self.counters, self.replicas).encode(), b"text/plain; version=0.0.4"
            )
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        auth = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), None)
        refused = refusal(self.keys, auth) if path.startswith("/v1") else None
        if refused is not None:
            return await self._own(send, 401, refused)
        tenant = tenant_of(auth)
        data = parse_body(path, body) if scope["method"] == "POST" else None
        key = request_key(tenant, path, data)
        fingerprints = prefix_fingerprints(tenant, data) if key is None else []
        url_tail = path + ("?" + scope["query_string"].decode() if scope.get("query_string") else "")
        tried: set[str] = set()
        replica = self.choose(key, fingerprints, tried)
        assert self.client is not None
        for attempt in range(2):
            if replica is None:
                self.counters.no_replica += 1
                return await self._own(send, 503, b'{"error":{"message":"no replica is ready","code":"no_replica"}}')
            tried.add(replica.url)
            replica.in_flight += 1
            replica.requests += 1
            try:
                request = self.client.build_request(
                    scope["method"], replica.url + url_tail, headers=headers, content=body
                )
                resp = await self.client.send(request, stream=True)
            except httpx.TransportError as e:  # never reached it (or it died before answering)
                replica.in_flight -= 1
                self.replicas.mark_down(replica, f"{type(e).__name__}: {e}")
                self.counters.failovers += 1
                if not isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                    return await self._own(
                        send, 502, b'{"error":{"message":"the replica failed","code":"replica_failed"}}'
                    )
                replica = self.replicas.least_loaded(tried)
                continue
            if resp.status_code == 429 and attempt == 0:
                other = self.replicas.least_loaded(tried)
                if other is not None:
                    await resp.aclose()
                    replica.in_flight -= 1
                    self.counters.retried_429 += 1
                    replica = other
                    continue
            try:
                await self._relay(resp, replica, tenant, key, send)
                if resp.status_code < 400:
                    for fp in fingerprints:
                        self.prefixes.put(fp, replica.url)
            finally:
                replica.in_flight -= 1
                await resp.aclose()
            return

    async def _relay(self, resp: httpx.Response, replica: Replica, tenant: str, key: str | None, send: Send) -> None:
        out = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP]
        out.append((b"x-longctx-replica", replica.url.encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        ok = resp.status_code < 400
        if ok and key is not None:
            self.table.put(key, replica.url)
        sniff = b"" if ok else None
        try:
            async for chunk in resp.aiter_raw():
                if sniff is not None:
                    sniff += chunk
                    m = RESPONSE_ID.search(sniff)
                    if m:
                        self.table.put(id_key(tenant, m.group(1).decode()), replica.url)
                    if m or len(sniff) > SNIFF_BYTES:
                        sniff = None
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            self.replicas.mark_down(replica, f"cut mid-answer: {e}")
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                err = {"type": "error", "code": "replica_failed", "message": "the replica serving this stream failed"}
                event = f"event: error\ndata: {json.dumps(err)}\n\n".encode()
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def serve(
    host: str,
    port: int,
    urls: list[str],
    redis_url: str | None = None,
    redis_prefix: str = "lc",
    keys_file: Path | None = None,
) -> int:
    """Run the router until SIGINT/SIGTERM: in front of `urls` and, given `redis_url`, of the
    replicas registered in that state Redis under `redis_prefix`; given `keys_file` (the
    replicas' `--api-keys-file`), `/v1` requests and WebSockets without one of its keys are
    refused here as a replica refuses them. Raises KeysFileError (a file that cannot be used)."""
    import functools

    import uvicorn

    from api.router import registry

    if not urls and redis_url is None:
        raise ValueError("longctx route needs a --replica URL or --replicas-from-redis")
    reader: Registry | None = None
    if redis_url is not None:
        from kvstore.redis_connect import connect_async

        client = connect_async(redis_url, socket_connect_timeout=2, socket_timeout=2)
        reader = functools.partial(registry.read, client, redis_prefix)
    keys = load_keys(keys_file) if keys_file is not None else None
    if keys is None and not is_loopback(host):
        log.warning("no --api-keys-file on %s: the replicas alone check keys on /v1", host)
    config = uvicorn.Config(Router(urls, reader, keys), host=host, port=port, log_level="warning", lifespan="on")
    logging.getLogger("uvicorn.error").addFilter(DenialNoise())  # after Config set its logging up
    where = ", ".join(urls + ([f"the replicas registered in {redis_prefix}:{{replicas}}"] if reader else []))
    log.info("routing requests on http://%s:%d to %s", host, port, where)
    uvicorn.Server(config).run()
    return 0
