"""`GET /metrics`: the server in Prometheus' text format (0.0.4).

Measured per HTTP request (what clients see; the engine's own histograms keep other names):
`longctx:time_to_first_token_seconds`, `longctx:inter_token_latency_seconds` (chat completions),
`longctx:e2e_request_latency_seconds` and `longctx:http_requests_total{route,status}` (every
route, streams until their last byte). Token counters carry a `tenant` label. Read at scrape time:
gauges from `Engine.snapshot()` (running, waiting, loading, queued, device pages), counters from it
(preemptions, tokens) and from `Engine.kv_stats()` (`longctx:kv_<tier>_<counter>_total`: prefix
cache, host tier, Redis tier), `longctx:startup_phase_seconds{phase}` and the process' resident
memory.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict
from typing import Any

from litestar import Request, Response, get
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.state import ServerState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """A fixed-bucket histogram (any thread)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, c in zip(self.buckets, counts, strict=False):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {n}')
        return [*lines, f"{self.name}_sum {total}", f"{self.name}_count {n}"]


class Metrics:
    """What the server counts itself (the engine's numbers are read at scrape time)."""

    def __init__(self) -> None:
        self.ttft = Histogram("longctx:time_to_first_token_seconds", "HTTP request to first token", LATENCY_BUCKETS)
        self.itl = Histogram("longctx:inter_token_latency_seconds", "between streamed outputs", ITL_BUCKETS)
        self.e2e = Histogram("longctx:e2e_request_latency_seconds", "HTTP request to last byte", LATENCY_BUCKETS)
        self.requests: defaultdict[tuple[str, str, int], int] = defaultdict(int)
        self.tokens: defaultdict[tuple[str, str], int] = defaultdict(int)  # (kind, tenant)
        self._lock = threading.Lock()

    def count_tokens(self, tenant: str, prompt: int, cached: int, generated: int) -> None:
        with self._lock:
            self.tokens["prompt", tenant] += prompt
            self.tokens["cached_prompt", tenant] += cached
            self.tokens["generation", tenant] += generated

    def count_request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.requests[method, route, status] += 1


METRICS = Metrics()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", *(f"{name}{labels} {v}" for labels, v in samples)]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def render(state: ServerState, m: Metrics = METRICS) -> str:
    out: list[str] = []
    for h in (m.ttft, m.itl, m.e2e):
        out += h.render()
    with m._lock:
        requests, tokens = dict(m.requests), dict(m.tokens)
    out += _family("longctx:http_requests_total", "counter", "HTTP requests by route and status", [
        (f'{{method="{meth}",route="{_label(route)}",status="{status}"}}', n)
        for (meth, route, status), n in sorted(requests.items())
    ])  # fmt: skip
    for kind in ("prompt", "cached_prompt", "generation"):
        out += _family(f"longctx:{kind}_tokens_total", "counter", f"{kind} tokens by tenant", [
            (f'{{tenant="{_label(t)}"}}', n) for (k, t), n in sorted(tokens.items()) if k == kind
        ])  # fmt: skip
    out += _family("longctx:startup_phase_seconds", "gauge", "seconds each startup phase took", [
        (f'{{phase="{_label(p)}"}}', s) for p, s in state.phase_seconds.items()
    ])  # fmt: skip
    out += _family("longctx:process_resident_memory_bytes", "gauge", "resident memory", [("", _rss_bytes())])
    engine = state.engine
    if engine is not None:
        snap = engine.snapshot()
        for name in ("running", "waiting", "loading", "queued"):
            out += _family(f"longctx:num_requests_{name}", "gauge", f"requests {name}", [("", getattr(snap, name))])
        used = snap.total_pages - snap.free_pages
        out += _family("longctx:kv_pages_used", "gauge", "device KV pages in use", [("", used)])
        out += _family(
            "longctx:kv_pages_free", "gauge", "device KV pages free (cached included)", [("", snap.free_pages)]
        )
        for name in ("preemptions", "prompt_tokens_computed", "generated_tokens", "finished"):
            out += _family(f"longctx:engine_{name}_total", "counter", f"engine {name}", [("", getattr(snap, name))])
        for tier, counters in engine.kv_stats().items():
            for key, value in counters.items():
                out += _family(f"longctx:kv_{tier}_{key}_total", "counter", f"{tier} {key}", [("", value)])
    return "\n".join(out) + "\n"


@get("/metrics", sync_to_thread=False)
def metrics(request: Request[Any, Any, Any]) -> Response[str]:
    body = render(request.app.state.server)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


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
