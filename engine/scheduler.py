"""Continuous batching: which requests compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`). Running requests that decode
(one token each) are scheduled first, so a long prompt never stalls the streams already
generating; then prompts being prefilled continue in chunks; then waiting requests are
admitted while budget and pages last. When pages run out, the newest running request is
preempted: its pages go back to the pool and it is recomputed later from its tokens
(prompt + output so far), so nothing is lost or emitted twice.

Prefix cache: a request being admitted first takes the pages of its leading full pages
found in the device pool by content hash (shared, reference counted), then asks the KV
connector (host and Redis tiers) for the pages that follow. A connector lookup runs off the
step thread: the request is parked in `loading` while the others keep stepping, and is
admitted when the fetch completes, or at a deadline with what had arrived: the deadline
gives the lookup as long as fetching is expected to beat recomputing (the connector's
measured cost against `recompute_s`), at most `lookup_timeout_s`. Pages matched in the
pool are `touch`ed (the connector keeps their copies alive). Pages that fill up are named
by their hash once computed, and offered to the connector.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from engine.kv_connector import KVConnector, NoConnector, PendingFetch, lookup_plan
from engine.request import Request
from kvstore.block_pool import BlockPool
from kvstore.prefix import Namespace, hash_page, max_cached_pages


class ScheduledChunk(NamedTuple):
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed
    sample: bool  # the chunk reaches the request's last token: sample its next one


class _Loading(NamedTuple):
    request: Request
    fetch: PendingFetch
    deadline: float  # time.monotonic() after which the fetch counts as a miss


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        page_size: int,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        *,
        namespace: Namespace | None = None,
        connector: KVConnector | None = None,
        lookup_timeout_s: float = 5.0,
        recompute_s: Callable[[int], float] = lambda num_tokens: num_tokens / 1000.0,
    ):
        """Args:
        lookup_timeout_s: the longest a request waits for a connector lookup.
        recompute_s: expected seconds to prefill this many tokens (`PrefillRate.seconds`).
        """
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.pool = pool
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.namespace = namespace  # None: prefix caching off
        self.connector = connector or NoConnector()
        self.lookup_timeout_s = lookup_timeout_s
        self.recompute_s = recompute_s
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order: the last is the first to be preempted
        self.loading: list[_Loading] = []  # waiting for pages from the host or Redis tier
        self.num_preemptions = 0
        self.num_lookup_timeouts = 0
        self._hashes: dict[Request, list[bytes]] = {}  # hashes of each request's full pages
        self._named: dict[Request, int] = {}  # leading pages already named (registered) in the pool
        self._matched: set[Request] = set()  # went through prefix matching since (re)admission
        self._salts: dict[str, bytes] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _pages_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.page_size) - len(req.pages)

    def _preempt(self, victim: Request) -> None:
        self.pool.free(victim.pages)
        victim.pages = []
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._named.pop(victim, None)
        self._matched.discard(victim)
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def schedule(self) -> list[ScheduledChunk]:
        self._poll_loading()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._pages_needed(req, n)
            while need > self.pool.num_free and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if need > self.pool.num_free:
                self._preempt(req)
                continue
            req.pages += self.pool.allocate(need)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req not in self._matched and self._match_prefix(req):
                self.waiting.popleft()  # parked in self.loading
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._pages_needed(req, n)
            if need > self.pool.num_free:
                self._unmatch(req)  # a waiting request holds no page: others may need them to finish
                break
            self.waiting.popleft()
            if self.namespace is not None:
                self._count_admission(req)
            req.pages += self.pool.allocate(need)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        self.running.sort(key=lambda r: r.arrival)
        return chunks

    # ---- prefix cache ----

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's page hashes, extended to at least `num_pages` full pages."""
        assert self.namespace is not None
        hashes = self._hashes.setdefault(req, [])
        if len(hashes) < num_pages:
            ns = self._salts.get(req.cache_salt)
            if ns is None:
                ns = self._salts[req.cache_salt] = self.namespace.salted(req.cache_salt)
            ps = self.page_size
            for i in range(len(hashes), num_pages):
                hashes.append(hash_page(hashes[i - 1] if i else b"", req.tokens(i * ps, (i + 1) * ps), ns))
        return hashes

    def _match_prefix(self, req: Request) -> bool:
        """Share the request's cached leading pages; returns True when it is parked for a fetch."""
        self._matched.add(req)
        if self.namespace is None or req.num_computed or req.pages:
            return False
        limit = max_cached_pages(req.num_tokens, self.page_size)
        hashes = self._page_hashes(req, limit)[:limit]
        req.pages = self.pool.match(hashes)
        if req.pages:
            self.connector.touch(hashes[: len(req.pages)], req.pages)
        req.num_computed = len(req.pages) * self.page_size
        self._named[req] = len(req.pages)
        fetch, wait = None, 0.0
        if len(req.pages) < limit:
            n = limit - len(req.pages)
            cost = self.connector.fetch_cost_s(n)
            remote, wait = lookup_plan(cost, self.recompute_s(n * self.page_size), self.lookup_timeout_s)
            fetch = self.connector.fetch(hashes[len(req.pages) :], remote=remote)
        if fetch is not None and not fetch.ready():
            self.loading.append(_Loading(req, fetch, time.monotonic() + wait))
            return True
        self._complete(req, fetch, expired=False)
        return False

    def _count_admission(self, req: Request) -> None:
        counters = self.pool.counters
        counters.queries += 1
        if req.num_computed:
            counters.hits += 1
            counters.hit_tokens += req.num_computed
        if req.num_preemptions == 0:
            req.cached_tokens = req.num_computed

    def _unmatch(self, req: Request) -> None:
        self.pool.free(req.pages)  # hashed pages stay revivable in the free list
        req.pages = []
        req.num_computed = 0
        self._named.pop(req, None)
        self._matched.discard(req)

    def _poll_loading(self) -> None:
        now = time.monotonic()
        for item in list(self.loading):
            ready = item.fetch.ready()
            if ready or now >= item.deadline:
                self.loading.remove(item)
                self.num_lookup_timeouts += not ready
                self._complete(item.request, item.fetch, expired=not ready)
                self.waiting.appendleft(item.request)

    def _complete(self, req: Request, fetch: PendingFetch | None, expired: bool) -> None:
        if fetch is not None:
            n = min(fetch.take(expired), self.pool.num_free)
            pages = self.pool.allocate(n)
            fetch.load(pages)
            hashes = self._hashes[req]
            start = len(req.pages)
            for i, page in enumerate(pages):
                self.pool.register(page, hashes[start + i])
            req.pages += pages
            req.num_computed = len(req.pages) * self.page_size
            self._named[req] = len(req.pages)

    def computed(self, reqs: list[Request]) -> None:
        """After a step: name the pages that became full and offer them to the connector."""
        if self.namespace is None:
            return
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

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's pages, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        for item in self.loading:
            if item.request is req:
                self.loading.remove(item)
                item.fetch.take(expired=True)
                break
        self.pool.free(req.pages)
        req.pages = []
        self._hashes.pop(req, None)
        self._named.pop(req, None)
        self._matched.discard(req)
