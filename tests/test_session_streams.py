"""Event streams and the background-job queue of the session store, against a real Redis:
resuming after sequence number N, blocking reads, out-of-sequence events refused, trimming once
final; jobs enqueued, claimed once, heartbeated, taken over when stale, acked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest

from sessions.errors import Conflict
from sessions.models import Response
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def event(seq: int) -> dict[str, object]:
    return {"type": "response.output_text.delta", "sequence_number": seq, "delta": f"d{seq}"}


def test_events_resume_block_and_trim(target: tuple[str, str]) -> None:
    async def body() -> None:
        store = SessionStore.connect(target[0], StoreConfig(prefix=target[1], events_maxlen=3))
        r = Response(model="m")
        await store.responses.save("t", r)
        for seq in range(10):
            await store.events.append(r.id, event(seq))
        await store.events.append(r.id, event(9))  # the same event again (a replay): kept once
        with pytest.raises(Conflict):
            await store.events.append(r.id, event(4))
        everything = await store.events.read("t", r.id)
        assert [e.seq for e in everything] == list(range(10))
        assert [msgspec.json.decode(e.data) for e in everything] == [event(i) for i in range(10)]
        assert [e.seq for e in await store.events.read("t", r.id, starting_after=4)] == [5, 6, 7, 8, 9]
        assert [e.seq for e in await store.events.read("t", r.id, starting_after=4, count=2)] == [5, 6]

        # A wait longer than the retry budget is a wait, not a failure. (A try may take the rest of
        # the budget beyond its wait: 0.5 s, so a reply the loaded suite delays a little still counts.)
        impatient = SessionStore(store.client, StoreConfig(prefix=target[1], retry_budget_s=0.5))
        start = time.monotonic()
        assert await impatient.events.read("t", r.id, starting_after=9, block_ms=1200) == []
        assert time.monotonic() - start >= 1.15
        reader = asyncio.create_task(store.events.read("t", r.id, starting_after=9, block_ms=5000))
        await asyncio.sleep(0.1)
        await store.events.append(r.id, event(10))
        assert [e.seq for e in await asyncio.wait_for(reader, 2)] == [10]

        await store.events.finish(r.id)  # final: the last events_maxlen kept, with an expiry
        assert [e.seq for e in await store.events.read("t", r.id)] == [8, 9, 10]
        assert 0 < await store.client.ttl(store.keys.events(r.id)) <= 86_400
        await store.close()

    asyncio.run(body())


def test_jobs_claim_heartbeat_autoclaim_ack(target: tuple[str, str]) -> None:
    async def body() -> None:
        config = StoreConfig(prefix=target[1])
        a, b = SessionStore.connect(target[0], config), SessionStore.connect(target[0], config)
        first, second = await a.jobs.enqueue("resp_1", "t"), await a.jobs.enqueue("resp_2", "u")
        jobs = await a.jobs.claim("worker-a", count=5)
        assert [(j.id, j.response_id, j.tenant) for j in jobs] == [(first, "resp_1", "t"), (second, "resp_2", "u")]
        assert await b.jobs.claim("worker-b", count=5) == []  # each job goes to one worker
        impatient = SessionStore(b.client, StoreConfig(prefix=target[1], retry_budget_s=0.5))
        start = time.monotonic()  # a wait longer than the retry budget is a wait, not a failure
        assert await impatient.jobs.claim("worker-b", block_ms=1200) == []
        assert time.monotonic() - start >= 1.15

        await asyncio.sleep(0.15)
        assert await a.jobs.heartbeat("worker-a", first)  # first is alive; second's worker died
        stolen = await b.jobs.autoclaim_stale("worker-b", min_idle_ms=100)
        assert [j.id for j in stolen] == [second]
        assert not await a.jobs.heartbeat("worker-a", second)  # no longer ours
        assert await b.jobs.heartbeat("worker-b", second)

        waiting = asyncio.create_task(b.jobs.claim("worker-b", block_ms=3000))
        await asyncio.sleep(0.05)
        third = await a.jobs.enqueue("resp_3", "t")
        assert [j.id for j in await asyncio.wait_for(waiting, 2)] == [third]

        for job_id in (first, second, third):
            await a.jobs.ack(job_id)
        await asyncio.sleep(0.02)
        assert await b.jobs.autoclaim_stale("worker-b", min_idle_ms=0) == []
        assert await a.client.xlen(a.keys.jobs) == 0
        await a.close()
        await b.close()

    asyncio.run(body())
