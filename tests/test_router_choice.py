"""How `longctx route` picks a replica, on its own data (no servers): prompt-prefix
fingerprints, the keyless choice between cached prefix and load, a key found in a replica's
published entry, the registry's replicas joining and leaving, and a replica's served log
bounded by its device pool."""

from __future__ import annotations

from api.router.affinity import CHUNK_CHARS, MAX_CHUNKS, matched_chunks, prefix_fingerprints, tenant_of
from api.router.proxy import BALANCE_SLACK, Router
from api.router.registry import Entry
from api.served_log import ServedLog

SYSTEM = "You answer questions about bees. " * 100  # about 3 pieces


def chat(*user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": SYSTEM}, *({"role": "user", "content": u} for u in user)]}


def test_fingerprints_follow_the_prompts_beginning() -> None:
    t = tenant_of("Bearer k1")
    one = prefix_fingerprints(t, chat("Which hive gave most? " * 60))
    two = prefix_fingerprints(t, chat("Which hive gave most? " * 60, "And the least? " * 80))
    assert len(one) == len(SYSTEM + "Which hive gave most? " * 60) // CHUNK_CHARS
    assert two[: len(one) - 1] == one[:-1] and matched_chunks(two, set(one)) >= len(one) - 1
    assert len(prefix_fingerprints(t, chat("x" * 100 * CHUNK_CHARS))) == MAX_CHUNKS
    other = prefix_fingerprints(tenant_of("Bearer k2"), chat("Which hive gave most? " * 60))
    assert not set(other) & set(one)  # scoped per tenant
    assert prefix_fingerprints(t, {"input": "Hi."}) == [] and prefix_fingerprints(t, None) == []
    tools = prefix_fingerprints(t, {"tools": [{"type": "function", "name": "f"}], **chat("q")})
    assert tools[0] != prefix_fingerprints(t, chat("q"))[0]


def _router(*urls: str) -> Router:
    router = Router(list(urls))
    for r in router.replicas.all:
        r.healthy = True
    return router


def test_keyless_request_goes_to_the_longest_cached_prefix_within_the_balance_slack() -> None:
    router = _router("http://a", "http://b")
    a, b = router.replicas.all
    fps = prefix_fingerprints("t", chat("Which hive? " * 200))
    for fp in fps[:2]:
        router.prefixes.put(fp, a.url)
    a.in_flight = BALANCE_SLACK  # busier, within the slack: its cached prefix wins
    assert router.choose(None, fps, set()) is a and router.counters.prefix_hits == 1
    a.in_flight = BALANCE_SLACK + 1  # past it: the least loaded
    assert router.choose(None, fps, set()) is b
    a.in_flight = 0
    b.published = Entry(url=b.url)
    b.prefixes = set(fps[:3])  # b published a longer run than a's
    assert router.choose(None, fps, set()) is b
    assert router.choose(None, fps, {b.url}) is a  # b excluded (a retry)
    other = prefix_fingerprints("t", {"messages": [{"role": "user", "content": "Other text. " * 200}]})
    assert router.choose(None, other, set()) is a  # no run served: the least loaded (first of equals)
    assert router.counters.prefix_hits == 3


def test_published_key_and_registry_sync() -> None:
    router = Router([])
    reps = router.replicas
    reps.sync([Entry(url="http://a/", keys=["t:tag:abc"], queued=5), Entry(url="http://b")])
    a, b = reps.by_url["http://a"], reps.by_url["http://b"]
    assert not a.healthy and router.choose("t:tag:abc", [], set()) is None  # joins once /ready answers
    a.healthy = b.healthy = True
    assert router.choose("t:tag:abc", [], set()) is a  # a key this router never saw: the publisher
    assert router.choose("t:tag:zzz", [], set()) is b  # a's published queue makes it the busier
    assert router.counters.affinity_hits == 1 and router.counters.affinity_misses == 1
    reps.sync([Entry(url="http://b")])  # a's entry expired
    assert not a.healthy and not a.listed and router.choose("t:tag:abc", [], set()) is b


def test_served_log_is_bounded_by_the_device_pool() -> None:
    log = ServedLog()
    log.capacity_tokens = 1000
    for i in range(6):
        log.record(f"k{i}", [f"f{i}"], 300)
    assert list(log.keys) == ["k3", "k4", "k5"] and list(log.prefixes) == ["f3", "f4", "f5"]
    log.record("k3", [], 300)  # served again: newest
    assert list(log.keys) == ["k4", "k5", "k3"]
