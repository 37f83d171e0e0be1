"""Bounded serving statistics: fixed-bucket histograms and counters, safe to read from any thread.

The engine thread records; `/metrics` and admission read `snapshot()` from other threads. Memory
is fixed whatever the traffic: a histogram is its bucket counts, a sum and a count (Prometheus'
cumulative `le` buckets, so the exporter copies them as they are), never a list of samples.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

# Seconds, upper bounds (le); +Inf is implicit. From a fast decode step to a queued long prefill.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


class HistogramSnapshot(NamedTuple):
    buckets: tuple[float, ...]  # upper bounds, ascending; the last cumulative count is +Inf's
    cumulative: tuple[int, ...]  # len(buckets) + 1 counts of observations <= each bound
    sum: float
    samples: int  # the count (a NamedTuple field cannot be called `count`)


class Histogram:
    """Counts of observations per bucket; `observe` is O(log buckets), memory is O(buckets)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError("buckets must be ascending and distinct")
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; last = above all bounds
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # first bound >= value (le semantics)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = []
        running = 0
        for c in counts:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.buckets, tuple(cumulative), total, running)


class StatsSnapshot(NamedTuple):
    steps: int
    prompt_tokens_computed: int
    generated_tokens: int
    finished: int
    finished_by_reason: dict[str, int]
    preemptions: int
    ttft: HistogramSnapshot  # arrival -> first token
    inter_token: HistogramSnapshot  # between consecutive tokens of one request
    queue_time: HistogramSnapshot  # arrival -> first scheduled
    e2e: HistogramSnapshot  # arrival -> finished


@dataclass
class EngineStats:
    """Counters and latency histograms of one engine. Only the engine thread writes the counters
    (plain ints, one writer), so each read is exact; `snapshot()` copies them all for another
    thread (counters read together may straddle one step)."""

    steps: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    queue_time: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_finished(self, reason: str) -> None:
        with self._lock:
            self.finished += 1
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            by_reason = dict(self.finished_by_reason)
            counters = (self.steps, self.prompt_tokens_computed, self.generated_tokens, self.finished)
        return StatsSnapshot(
            *counters,
            by_reason,
            self.preemptions,
            self.ttft.snapshot(),
            self.inter_token.snapshot(),
            self.queue_time.snapshot(),
            self.e2e.snapshot(),
        )
