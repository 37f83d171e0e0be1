"""What `/metrics` reads at scrape time, as a prometheus-client collector (`api/metrics.py` has
what the server counts itself).

From the server's state: `longctx:startup_phase_seconds{phase}`, the compiled step's buckets
(`longctx:compiled_bucket{bucket}`, their self-check's error, the mismatches), the model load
(bytes, bytes/s, loader phases), the process' resident memory and
`longctx:tenant_waiting_requests{tenant}`. From the engine (its process sends these, the client
keeps the latest): gauges from `snapshot()` (requests running, waiting, loading = waiting for KV
pages from the host or Redis tier, queued; device pages used and free), host-tier bytes, counters
from it (preemptions, tokens) and from `kv_stats()` (`longctx:kv_<tier>_<counter>_total`: prefix
cache, host tier, Redis tier; `longctx:kv_restored_unused_pages_total{reason}`: pages a tier
returned that were not used), the engine's own histograms as `longctx:engine_*` (e.g.
`longctx:engine_queue_time_seconds`) and the process boundary's
(`longctx:engine_output_channel_seconds`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from api.limits import tenant_queue
from api.state import ServerState

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


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


def _counter(name: str, help: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help, value=value)


def _labelled(family: Any, name: str, help: str, label: str, values: Mapping[Any, float]) -> Metric:
    """A gauge or counter family with one sample per value of `label`."""
    metric = family(name, help, labels=[label])
    for key, value in values.items():
        metric.add_metric([str(key)], value)
    return metric  # type: ignore[no-any-return]


def _histogram(name: str, help: str, h: Any) -> HistogramMetricFamily:
    """A Prometheus histogram from a `HistogramSnapshot` (cumulative buckets)."""
    buckets = [(floatToGoString(b), c) for b, c in zip(h.buckets, h.cumulative, strict=False)]
    return HistogramMetricFamily(name, help, buckets=[*buckets, ("+Inf", h.samples)], sum_value=h.sum)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ScrapeCollector:
    """The families of one scrape of `state` (built at each `collect()`)."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state
        yield _labelled(
            GaugeMetricFamily,
            "longctx:startup_phase_seconds",
            "seconds each startup phase took",
            "phase",
            dict(state.phase_seconds),
        )
        yield from self._compiled()
        yield _gauge("longctx:process_resident_memory_bytes", "resident memory", _rss_bytes())
        yield from self._load()
        queue = tenant_queue(state)
        if queue is not None:
            yield _labelled(
                GaugeMetricFamily,
                "longctx:tenant_waiting_requests",
                "requests waiting for their first token",
                "tenant",
                dict(sorted(queue.snapshot().items())),
            )
        if state.engine is not None:
            yield from self._engine(state.engine)

    def _compiled(self) -> Iterator[Metric]:
        report = self.state.compile_report
        if report is None:
            return
        yield _counter(
            "longctx:compiled_bucket_mismatch_total",
            "compiled step buckets over their self-check bound (run eager)",
            len(report.eager),
        )
        yield _labelled(
            GaugeMetricFamily,
            "longctx:compiled_bucket",
            "compiled step buckets: 1 compiled, 0 eager (failed, or still compiling)",
            "bucket",
            {b: 0 for b in report.pending} | {c.bucket: int(c.ok) for c in report.checks},
        )
        yield _gauge(
            "longctx:compiled_buckets_compiling",
            "compiled step buckets compiling in the background",
            len(report.pending),
        )
        yield _labelled(
            GaugeMetricFamily,
            "longctx:compiled_bucket_logits_error",
            "each bucket's self-check: relative logit error against the eager modules",
            "bucket",
            {c.bucket: c.error for c in report.checks},
        )

    def _load(self) -> Iterator[Metric]:
        """How the model loaded: bytes read, their rate (`LoadStats.gb_per_s`), the loader's phases."""
        loaded = self.state.loaded
        if loaded is None:
            return
        stats = loaded.stats
        yield _gauge("longctx:model_load_bytes", "weight bytes read at load", stats.bytes_read)
        yield _gauge("longctx:model_load_bytes_per_second", "weight load rate", stats.gb_per_s * 1e9)
        yield _labelled(
            GaugeMetricFamily,
            "longctx:model_load_phase_seconds",
            "seconds of each model-loading phase",
            "phase",
            dict(stats.phases),
        )

    def _engine(self, engine: Any) -> Iterator[Metric]:
        snap = engine.snapshot()
        for name, help in REQUEST_GAUGES.items():
            yield _gauge(f"longctx:num_requests_{name}", help, getattr(snap, name))
        yield _gauge("longctx:kv_pages_used", "device KV pages in use", snap.total_pages - snap.free_pages)
        yield _gauge("longctx:kv_pages_free", "device KV pages free (cached included)", snap.free_pages)
        for name in ("preemptions", "prompt_tokens_computed", "generated_tokens", "finished"):
            yield _counter(f"longctx:engine_{name}_total", f"engine {name}", getattr(snap, name))
        kv = dict(engine.kv_stats())
        unused = kv.pop("restored_unused", {})
        yield _labelled(
            CounterMetricFamily,
            "longctx:kv_restored_unused_pages_total",
            "KV pages a tier returned that were not used",
            "reason",
            unused,
        )
        for tier, counters in kv.items():
            for key, value in counters.items():
                yield _counter(f"longctx:kv_{tier}_{key}_total", f"{tier} {key}", value)
        yield _gauge("longctx:kv_host_bytes", "bytes of KV pages in the host tier", engine.host_bytes)
        yield _gauge(
            "longctx:kv_prefetch_bytes",
            "bytes of KV pages read ahead from Redis for waiting requests",
            engine.prefetch_bytes,
        )
        stats = engine.stats.snapshot()
        for field, (name, help) in ENGINE_HISTOGRAMS.items():
            yield _histogram(name, help, getattr(stats, field))
        yield _labelled(
            CounterMetricFamily,
            "longctx:engine_requests_finished_total",
            "engine requests finished by reason",
            "reason",
            dict(sorted(stats.finished_by_reason.items())),
        )
        yield _histogram(
            "longctx:engine_output_channel_seconds",
            "engine process sending a step's outputs to the API process handing them to their requests",
            engine.channel.snapshot(),
        )
