"""Redis streams of the session store: each response's events, and the background-job queue.

Events (`P:resp:r:events`): event n (its `sequence_number`) is the stream entry `0-<n+1>`
with one field `e` = the event's JSON, so a client resumes with `starting_after=n` by reading
entries after `0-<n+1>`, and Redis itself refuses an event out of sequence (Conflict). While
the response runs nothing is trimmed; `finish` then keeps the last `events_maxlen` events for
`events_ttl_s`.

Jobs (`P:jobs`, consumer group `workers`): one entry `{resp, tenant}` per background response.
A worker claims with XREADGROUP, heartbeats (which resets the entry's idle time while it is
still the owner), and acks (XACK + XDEL) when the response is final. A job idle longer than
`min_idle_ms` (its worker died) is taken over with XAUTOCLAIM; a worker that stops on purpose
(its server shuts down) hands its job back at once (`requeue`: acked, queued again). An enqueue replayed after a lost
reply may queue a response twice: workers skip a response already final, and the lease fence
stops a second run of a conversation turn from committing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import msgspec
import redis.exceptions as rex
from redis.asyncio import Redis

from sessions.config import StoreConfig
from sessions.errors import NotFound
from sessions.keys import Keys
from sessions.retry import Retrier
from sessions.scripts import Scripts

GROUP = "workers"


class Event(NamedTuple):
    seq: int  # the event's sequence_number
    data: bytes  # its JSON, as appended


class Job(NamedTuple):
    id: str  # stream entry id, for ack/heartbeat
    response_id: str
    tenant: str


def _event_id(seq: int) -> str:
    return f"0-{seq + 1}"


def _events(entries: list[Any]) -> list[Event]:
    return [Event(int(eid.split(b"-")[1]) - 1, fields[b"e"]) for eid, fields in entries]


class EventLog:
    """Per-response event streams (see the module docstring)."""

    def __init__(self, client: Redis, keys: Keys, retrier: Retrier, scripts: Scripts, config: StoreConfig):
        self.client, self.keys, self.retrier, self.scripts = client, keys, retrier, scripts
        self.ttl_s, self.maxlen, self.finished_ttl_s = config.state_ttl_s, config.events_maxlen, config.events_ttl_s

    async def append(self, resp_id: str, event: Mapping[str, Any] | msgspec.Struct) -> None:
        """Append one event: a JSON-able mapping or Struct whose int `sequence_number` is higher
        than the last one's (else Conflict; the same number again is a replay, kept once)."""
        seq = event["sequence_number"] if isinstance(event, Mapping) else event.sequence_number  # type: ignore[attr-defined]
        args = [_event_id(seq), msgspec.json.encode(event), self.ttl_s]
        await self.retrier.script(self.scripts.append_event, [self.keys.events(resp_id)], args, resp_id)

    async def read(
        self, tenant: str, resp_id: str, starting_after: int | None = None, block_ms: int = 0, count: int = 100
    ) -> list[Event]:
        """Up to `count` events after sequence number `starting_after` (from the first if None),
        waiting up to `block_ms` for one when there are none yet (keep it under the client's
        socket timeout: 10 s with `SessionStore.connect`). NotFound unless the response belongs
        to `tenant`."""
        last = "0-0" if starting_after is None else _event_id(starting_after)
        key = self.keys.events(resp_id)

        async def first() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(self.keys.resp(resp_id), "tenant")
            pipe.xread({key: last}, count=count)
            return await pipe.execute()

        owner, found = await self.retrier.run(first, resp_id)
        if owner is None or owner.decode() != tenant:
            raise NotFound("response", resp_id)
        if not found and block_ms > 0:

            async def wait() -> Any:
                return await self.client.xread({key: last}, count=count, block=block_ms)

            found = await self.retrier.run(wait, resp_id, extra_s=block_ms / 1000)
        return _events(found[0][1]) if found else []

    async def finish(self, resp_id: str) -> None:
        """The response is final: keep its last `events_maxlen` events for `events_ttl_s`."""
        key = self.keys.events(resp_id)

        async def once() -> Any:
            pipe = self.client.pipeline(transaction=True)
            pipe.xtrim(key, maxlen=self.maxlen, approximate=False)
            pipe.expire(key, self.finished_ttl_s)
            return await pipe.execute()

        await self.retrier.run(once, resp_id)


