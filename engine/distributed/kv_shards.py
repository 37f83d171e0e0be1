"""The host and Redis KV tiers on a sharded model: every rank keeps its own slice of each page.

A page's content hash is computed once, by rank 0's scheduler; each rank stores its slice
(its KV heads, its stage's layers) under that hash in a namespace of its own
(`Namespace.tp_rank`, `Namespace.pp_rank`, and the digest of the weights it read), so Redis
holds one value per page per rank. Rank 0 drives everything:
its `ShardedConnector` does what the connector is asked locally and queues the same operation
for the other ranks (`ShardOps`), which replay it before their next step (`ShardStore`). A
lookup is the one operation that needs answers: when rank 0 takes a fetch, every rank says how
many leading pages it holds and the smallest count wins (an all-reduce), so a page is used only
if every rank has its slice. The same goes for a turn's commit wait (every rank's writes).

Not sharded: the tail lookup of a model whose every layer has a sliding window (`fetch_tail`
finds nothing; such a model recomputes on a sharded engine).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engine.distributed.parallel import ParallelContext
from kvstore.tiers import TieredStore

log = logging.getLogger("longctx.distributed")

MAX_OPEN_FETCHES = 4096  # a worker forgets the oldest lookups past this (abandoned by rank 0)


class ShardOps:
    """Connector operations queued for the other ranks, in the order rank 0 did them; they
    travel with the next step's plan, or at once when rank 0 needs the ranks' answer."""

    def __init__(self, parallel: ParallelContext):
        self.parallel = parallel
        self.pending: list[tuple[Any, ...]] = []

    def add(self, op: tuple[Any, ...]) -> None:
        self.pending.append(op)

    def take(self) -> list[tuple[Any, ...]]:
        ops, self.pending = self.pending, []
        return ops

    def flush(self) -> None:
        """Send the queued operations now (an `ops` message between steps)."""
        if self.pending:
            self.parallel.broadcast_object(("ops", self.take()))

    def agree(self, op: tuple[Any, ...], mine: int) -> int:
        """Send `op` (after those queued) and return the smallest of every rank's answer to it."""
        self.add(op)
        self.flush()
        return min_over_ranks(self.parallel, mine)


def min_over_ranks(parallel: ParallelContext, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parallel.world if parallel.world is not None else parallel.group)
    return int(t.item())


class ShardedFetch:
    """Rank 0's lookup: its own, plus the same lookup on every other rank."""

    def __init__(self, connector: ShardedConnector, local: Any, fid: int):
        self.connector, self.local, self.fid = connector, local, fid
        self.offset = 0
        self.count = 0

    def ready(self) -> bool:
        return bool(self.local.ready())

    def take(self, expired: bool) -> int:
        mine = self.local.take(expired)
        self.count = self.connector.ops.agree(("take", self.fid, expired), mine)
        return self.count

    def sources(self) -> tuple[int, int]:
        host, _ = self.local.sources()
        host = min(host, self.count)
        return host, self.count - host

    def copy_into(self, pages: list[int]) -> None:
        self.local.copy_into(pages)  # rank 0's own; the other ranks copy theirs at `load`

    def load(self, pages: list[int]) -> None:
        self.local.load(pages)
        self.connector.ops.add(("load", self.fid, list(pages)))


class ShardedConnector:
    """Rank 0's KV connector: its own tiers (`store`), mirrored on every rank."""

    def __init__(self, store: TieredStore, ops: ShardOps):
        self.store, self.ops = store, ops
        self._ids = itertools.count()

    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> ShardedFetch | None:
        local = self.store.fetch(page_hashes, remote)
        if local is None:  # every rank has the same tiers: none would look
            return None
        fid = next(self._ids)
        self.ops.add(("fetch", fid, list(page_hashes), remote))
        self.ops.flush()  # the other ranks start looking now, not at the next step
        return ShardedFetch(self, local, fid)

    def fetch_tail(
        self, page_hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool = True
    ) -> None:
        return None

    def fetch_cost_s(self, num_pages: int) -> float:
        return self.store.fetch_cost_s(num_pages)

    def prefetch_pages(self) -> int:
        return 0  # every rank would have to read ahead the same pages: not done sharded

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        return False

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        self.store.save(page_hashes, pages)
        self.ops.add(("save", list(page_hashes), list(pages)))

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        self.ops.add(("swap_out", list(page_hashes), list(pages)))
        return self.store.swap_out(page_hashes, pages)

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        self.store.touch(page_hashes, pages)
        self.ops.add(("touch", list(page_hashes), list(pages)))

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        self.store.evict(evicted)
        self.ops.add(("evict", list(evicted)))

    def commit_wait(self, timeout_s: float) -> bool:
        """Every rank's queued pages written within `timeout_s` (on the stepping thread)."""
        mine = self.store.redis.commit_wait(timeout_s) if self.store.redis is not None else True
        return bool(self.ops.agree(("commit", timeout_s), int(mine)))


class ShardStore:
    """A worker rank's tiers, replaying rank 0's connector operations on its own slices."""

    def __init__(self, store: TieredStore, parallel: ParallelContext, lookup_timeout_s: float):
        self.store, self.parallel = store, parallel
        self.lookup_timeout_s = lookup_timeout_s
        self.fetches: OrderedDict[int, Any] = OrderedDict()

    def apply(self, ops: list[tuple[Any, ...]]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "fetch":
                _, fid, hashes, remote = op
                self.fetches[fid] = self.store.fetch(hashes, remote)
                while len(self.fetches) > MAX_OPEN_FETCHES:
                    self.fetches.popitem(last=False)
            elif kind == "take":
                min_over_ranks(self.parallel, self._take(op[1], op[2]))
            elif kind == "load":
                fetch = self.fetches.pop(op[1], None)
                if fetch is not None and op[2]:
                    fetch.load(op[2])
            elif kind == "save":
                self.store.save(op[1], op[2])
            elif kind == "touch":
                self.store.touch(op[1], op[2])
            elif kind == "swap_out":
                self.store.swap_out(op[1], op[2])
            elif kind == "evict":
                self.store.evict(op[1])
            elif kind == "commit":
                redis = self.store.redis
                min_over_ranks(self.parallel, int(redis.commit_wait(op[1]) if redis is not None else True))
            else:
                raise ValueError(f"unknown KV operation {kind!r}")

    def _take(self, fid: int, expired: bool) -> int:
        fetch = self.fetches.get(fid)
        if fetch is None:
            return 0
        if not expired and fetch.remote is not None:  # rank 0's came back: ours should be close
            try:
                fetch.remote.result(timeout=self.lookup_timeout_s)
            except Exception:  # a late or failed lookup counts what arrived
                log.debug("rank %d: lookup %d not done in time", self.parallel.global_rank, fid)
        return int(fetch.take(expired))

    def close(self) -> None:
        self.store.close()
