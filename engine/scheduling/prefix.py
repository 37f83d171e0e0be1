"""The scheduler's prefix-cache side: page hashes, matching a request's cached pages (leading
ones, or for an all-windowed model the window at its tail) in the device pool and through
the KV connector, loading what a lookup fetched, and naming pages as they fill.

Hashes are computed once per page, when the page is first needed (admission) or fills (after
a step); nothing here walks a request's pages per step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from engine.kv_connector import KVConnector, NoConnector, PendingFetch, lookup_plan
from engine.request import Request
from engine.scheduling.page_table import PageTable
from kvstore.block_pool import BlockPool
from kvstore.prefix import Namespace, find_tail, hash_page, max_cached_pages

SALT_CACHE_SIZE = 4096  # tenants whose salted namespace digest is kept (LRU)
PREFETCH_DEPTH = 8  # waiting requests, next in line, whose pages may be read ahead at once
# Why pages a tier returned were not used (`longctx:kv_restored_unused_pages_total{reason}`):
UNUSED_REASONS = (
    "no_room",  # more arrived than the device pages taken for them
    "unpinned",  # restored for a waiting request that gave them up for a running one
    "pin_budget",  # restored for a waiting request past the budget of pinned pages
    "aborted",  # the request ended while loading or pinned
)

log = logging.getLogger("longctx.engine.scheduler")


class _Loading(NamedTuple):
    request: Request
    fetch: PendingFetch
    deadline: float  # time.monotonic() after which the fetch counts as a miss
    start: int  # index in the request's page hashes of the first hash the fetch was given
    pages: list[int] | None = None  # device pages taken for the fetch when it started (no window)


READY = "ready"  # matched (and restored what was at hand): try to admit it now
PARKED = "parked"  # a fetch runs: the request waits in `loading`
BLOCKED = "blocked"  # no room yet to restore its pages: it waits at the head, nothing fetched


class PrefixLookup:
    """Mixed into `Scheduler`, whose state it reads and updates."""

    pool: BlockPool
    page_size: int
    namespace: Namespace | None
    connector: KVConnector
    lookup_timeout_s: float
    recompute_s: Callable[[int], float]
    window: int | None
    loading: list[_Loading]
    _hashes: dict[Request, list[bytes]]
    _named: dict[Request, int]
    _looked_up: set[Request]
    _prefetched: dict[Request, int]
    waiting: list[Request]
    _salts: OrderedDict[str, bytes]
    _pinned: dict[Request, None]  # waiting requests holding their matched and restored pages
    max_pinned_pages: int
    _promised: int  # free pages the running prefills will take for the rest of their prompts
    _restored: dict[Request, int]  # pages restored from a tier that the request holds
    unused_pages: dict[str, int]  # restored pages not used, by reason (UNUSED_REASONS)

    def _release(self, req: Request) -> None:  # the Scheduler's: free the pages, forget the progress
        raise NotImplementedError

    def _others_busy(self, req: Request) -> bool:  # the Scheduler's: anything but `req` holds pages
        raise NotImplementedError

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's page hashes, extended to at least `num_pages` full pages."""
        assert self.namespace is not None
        hashes = self._hashes.setdefault(req, [])
        if len(hashes) < num_pages:
            ns = self._salted(req.cache_salt)
            ps = self.page_size
            images = req.images
            for i in range(len(hashes), num_pages):
                extra = images.page_extra(i, ps) if images is not None else b""
                hashes.append(hash_page(hashes[i - 1] if i else b"", req.tokens(i * ps, (i + 1) * ps), ns, extra))
        return hashes

    def _salted(self, cache_salt: str) -> bytes:
        """The tenant's namespace digest, from a bounded LRU (one entry per recent tenant)."""
        assert self.namespace is not None
        ns = self._salts.get(cache_salt)
        if ns is not None:
            self._salts.move_to_end(cache_salt)
            return ns
        ns = self._salts[cache_salt] = self.namespace.salted(cache_salt)
        if len(self._salts) > SALT_CACHE_SIZE:
            self._salts.popitem(last=False)
        return ns

    def first_needed(self, position: int) -> int:
        """The first logical page a query at `position` (or later) reads: 0 without a window."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.page_size

    def _match_prefix(self, req: Request) -> str:
        """Share the request's cached pages and start its lookup: `READY` (try to admit it now),
        `PARKED` (a fetch runs: it waits in `loading`) or `BLOCKED` (the pool has no room yet
        for the pages it would restore: nothing is fetched, it waits at the head)."""
        if self.namespace is None:
            return READY
        limit = max_cached_pages(req.num_tokens, self.page_size)
        hashes = self._page_hashes(req, limit)
        if self.window is not None:
            assert not req.pages and req.num_computed == 0
            return PARKED if self._match_tail(req, hashes, limit) else READY
        held = len(req.pages)  # a pinned request's pages: match on after them
        if held < limit:
            more = self.pool.match(hashes[held:limit])
            if more:
                req.pages.append(more)
                self.connector.touch(hashes[held : held + len(more)], more)
        found = len(req.pages)
        req.num_computed = found * self.page_size
        self._named[req] = found
        if req in self._looked_up or found >= limit or isinstance(self.connector, NoConnector):
            return READY
        n = limit - found
        room = self._lookup_room(req, n)
        if room is None:
            return BLOCKED
        self._looked_up.add(req)
        self._prefetched.pop(req, None)  # what was read ahead for it is taken now (or never)
        if room == 0:
            return READY
        cost = self.connector.fetch_cost_s(n)
        remote, wait = lookup_plan(cost, self.recompute_s(n * self.page_size), self.lookup_timeout_s)
        fetch = self.connector.fetch(hashes[found : found + room], remote=remote)
        if fetch is None:
            return READY
        if fetch.ready():  # what was at hand (host memory): exactly the pages that came back
            self._complete(req, fetch, expired=False, start=found, cap=room)
            return READY
        # The fetch's pages are taken now: nothing else can reclaim them before it is admitted,
        # and the fetch may copy pages into them as they arrive.
        pages = self.pool.allocate(room)
        fetch.copy_into(pages)
        self.loading.append(_Loading(req, fetch, time.monotonic() + wait, found, pages))
        return PARKED

    def _prefetch_waiting(self) -> None:
        """Read ahead, from Redis into host memory, the pages of the waiting requests next in
        line (key order, `PREFETCH_DEPTH` at most) that have not been looked up yet, within the
        connector's staging budget, while fetching them is expected to beat recomputing: the
        pool has no room for them now, and when it has, their lookup finds the pages at hand
        instead of waiting for Redis after the queue already made them wait."""
        if self.namespace is None or self.window is not None:
            return
        budget = self.connector.prefetch_pages()
        if budget <= 0:
            return
        used = sum(self._prefetched.values())
        for req in self.waiting[:PREFETCH_DEPTH]:
            if used >= budget:
                return
            if req in self._prefetched or req in self._looked_up or req in self._pinned:
                continue
            limit = max_cached_pages(req.num_tokens, self.page_size)
            hashes = self._page_hashes(req, limit)
            found = self.pool.num_cached(hashes)
            n = min(limit - found, budget - used)
            worth = n > 0 and self.connector.fetch_cost_s(n) < self.recompute_s(n * self.page_size)
            started = worth and self.connector.prefetch(hashes[found : found + n])
            self._prefetched[req] = n if started else 0
            used += self._prefetched[req]

    def _lookup_room(self, req: Request, n: int) -> int | None:
        """How many of the `n` pages after a request's cached ones its lookup may take: all `n`
        when the pool has them free (beyond what running prefills will take) and the pages held
        for waiting and loading requests stay within `max_pinned_pages`; what is free when
        nothing else holds pages; else None (wait: restoring now would only push pages out
        that others, or itself, need)."""
        free = self.pool.num_free
        if not self._others_busy(req):
            return min(n, free)
        held = sum(r.pages.num_live for r in self._pinned if r is not req)
        held += sum(item.request.pages.num_live + len(item.pages or ()) for item in self.loading)
        within = not held or held + req.pages.num_live + n <= self.max_pinned_pages
        if n <= free - self._promised and within:
            return n
        return None

    def _hold(self, req: Request) -> None:
        """A waiting request that cannot be admitted yet keeps its pages (pinned) while the pages
        held for waiting and loading requests stay within `max_pinned_pages`: pages it keeps
        cannot be reclaimed by others before it runs. Past the budget it keeps its leading pages
        that fit and releases the rest (named, revivable)."""
        if self.window is not None or not req.pages:
            self._pinned.pop(req, None)
            self._release(req)
            return
        held = sum(r.pages.num_live for r in self._pinned if r is not req)
        held += sum(item.request.pages.num_live + len(item.pages or ()) for item in self.loading)
        keep = max(0, min(len(req.pages), self.max_pinned_pages - held))
        if keep < len(req.pages):
            self._looked_up.discard(req)  # what it let go may come back from a tier later
            restored = self._restored.get(req, 0)
            dropped = min(len(req.pages) - keep, restored)  # restored pages come last
            self.unused_pages["pin_budget"] += dropped
            self._restored[req] = restored - dropped
            pages = req.pages.clear()
            self.pool.free(pages[keep:])
            req.pages = PageTable(pages[:keep])
            req.num_computed = keep * self.page_size
            self._named[req] = keep
        if keep:
            self._pinned[req] = None
        else:
            self._pinned.pop(req, None)
            self._release(req)

    def _swap_out(self, req: Request) -> None:
        """A request about to give its pages up (preempted, or unpinned): offer its named pages
        to the connector before they are freed (`KVConnector.swap_out`), when reading them back
        is expected to beat recomputing them (the tier's measured cost against `recompute_s`)."""
        if self.namespace is None:
            return
        first, named = req.pages.first, self._named.get(req, 0)
        n = named - first
        if n <= 0 or self.connector.fetch_cost_s(n) >= self.recompute_s(named * self.page_size):
            return
        self.connector.swap_out(self._hashes[req][first:named], [req.pages[i] for i in range(first, named)])

    def _unpin(self, req: Request) -> None:
        """A pinned request gives its pages up (named: revivable in the pool, kept by the tiers
        once reused) and may look its pages up again when it comes to the head."""
        del self._pinned[req]
        self.unused_pages["unpinned"] += self._restored.get(req, 0)
        self._swap_out(req)
        self._release(req)
        self._looked_up.discard(req)

    def _match_tail(self, req: Request, hashes: list[bytes], limit: int) -> bool:
        """A windowed model's lookup: resume at the furthest point whose window pages are at hand
        (device pool first); ask the connector for a further one, fetching only its window."""
        k = self._device_tail(hashes, limit)
        self._take_tail(req, hashes, k)
        if req in self._looked_up or k >= limit:
            return False
        self._looked_up.add(req)
        S = self.page_size
        window_pages = limit - max(k, self.first_needed(limit * S))
        cost = self.connector.fetch_cost_s(window_pages)
        remote, wait = lookup_plan(cost, self.recompute_s((limit - k) * S), self.lookup_timeout_s)
        fetch = self.connector.fetch_tail(hashes[:limit], lambda n: self.first_needed(n * S), k, remote=remote)
        if fetch is not None and not fetch.ready():
            self.loading.append(_Loading(req, fetch, time.monotonic() + wait, 0))
            return True
        if fetch is not None:
            self._complete(req, fetch, expired=False, start=0)
            self._release(req)  # the fetched pages are named in the pool now: match again
            self._take_tail(req, hashes, self._device_tail(hashes, limit))
        return False

    def _device_tail(self, hashes: list[bytes], limit: int, beyond: int = 0) -> int:
        """The furthest resume point (in pages, at most `limit`) whose window pages are all in
        the device pool: O(window + pages after it) lookups."""
        cached, S = self.pool.cached, self.page_size
        return find_tail(limit, lambda k: self.first_needed(k * S), lambda i: hashes[i] in cached, beyond)

    def _take_tail(self, req: Request, hashes: list[bytes], k: int) -> None:
        """Share the window pages of resume point `k` (all in the pool) and resume there."""
        first = self.first_needed(k * self.page_size)
        pages = []
        for h in hashes[first:k]:
            page = self.pool.cached[h]
            self.pool.share(page)
            pages.append(page)
        req.pages = PageTable(pages, first)
        if pages:
            self.connector.touch(hashes[first:k], pages)
        req.num_computed = k * self.page_size
        self._named[req] = k

    def _count_admission(self, req: Request) -> None:
        counters = self.pool.counters
        counters.queries += 1
        if req.num_computed:
            counters.hits += 1
            counters.hit_tokens += req.pages.num_live * self.page_size  # pages found
            counters.skipped_tokens += req.pages.first * self.page_size  # behind the window: not read
        if req.num_preemptions == 0:
            req.cached_tokens = req.num_computed
            req.loaded_tokens = self._restored.get(req, 0) * self.page_size
            req.recomputed_tokens = max(0, len(req.prompt_ids) - req.num_computed)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "request %s admitted: %d prompt tokens, %d cached (%d from the device pool, %d loaded "
                    "from a tier), %d recomputed; found in the host tier %d, in Redis %d",
                    req.id,
                    len(req.prompt_ids),
                    req.cached_tokens,
                    req.cached_tokens - req.loaded_tokens,
                    req.loaded_tokens,
                    req.recomputed_tokens,
                    req.found_host_tokens,
                    req.found_redis_tokens,
                )

    def _complete(
        self,
        req: Request,
        fetch: PendingFetch | None,
        expired: bool,
        start: int,
        pages: list[int] | None = None,
        cap: int | None = None,
    ) -> None:
        """Load the fetched pages (page hashes `start ..`) and name them in the pool, into
        `pages` (taken when the fetch started; those not filled go back) or into pages taken
        now (at most `cap`). Without a window they extend the request's pages; with one they
        are left in the pool (named, revivable) for `_device_tail` to find."""
        if fetch is None:
            if pages:
                self.pool.free(pages)
            return
        arrived = fetch.take(expired)
        from_host, from_remote = fetch.sources()
        req.found_host_tokens += from_host * self.page_size
        req.found_redis_tokens += from_remote * self.page_size
        if pages is not None:
            n = min(arrived, len(pages))
            self.pool.free(pages[n:])
            pages = pages[:n]
        else:
            pages = self.pool.allocate(min(arrived, self.pool.num_free, arrived if cap is None else cap))
        self.unused_pages["no_room"] += arrived - len(pages)
        fetch.load(pages)
        start += fetch.offset  # a tail fetch's pages start inside the hashes it was given
        hashes = self._hashes[req]
        named_hashes, named_pages = [], []
        for i, page in enumerate(pages):
            if self.pool.register(page, hashes[start + i]):
                named_hashes.append(hashes[start + i])
                named_pages.append(page)
        if named_pages:  # restored pages are used again, like matched ones
            self.connector.touch(named_hashes, named_pages)
        if self.window is not None:
            self.pool.free(pages)
            return
        req.pages.append(pages)
        self._restored[req] = self._restored.get(req, 0) + len(pages)
        req.num_computed = len(req.pages) * self.page_size
        self._named[req] = len(req.pages)

    def _name_full_pages(self, reqs: list[Request]) -> None:
        new_hashes: list[bytes] = []
        new_pages: list[int] = []
        for req in reqs:
            full = req.num_computed // self.page_size
            start = self._named.get(req, 0)
            if full <= start:
                continue
            hashes = self._page_hashes(req, full)
            for i in range(start, full):
                if self.pool.register(req.pages[i], hashes[i]):
                    new_hashes.append(hashes[i])
                    new_pages.append(req.pages[i])
            self._named[req] = full
        if new_pages:
            self.connector.save(new_hashes, new_pages)
