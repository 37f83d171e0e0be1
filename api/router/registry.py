"""The replica registry in the state Redis: each `longctx serve` publishes an `Entry` every
`PUBLISH_S` under a `TTL_S` expiry; `longctx route --replicas-from-redis` reads the live ones.

Keys (one hash tag, so both lie in one slot of a Redis Cluster):
- `P:{replicas}:set`: sorted set, member = a replica's URL, score = its entry's expiry (ms);
- `P:{replicas}:r:<url>`: the replica's `Entry` as JSON, with the same expiry.

A replica that stops publishing (killed, hung) drops out once its entry expires; one that stops
cleanly withdraws its entry at once.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvstore.redis_connect import mget_async

PUBLISH_S = 1.0
TTL_S = 3.0
FORGET_S = 600.0  # expired members older than this are removed from the set


class Entry(msgspec.Struct, omit_defaults=True):
    """What a replica publishes about itself.

    Attributes:
        url: where the router reaches it (`--advertise-url`).
        queued, running: its engine's requests waiting to start and running.
        in_flight: HTTP generation requests it is answering now.
        capacity_tokens: tokens its device KV pool holds.
        keys: affinity keys (`api.router.affinity`) of the conversations, chains and prompt
            cache keys it served most recently, newest last, as many as its device pool would
            hold (an estimate of whose pages are still there).
        prefixes: prompt-prefix fingerprints of the requests it served, newest last, bounded
            the same way.
    """

    url: str
    queued: int = 0
    running: int = 0
    in_flight: int = 0
    capacity_tokens: int = 0
    keys: list[str] = []
    prefixes: list[str] = []


def set_key(prefix: str) -> str:
    return f"{prefix}:{{replicas}}:set"


def entry_key(prefix: str, url: str) -> str:
    return f"{prefix}:{{replicas}}:r:{url}"


async def publish(client: Any, prefix: str, entry: Entry, ttl_s: float = TTL_S) -> None:
    ttl_ms = int(ttl_s * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.set(entry_key(prefix, entry.url), msgspec.json.encode(entry), px=ttl_ms)
    pipe.zadd(set_key(prefix), {entry.url: int(time.time() * 1000) + ttl_ms})
    await pipe.execute()


async def withdraw(client: Any, prefix: str, url: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.delete(entry_key(prefix, url))
    pipe.zrem(set_key(prefix), url)
    await pipe.execute()


async def read(client: Any, prefix: str) -> list[Entry]:
    """The entries of the replicas alive now (their expiry not passed)."""
    now = int(time.time() * 1000)
    urls = [
        u.decode() if isinstance(u, bytes) else str(u) for u in await client.zrangebyscore(set_key(prefix), now, "+inf")
    ]
    await client.zremrangebyscore(set_key(prefix), "-inf", now - int(FORGET_S * 1000))
    raw = await mget_async(client, [entry_key(prefix, u) for u in urls])
    out = []
    for value in raw:
        if value is None:
            continue
        try:
            out.append(msgspec.json.decode(value, type=Entry))
        except msgspec.DecodeError:
            continue
    return out
