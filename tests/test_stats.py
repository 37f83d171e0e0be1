"""Engine statistics: Prometheus-style cumulative buckets, exact under concurrent writers, bounded."""

from __future__ import annotations

import threading

import pytest

from engine.stats import EngineStats, Histogram


def test_buckets_are_cumulative_with_le_bounds() -> None:
    h = Histogram((0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 100.0):
        h.observe(v)
    s = h.snapshot()
    assert s.buckets == (0.1, 1.0, 10.0)
    assert s.cumulative == (2, 4, 5, 6)  # le 0.1, le 1, le 10, +Inf
    assert s.samples == 6 and s.sum == pytest.approx(104.65)
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_concurrent_observations_are_all_counted_in_fixed_memory() -> None:
    h = Histogram()

    def work() -> None:
        for i in range(20_000):
            h.observe(i * 1e-4)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = h.snapshot()
    assert s.samples == s.cumulative[-1] == 80_000
    assert len(s.cumulative) == len(h.buckets) + 1  # memory does not grow with observations
    assert list(s.cumulative) == sorted(s.cumulative)


def test_finished_by_reason() -> None:
    stats = EngineStats()
    for reason in ("stop", "length", "stop", "abort"):
        stats.count_finished(reason)
    snap = stats.snapshot()
    assert snap.finished == 4 and snap.finished_by_reason == {"stop": 2, "length": 1, "abort": 1}
    stats.count_finished("error")
    assert snap.finished_by_reason == {"stop": 2, "length": 1, "abort": 1}  # a copy, not a view
