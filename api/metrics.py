"""`GET /metrics`: the server in Prometheus' text format, through `prometheus-client`.

Measured per HTTP request (what clients see), as `prometheus-client` metrics in this module's
registry: `longctx:time_to_first_token_seconds` and `longctx:inter_token_latency_seconds` (chat
completions, and streamed responses: their output deltas), `longctx:e2e_request_latency_seconds`
and `longctx:http_requests_total{method,route,status}` (every route, streams until their last
byte); token counters (`longctx:prompt_tokens_total`, `cached_prompt`, `generation`) by `tenant`.
Everything else is read at scrape time (`api/metrics_scrape.py`): the startup phases, the compiled
buckets, the model load, the engine's load, counters and histograms.

The engine runs in a process of its own (`engine/process/`) but publishes no metrics itself: it
already sends its snapshot with every step's outputs and its counters and histograms every 0.25 s
to this process (`wire.Metrics`), which exposes them from a collector at scrape time. So one
process serves `/metrics` and prometheus-client's multiprocess mode (files per process, merged at
scrape, with no custom collectors) is not needed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import prometheus_client
from litestar import Request, Response, get
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

from api.metrics_scrape import ScrapeCollector
from api.state import ServerState

prometheus_client.disable_created_metrics()  # no `_created` series beside each counter and histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_KINDS = ("prompt", "cached_prompt", "generation")


class Metrics:
    """What the server counts itself, in a registry of its own (the engine's numbers are read at
    scrape time); prometheus-client's metrics are safe from any thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "longctx:time_to_first_token_seconds", "HTTP request to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "longctx:inter_token_latency_seconds", "between streamed outputs", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "longctx:e2e_request_latency_seconds", "HTTP request to last byte", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter(
            "longctx:http_requests_total",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.tokens = {
            kind: Counter(f"longctx:{kind}_tokens_total", f"{kind} tokens by tenant", ["tenant"], registry=r)
            for kind in TOKEN_KINDS
        }

    def count_tokens(self, tenant: str, prompt: int, cached: int, generated: int) -> None:
        for kind, n in zip(TOKEN_KINDS, (prompt, cached, generated), strict=True):
            self.tokens[kind].labels(tenant).inc(n)

    def count_request(self, method: str, route: str, status: int) -> None:
        self.requests.labels(method, route, str(status)).inc()

    def count_usage(self, tenant: str, usage: Any) -> None:
        """Tokens of a Responses `usage` (a struct or its JSON form; None: nothing to count)."""
        if usage is None:
            return
        get = usage.get if isinstance(usage, dict) else lambda k: getattr(usage, k, None)
        details = get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else getattr(details, "cached_tokens", 0)
        self.count_tokens(tenant, int(get("input_tokens") or 0), int(cached or 0), int(get("output_tokens") or 0))


METRICS = Metrics()
_TERMINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


async def measured_events(events: AsyncIterator[Any], tenant: str, started: float) -> AsyncIterator[Any]:
    """A Responses event stream as it is, observing the time to the first output delta, the time
    between deltas and, from the terminal event, the tenant's tokens. Closing it closes `events`."""
    last: float | None = None
    try:
        async for event in events:
            kind = event.get("type", "") if isinstance(event, dict) else ""
            if kind.startswith("response.") and kind.endswith(".delta"):  # text, reasoning, call arguments
                now = time.perf_counter()
                if last is None:
                    METRICS.ttft.observe(now - started)
                else:
                    METRICS.itl.observe(now - last)
                last = now
            elif kind in _TERMINAL:
                response = event.get("response")
                usage = response.get("usage") if isinstance(response, dict) else getattr(response, "usage", None)
                METRICS.count_usage(tenant, usage)
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class _Scrape:
    """The collectors one scrape reads: the counted metrics, then the state's (`generate_latest`
    takes anything with `collect()`)."""

    def __init__(self, *collectors: Collector):
        self.collectors = collectors

    def collect(self) -> Iterable[Any]:
        for c in self.collectors:
            yield from c.collect()


def render(state: ServerState, m: Metrics = METRICS) -> str:
    """The whole exposition: `m`'s metrics and what `state` holds at this moment."""
    scrape = _Scrape(m.registry, ScrapeCollector(state))
    return prometheus_client.generate_latest(scrape).decode()  # type: ignore[arg-type]


@get("/metrics", sync_to_thread=False)
def metrics(request: Request[Any, Any, Any]) -> Response[str]:
    body = render(request.app.state.server)
    return Response(body, media_type=prometheus_client.CONTENT_TYPE_PLAIN_0_0_4)


def http_metrics(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: per request, its route, status and seconds until its last byte."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:
            handler = scope.get("route_handler")
            route = next(iter(handler.paths), scope["path"]) if handler is not None else "unmatched"
            if route != "/metrics":
                METRICS.e2e.observe(time.perf_counter() - t0)
            METRICS.count_request(str(scope.get("method", "")), route, status)

    return middleware
