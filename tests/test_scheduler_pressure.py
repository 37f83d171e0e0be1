"""Multi-turn reuse under KV-cache pressure: the scheduler with the real host and Redis tiers
(`tests/tier_sim.py`) and a device pool far smaller than the conversations' working set.

What is asserted is what was reused: each later turn's `cached_tokens` (the count the API
reports) against its previous prompt + output, and that every page a request runs on holds the
KV its tokens would compute (so a restore that came back wrong, or a recompute counted as
cached, fails). Outputs alone cannot tell: a request that recomputes what it fetched emits the
same ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import shared_redis
from tests.tier_sim import SPEC, TierSim, Turn, conversation_turns

PAGE_BYTES = SPEC.bytes_per_page


def _doc(c: int, n: int) -> list[int]:
    """A conversation's first prompt: a shared header, then text mostly shared with the others
    (as the issue's documents were), with the conversation's own words early on."""
    shared = [(j * 37) % 991 for j in range(n)]
    own = [(c * 7919 + j * 13) % 991 for j in range(8)]
    return shared[:16] + own + shared[24:]


def _new(c: int, t: int) -> list[int]:
    return [(c * 101 + t * 17 + j) % 991 for j in range(20)]


@pytest.fixture
def kv_redis() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def _later_turns(history: list[list[Turn]]) -> list[tuple[str, int, int]]:
    """(request id, cached tokens, previous prompt + output) of every turn after the first."""
    out = []
    for turns in history:
        for turn in turns[1:]:
            assert turn.request is not None
            out.append((turn.request.id, turn.request.cached_tokens, turn.previous))
    return out


def _assert_reused(history: list[list[Turn]], share: float = 0.9) -> None:
    later = _later_turns(history)
    short = [(rid, got, prev) for rid, got, prev in later if got < share * (prev - SPEC.page_size)]
    assert not short, f"later turns that lost their cache (id, cached, previous): {short}"


@pytest.mark.parametrize("host", [False, True], ids=["redis", "redis+host"])
def test_later_turns_find_their_history_under_pressure(kv_redis: tuple[str, str], host: bool) -> None:
    """Eight conversations of ~300 tokens, a pool of 40 pages (640 tokens: about two
    conversations): every later turn is served its previous prompt + output from a tier."""
    url, prefix = kv_redis
    sim = TierSim(40, 32, host_bytes=64 * PAGE_BYTES if host else 0, redis_url=url, redis_prefix=prefix)
    try:
        history = conversation_turns(sim, [_doc(c, 300) for c in range(8)], 3, _new, max_tokens=12)
    finally:
        sim.close()
    _assert_reused(history)
    assert sim.checked_pages > 0


def test_host_tier_alone_serves_later_turns() -> None:
    """No Redis: the host tier (holding every conversation) serves the later turns."""
    sim = TierSim(40, 32, host_bytes=400 * PAGE_BYTES)
    try:
        history = conversation_turns(sim, [_doc(c, 300) for c in range(8)], 3, _new, max_tokens=12)
    finally:
        sim.close()
    _assert_reused(history)
