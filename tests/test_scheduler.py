"""The scheduler alone, driven by a stand-in runner (`tests/scheduler_sim.py`): the
interleavings that once crashed or stalled it, priorities and the per-request prefill share."""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduling.scheduler import SALT_CACHE_SIZE
from tests.scheduler_sim import FakeConnector, Sim


def _shared(n: int) -> list[int]:
    return [i % 97 for i in range(n)]  # every prompt starts alike: prefix hits and connector fetches


def test_victim_is_never_a_request_already_in_the_plan() -> None:
    """A request back from `loading` keeps its old arrival order; resuming its chunked prefill
    when pages run out, it once preempted a newer decoder whose chunk was already in this
    step's plan (the chunk then ran without pages and the attention metadata asserted)."""
    sim = Sim(7, 16, 32, check_pool=False, connector=FakeConnector(polls=3), lookup_timeout_s=1e9)
    arrivals = [(3, "r2", _shared(16), 24, 0), (4, "r0", _shared(64), 1, 0), (4, "r1", _shared(48), 4, 0)]
    sim.drive(arrivals, max_steps=1000)
    assert sorted(r.id for r in sim.finished) == ["r0", "r1", "r2"]
    assert all(len(r.output_ids) == r.params.max_tokens for r in sim.finished)
    assert sim.pool.num_free == sim.pool.num_pages


def test_no_stall_when_a_preempted_request_goes_first() -> None:
    """Pages once went to a request still waiting (after its fetch); a preempted request put
    in front of it could not fit without them, and no request ever ran again."""
    sim = Sim(7, 16, 32, check_pool=False, connector=FakeConnector(polls=3), lookup_timeout_s=1e9)
    arrivals = [
        (1, "r0", _shared(80), 1, 0),
        (2, "r1", _shared(80), 1, 0),
        (2, "r3", _shared(80), 16, 0),
        (5, "r2", _shared(64), 24, 0),
    ]
    sim.drive(arrivals, max_steps=2000)
    assert sorted(r.id for r in sim.finished) == ["r0", "r1", "r2", "r3"]
    assert sim.pool.num_free == sim.pool.num_pages


def test_priority_orders_admission() -> None:
    """Waiting requests run by (priority, arrival): a later priority-0 request goes before
    earlier priority-1 ones."""
    sim = Sim(16, 4, 16, max_num_seqs=1)
    arrivals = [(0, "bg1", _shared(8), 2, 1), (0, "bg2", _shared(9), 2, 1), (0, "fg", _shared(10), 2, 0)]
    sim.drive(arrivals, max_steps=100)
    assert [r.id for r in sim.finished] == ["fg", "bg1", "bg2"]


def test_higher_priority_arrival_does_not_preempt() -> None:
    """A priority-0 request that does not fit waits for the running priority-1 one to finish."""
    sim = Sim(4, 4, 16)
    sim.drive([(0, "bg", _shared(12), 4, 1), (1, "fg", [5] * 8, 1, 0)], max_steps=100)
    assert [r.id for r in sim.finished] == ["bg", "fg"]
    assert sim.sched.num_preemptions == 0


def test_victim_is_lowest_priority_then_newest() -> None:
    """Out of pages, the older priority-1 request is preempted, not the newer priority-0 one."""
    sim = Sim(6, 4, 16)
    sim.drive([(0, "lo", _shared(8), 8, 1), (0, "hi", [3] * 8, 8, 0)], max_steps=200)
    lo, hi = sim.requests["lo"], sim.requests["hi"]
    assert lo.num_preemptions >= 1 and hi.num_preemptions == 0
    assert sim.finished[0] is hi and len(lo.output_ids) == 8


def test_one_long_prefill_does_not_hold_back_first_tokens() -> None:
    """While others wait, a long prefill takes half the budget; alone, all of it."""
    sim = Sim(64, 16, 32)
    long = sim.add("long", _shared(300), 1)
    assert [(c.request.id, c.num_tokens) for c in sim.step()] == [("long", 32)]  # alone: the whole budget
    short = sim.add("short", [7] * 8, 1)
    assert [(c.request.id, c.num_tokens) for c in sim.step()] == [("long", 16), ("short", 8)]
    assert short.output_ids and not long.output_ids  # its first token did not wait for the long prompt
    capped = Sim(64, 16, 32, max_prefill_tokens_per_request=10)
    capped.add("long", _shared(300), 1)
    capped.add("short", [7] * 8, 1)
    assert [(c.request.id, c.num_tokens) for c in capped.step()] == [("long", 10), ("short", 8)]


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens_per_request"):
        EngineConfig(page_size=16, max_num_batched_tokens=32, max_prefill_tokens_per_request=0)
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]


def test_salted_namespaces_are_bounded() -> None:
    sim = Sim(4, 16, 32)
    for i in range(SALT_CACHE_SIZE + 100):
        sim.sched._salted(f"tenant-{i}")
    assert len(sim.sched._salts) == SALT_CACHE_SIZE
    ns = sim.sched.namespace
    assert ns is not None and sim.sched._salted("tenant-7") == ns.salted("tenant-7")  # recomputed after eviction
