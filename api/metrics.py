"""`GET /metrics`: the server in Prometheus' text format (0.0.4).

Measured per HTTP request (what clients see): `longctx:time_to_first_token_seconds` and
`longctx:inter_token_latency_seconds` (chat completions, and streamed responses: their output
deltas), `longctx:e2e_request_latency_seconds` and `longctx:http_requests_total{route,status}`
(every route, streams until their last byte). Token counters (`longctx:prompt_tokens_total`,
`cached_prompt`, `generation`) carry a `tenant` label; `longctx:tenant_waiting_requests{tenant}`
is the per-tenant admission count. Read at scrape time: gauges from `Engine.snapshot()` (requests
running, waiting, loading = waiting for KV pages from the host or Redis tier, queued; device pages
used and free), host-tier bytes, counters from it (preemptions, tokens) and from
`Engine.kv_stats()` (`longctx:kv_<tier>_<counter>_total`: prefix cache, host tier, Redis tier;
`longctx:kv_restored_unused_pages_total{reason}`: pages a tier returned that were not used),
the engine's own histograms as `longctx:engine_*` (e.g. `longctx:engine_queue_time_seconds`),
`longctx:startup_phase_seconds{phase}`, the model load (bytes, bytes/s, loader phases) and the
process' resident memory.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, get
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.limits import tenant_queue
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
    report = state.compile_report
    if report is not None:
        out += _family(
            "longctx:compiled_bucket_mismatch_total",
            "counter",
            "compiled step buckets over their self-check bound (run eager)",
            [("", len(report.eager))],
        )
        out += _family(
            "longctx:compiled_bucket",
            "gauge",
            "compiled step buckets: 1 compiled, 0 eager",
            [(f'{{bucket="{c.bucket}"}}', int(c.ok)) for c in report.checks],
        )
        out += _family("longctx:compiled_bucket_logits_error", "gauge",
                       "each bucket's self-check: relative logit error against the eager modules", [
            (f'{{bucket="{c.bucket}"}}', c.error) for c in report.checks
        ])  # fmt: skip
    out += _family("longctx:process_resident_memory_bytes", "gauge", "resident memory", [("", _rss_bytes())])
    out += _load(state)
    queue = tenant_queue(state)
    if queue is not None:
        out += _family("longctx:tenant_waiting_requests", "gauge", "requests waiting for their first token", [
            (f'{{tenant="{_label(t)}"}}', n) for t, n in sorted(queue.snapshot().items())
        ])  # fmt: skip
    engine = state.engine
    if engine is not None:
        snap = engine.snapshot()
        for name, help in REQUEST_GAUGES.items():
            out += _family(f"longctx:num_requests_{name}", "gauge", help, [("", getattr(snap, name))])
        used = snap.total_pages - snap.free_pages
        out += _family("longctx:kv_pages_used", "gauge", "device KV pages in use", [("", used)])
        out += _family(
            "longctx:kv_pages_free", "gauge", "device KV pages free (cached included)", [("", snap.free_pages)]
        )
        for name in ("preemptions", "prompt_tokens_computed", "generated_tokens", "finished"):
            out += _family(f"longctx:engine_{name}_total", "counter", f"engine {name}", [("", getattr(snap, name))])
        kv = engine.kv_stats()
        unused = kv.pop("restored_unused", {})
        out += _family(
            "longctx:kv_restored_unused_pages_total", "counter", "KV pages a tier returned that were not used",
            [(f'{{reason="{_label(reason)}"}}', n) for reason, n in unused.items()],
        )  # fmt: skip
        for tier, counters in kv.items():
            for key, value in counters.items():
                out += _family(f"longctx:kv_{tier}_{key}_total", "counter", f"{tier} {key}", [("", value)])
        host: list[tuple[str, float]] = [("", engine.host_bytes)]
        out += _family("longctx:kv_host_bytes", "gauge", "bytes of KV pages in the host tier", host)
        out += _engine_histograms(engine)
        out += _histogram(
            "longctx:engine_output_channel_seconds",
            "engine process sending a step's outputs to the API process handing them to their requests",
            engine.channel.snapshot(),
        )
    return "\n".join(out) + "\n"


REQUEST_GAUGES = {
    "running": "requests in the running batch",
    "waiting": "requests waiting to be scheduled",
    "loading": "requests waiting for KV pages from the host or Redis tier",
    "queued": "requests added and not yet running (what --max-queued bounds)",
}
ENGINE_HISTOGRAMS = {  # EngineStats field -> exported name (engine-side, not per HTTP request)
    "ttft": ("longctx:engine_time_to_first_token_seconds", "engine arrival to first token"),
    "inter_token": ("longctx:engine_inter_token_latency_seconds", "engine time between tokens of a request"),
    "queue_time": ("longctx:engine_queue_time_seconds", "engine arrival to first scheduled"),
    "e2e": ("longctx:engine_e2e_request_latency_seconds", "engine arrival to finished"),
}


def _engine_histograms(engine: Any) -> list[str]:
    """The engine's own histograms (`EngineStats.snapshot()`: cumulative buckets) and its
    finished requests by reason."""
    stats = engine.stats.snapshot()
    out: list[str] = []
    for field, (name, help) in ENGINE_HISTOGRAMS.items():
        out += _histogram(name, help, getattr(stats, field))
    out += _family("longctx:engine_requests_finished_total", "counter", "engine requests finished by reason", [
        (f'{{reason="{_label(r)}"}}', n) for r, n in sorted(stats.finished_by_reason.items())
    ])  # fmt: skip
    return out


def _histogram(name: str, help: str, h: Any) -> list[str]:
    """A Prometheus histogram from a `HistogramSnapshot` (cumulative buckets)."""
    out = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
    out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(h.buckets, h.cumulative, strict=False)]
    return [*out, f'{name}_bucket{{le="+Inf"}} {h.samples}', f"{name}_sum {h.sum}", f"{name}_count {h.samples}"]


def _load(state: ServerState) -> list[str]:
    """How the model loaded: bytes read, their rate (`LoadStats.gb_per_s`), the loader's phases."""
    loaded = state.loaded
    if loaded is None:
        return []
    stats = loaded.stats
    return [
        *_family("longctx:model_load_bytes", "gauge", "weight bytes read at load", [("", stats.bytes_read)]),
        *_family("longctx:model_load_bytes_per_second", "gauge", "weight load rate", [("", stats.gb_per_s * 1e9)]),
        *_family("longctx:model_load_phase_seconds", "gauge", "seconds of each model-loading phase", [
            (f'{{phase="{_label(p)}"}}', s) for p, s in stats.phases.items()
        ]),
    ]  # fmt: skip


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