class JobQueue:
    """The background-job queue (see the module docstring)."""

    def __init__(self, client: Redis, keys: Keys, retrier: Retrier, scripts: Scripts):
        self.client, self.keys, self.retrier, self.scripts = client, keys, retrier, scripts

    async def _ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.keys.jobs, GROUP, id="0", mkstream=True)
        except rex.ResponseError as e:
            if not str(e).startswith("BUSYGROUP"):
                raise

    async def _grouped(self, op: Callable[[], Awaitable[Any]], what: str, extra_s: float = 0.0) -> Any:
        """Run `op` on the group, creating the group first if Redis has none (a new or emptied
        server). extra_s: as in `Retrier.run`."""

        async def once() -> Any:
            try:
                return await op()
            except rex.ResponseError as e:
                if not str(e).startswith("NOGROUP"):
                    raise
                await self._ensure_group()
                return await op()

        return await self.retrier.run(once, what, extra_s)

    async def enqueue(self, resp_id: str, tenant: str) -> str:
        """Queue a background response; returns the job id."""

        async def once() -> Any:
            return await self.client.xadd(self.keys.jobs, {"resp": resp_id, "tenant": tenant})

        return (await self.retrier.run(once, "enqueue")).decode()  # type: ignore[no-any-return]

    async def claim(self, consumer: str, count: int = 1, block_ms: int = 0) -> list[Job]:
        """New jobs for `consumer` (never delivered before), waiting up to `block_ms` for one
        (keep it under the client's socket timeout: 10 s with `SessionStore.connect`)."""

        async def op() -> Any:
            return await self.client.xreadgroup(
                GROUP, consumer, {self.keys.jobs: ">"}, count=count, block=block_ms or None
            )

        reply = await self._grouped(op, "claim", extra_s=block_ms / 1000)
        return [_job(eid, f) for eid, f in reply[0][1]] if reply else []

    async def ack(self, job_id: str) -> None:
        """The job is done: remove it from the group's pending list and from the stream."""

        async def once() -> Any:
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.keys.jobs, GROUP, job_id)
            pipe.xdel(self.keys.jobs, job_id)
            return await pipe.execute()

        await self.retrier.run(once, "ack")

    async def requeue(self, job: Job) -> str:
        """Hand a job back (its worker stops before finishing it): acked and removed, and queued
        again as a new entry in one transaction, so any worker claims it at once rather than after
        `min_idle_ms`. Returns the new job id."""

        async def once() -> Any:
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.keys.jobs, GROUP, job.id)
            pipe.xdel(self.keys.jobs, job.id)
            pipe.xadd(self.keys.jobs, {"resp": job.response_id, "tenant": job.tenant})
            return await pipe.execute()

        reply = await self.retrier.run(once, "requeue")
        new_id = reply[-1]
        return new_id.decode() if isinstance(new_id, bytes) else str(new_id)

    async def autoclaim_stale(self, consumer: str, min_idle_ms: int = 30_000, count: int = 10) -> list[Job]:
        """Take over up to `count` jobs no heartbeat touched for `min_idle_ms` (their worker died)."""
        jobs: list[Job] = []
        start = "0-0"
        while len(jobs) < count:

            async def op(start: str = start, want: int = count - len(jobs)) -> Any:
                return await self.client.xautoclaim(self.keys.jobs, GROUP, consumer, min_idle_ms, start, count=want)

            reply = await self._grouped(op, "autoclaim")
            jobs += [_job(eid, f) for eid, f in reply[1] if f]
            start = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
            if start == "0-0":
                break
        return jobs

    async def heartbeat(self, consumer: str, job_id: str) -> bool:
        """Reset the job's idle time; False if it is no longer ours (another worker took it)."""

        async def op() -> Any:
            return await self.scripts.heartbeat_job(keys=[self.keys.jobs], args=[GROUP, consumer, job_id])

        return bool(await self._grouped(op, "heartbeat"))


def _job(entry_id: bytes, fields: dict[bytes, bytes]) -> Job:
    return Job(entry_id.decode(), fields[b"resp"].decode(), fields[b"tenant"].decode())
