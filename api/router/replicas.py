"""The replicas behind the router: health from each one's `/ready` (polled every `POLL_S`; a
replica that fails `DOWN_AFTER` polls in a row, or a connection, leaves the rotation, so a dead
one is out within about 2 s) and load (requests in flight through this router)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

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


class Replicas:
    def __init__(self, urls: list[str]):
        self.all = [Replica(u.rstrip("/")) for u in urls]
        self.by_url = {r.url: r for r in self.all}

    def healthy(self, exclude: set[str] = frozenset()) -> list[Replica]:  # type: ignore[assignment]
        return [r for r in self.all if r.healthy and r.url not in exclude]

    def least_loaded(self, exclude: set[str] = frozenset()) -> Replica | None:  # type: ignore[assignment]
        up = self.healthy(exclude)
        return min(up, key=lambda r: (r.in_flight, r.requests)) if up else None

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s out of rotation: %s", replica.url, why)
        replica.healthy = False
        replica.failures = DOWN_AFTER

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Check every replica's /ready once."""

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

        await asyncio.gather(*(one(r) for r in self.all))

    async def watch(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll(client)
            await asyncio.sleep(POLL_S)
