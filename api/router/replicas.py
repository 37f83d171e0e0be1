"""The replicas behind the router: health from each one's `/ready` (polled every `POLL_S`; a
replica that fails `DOWN_AFTER` polls in a row, or a connection, leaves the rotation, so a dead
one is out within about 2 s) and load (requests in flight through this router, or what the
replica published, whichever is more).

Replicas come from `--replica` URLs (static) and, with `--replicas-from-redis`, from the
registry (`api.router.registry`): a registered replica whose entry expired or was withdrawn
leaves the rotation at the next poll; its published affinity keys and prefix fingerprints say
whose KV pages its device most likely holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from api.router.registry import Entry

log = logging.getLogger("longctx.route")

POLL_S = 1.0
DOWN_AFTER = 2
OVERLOADED = 8  # in flight on the affine replica past which a request goes to the least loaded


@dataclass
class Replica:
    url: str
    healthy: bool = False
    failures: int = 0
    in_flight: int = 0
    requests: int = 0
    static: bool = True  # from --replica; else from the registry
    listed: bool = True  # a registered replica's entry is live
    published: Entry | None = None
    keys: set[str] = field(default_factory=set)  # from the published entry
    prefixes: set[str] = field(default_factory=set)

    @property
    def load(self) -> int:
        p = self.published
        return max(self.in_flight, p.queued + p.running if p is not None else 0)


class Replicas:
    def __init__(self, urls: list[str]):
        self.all = [Replica(u.rstrip("/")) for u in urls]
        self.by_url = {r.url: r for r in self.all}

    def healthy(self, exclude: set[str] = frozenset()) -> list[Replica]:  # type: ignore[assignment]
        return [r for r in self.all if r.healthy and r.url not in exclude]

    def least_loaded(self, exclude: set[str] = frozenset()) -> Replica | None:  # type: ignore[assignment]
        up = self.healthy(exclude)
        return min(up, key=lambda r: (r.load, r.requests)) if up else None

    def holder(self, key: str) -> Replica | None:
        """The replica that published `key` among those it served last (None: none did)."""
        return next((r for r in self.all if key in r.keys), None)

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s out of rotation: %s", replica.url, why)
        replica.healthy = False
        replica.failures = DOWN_AFTER

    def sync(self, entries: list[Entry]) -> None:
        """Take the registry's live entries: new replicas join (in rotation once `/ready`
        answers), registered ones missing from it leave."""
        live = {e.url.rstrip("/"): e for e in entries}
        for url, entry in live.items():
            r = self.by_url.get(url)
            if r is None:
                r = Replica(url, static=False)
                self.all.append(r)
                self.by_url[url] = r
                log.info("replica %s registered", url)
            r.listed, r.published = True, entry
            r.keys, r.prefixes = set(entry.keys), set(entry.prefixes)
        for r in self.all:
            if not r.static and r.url not in live and r.listed:
                r.listed, r.published, r.keys, r.prefixes = False, None, set(), set()
                self.mark_down(r, "its registry entry expired")

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Check every listed replica's /ready once."""

        async def one(r: Replica) -> None:
            try:
                ok = (await client.get(r.url + "/ready", timeout=POLL_S)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                if not r.healthy:
                    log.info("replica %s in rotation", r.url)
                r.healthy, r.failures = True, 0
            else:
                r.failures += 1
                if r.failures >= DOWN_AFTER:
                    self.mark_down(r, "/ready does not answer 200")

        await asyncio.gather(*(one(r) for r in self.all if r.listed))

    async def watch(
        self, client: httpx.AsyncClient, registry: Callable[[], Awaitable[list[Entry]]] | None = None
    ) -> None:
        while True:
            if registry is not None:
                try:
                    self.sync(await registry())
                except Exception as e:  # a Redis hiccup: keep the last view
                    log.warning("cannot read the replica registry: %s", e)
            await self.poll(client)
            await asyncio.sleep(POLL_S)
