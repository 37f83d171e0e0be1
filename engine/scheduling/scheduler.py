"""Continuous batching: which requests compute how many tokens in the next step.

Order: a request's key is (`SamplingParams.priority`, arrival): lower priority numbers first,
then first come; a request keeps its key through loading and preemption. Each step has a token
budget (`max_num_batched_tokens`). Running requests that decode (one token each) come first, so
a long prompt never stalls streams already generating; then running prefills continue in
chunks; then waiting requests are admitted while budget, pages and `max_num_seqs` last: first
the pinned ones (holding pages restored for them, below), by key, then the others by key (the
one that does not fit blocks the rest; admission never preempts). Admission is bounded by what
a request will need: while others run, its whole prompt's pages must be free beyond the pages
the running prefills will still take (`_promised`), so the scheduler runs fewer requests at
once rather than admitting one whose growth would preempt another and push its pages out.
While more than one request has prompt tokens to compute, a chunk takes at most
`max_prefill_tokens_per_request` (default half the budget). When a running request needs pages
and none are free, pinned waiting requests give theirs up first (largest key first); then the
victim is the running request with the largest key (lowest priority, newest) not yet in this
step's plan: its pages go back to the pool (named: revivable; copied to the host tier when
reused; with Redis the only lower tier, those Redis lacks are first handed to its writer, when
reading them back beats recomputing: `_swap_out`) and it is resumed later from its tokens
(prompt + output so far) and the pages it finds again, so nothing is lost or emitted twice. If
that is the request itself, a prefill chunk shrinks to the pages free, else it waits (keeping
its pages) behind a planned request of larger key, else it is preempted. Running and loading
requests hold pages, and waiting ones only while pinned. So a step plans something whenever the
pool could hold the first request alone (when nothing runs or loads, pinned requests give way
to the one being admitted).

Prefix cache: a request being admitted first takes the pages of its leading full pages
found in the device pool by content hash (shared, reference counted), then, once per
admission, asks the KV connector (host and Redis tiers) for the pages that follow. A lookup
starts only when the pool has room for the pages it would restore (free beyond `_promised`,
and within `max_pinned_pages` for all waiting and loading requests together, unless nothing
else holds pages); else the request waits at the head (`BLOCKED`), and the pages of the next
requests in line are read ahead into host memory meanwhile (`_prefetch_waiting`: the
connector's `prefetch`), so that their lookup finds them at hand once admitted. The device pages a remote
fetch fills are taken when it starts, so nothing can reclaim them meanwhile. It runs off the
step thread: the request is parked in `loading` while the others keep stepping, and when the
fetch completes (or at a deadline, with what had arrived) the pages are copied in and named by
their hash; the request rejoins `waiting` pinned, holding them, and is admitted before the
others. (Without pins, restored pages went back to the LRU free list, where the next fetch's or
step's allocations reclaimed them before the request was admitted; looked up once, it then
recomputed its whole history: under pressure every later turn found one page.) A pinned request
that gives its pages up may look them up again. The deadline gives the lookup as long as
fetching is expected to beat recomputing (the connector's measured cost against `recompute_s`),
at most `lookup_timeout_s`; a remote tier is not even asked when recomputing is cheaper. Pages
matched in the pool or restored into it are `touch`ed (the connector keeps their copies alive).
Pages that fill up are named by their hash once computed, and offered to the connector. (That
side lives in `engine/scheduling/prefix.py`.)

Sliding windows (`window`: set when every layer of the model has one, to the largest): a
running request releases its pages older than the window of its next token as it advances
(after naming them, so they stay revivable in the pool and reach the tiers), holding about
`window / page_size` pages plus the pages of its current chunk at any length. Its prefix
lookup then addresses the tail: the resume point is the furthest page boundary whose window
pages are all in the device pool (`_device_tail`), and the connector (`fetch_tail`) looks
for a further one and reads only that point's window, never the pages before it.

Per-step work is independent of context length: page tables are appended to and released at
the front (`PageTable`), page hashes are computed once per page as it fills, and no step walks
a request's pages.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from engine.engine_config import EngineConfig
from engine.kv_connector import KVConnector, NoConnector
from engine.request import Request
from engine.scheduling.prefix import BLOCKED, PARKED, SALT_CACHE_SIZE, UNUSED_REASONS, PrefixLookup, _Loading

__all__ = ["SALT_CACHE_SIZE", "ScheduledChunk", "Scheduler"]
from kvstore.block_pool import BlockPool
from kvstore.prefix import Namespace


class ScheduledChunk(NamedTuple):
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed
    sample: bool  # the chunk reaches the request's last token: sample its next one


class Scheduler(PrefixLookup):
    def __init__(
        self,
        pool: BlockPool,
        config: EngineConfig,
        *,
        namespace: Namespace | None = None,
        connector: KVConnector | None = None,
        recompute_s: Callable[[int], float] = lambda num_tokens: num_tokens / 1000.0,
        window: int | None = None,
        max_pinned_fraction: float = 0.5,
    ):
        """Args:
        config: the engine's settings; this reads `page_size`, `max_num_batched_tokens`,
            `max_num_seqs`, `max_prefill_tokens_per_request` (a prefill chunk's cap while other
            requests also have prompt tokens to compute; None = half the step budget; alone, a
            prefill takes the budget) and `kv_lookup_timeout_s` (the longest a request waits
            for a connector lookup).
        recompute_s: expected seconds to prefill this many tokens (`PrefillRate.seconds`).
        window: the largest sliding window when every layer has one (pages behind it are
            released as requests advance, and lookups address the tail); None keeps every page.
        max_pinned_fraction: the share of the pool that waiting and loading requests may hold
            (their matched and restored pages, kept for them until they are admitted).
        """
        assert window is None or window >= 1, window
        assert 0.0 <= max_pinned_fraction <= 1.0, max_pinned_fraction
        self.pool = pool
        self.page_size = config.page_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.prefill_share = config.max_prefill_tokens_per_request or max(1, config.max_num_batched_tokens // 2)
        self.namespace = namespace  # None: prefix caching off
        self.connector = connector or NoConnector()
        self.lookup_timeout_s = config.kv_lookup_timeout_s
        self.recompute_s = recompute_s
        self.window = window
        self.num_reclaimed_pages = 0  # pages released behind a sliding window
        self.peak_request_pages = 0  # most live pages one request held in a step's plan
        self.max_pinned_pages = int(max_pinned_fraction * pool.num_pages)
        self.waiting: list[Request] = []  # by key; only the pinned ones hold pages
        self._pinned: dict[Request, None] = {}  # waiting requests holding their cached pages
        self._promised = 0  # free pages the running prefills will take (set each step)
        self.num_unpinned = 0  # pinned requests that gave their pages up for a running one
        self._restored: dict[Request, int] = {}  # pages restored from a tier that the request holds
        self.unused_pages = dict.fromkeys(UNUSED_REASONS, 0)  # restored pages not used, by reason
        self.running: list[Request] = []  # by key: the last is the first to be preempted
        self.loading: list[_Loading] = []  # waiting for pages from the host or Redis tier
        self.num_preemptions = 0
        self.num_lookup_timeouts = 0
        self._arrivals = itertools.count()
        self._order: dict[Request, int] = {}  # arrival number, the second part of the key
        self._hashes: dict[Request, list[bytes]] = {}  # hashes of each request's full pages
        self._named: dict[Request, int] = {}  # leading pages already named (registered) in the pool
        self._looked_up: set[Request] = set()  # asked the connector since added or preempted: not again
        self._prefetched: dict[Request, int] = {}  # waiting requests whose pages are read ahead: how many
        self._salts: OrderedDict[str, bytes] = OrderedDict()

    def add(self, req: Request) -> None:
        self._order[req] = next(self._arrivals)
        self._enqueue(req)

    def key(self, req: Request) -> tuple[int, int]:
        """(priority, arrival): smaller runs first; the largest is preempted first."""
        return req.params.priority, self._order[req]

    def _enqueue(self, req: Request) -> None:
        assert (not req.pages and req.num_computed == 0) or req in self._pinned, "only pinned waiting ones hold pages"
        bisect.insort(self.waiting, req, key=self.key)

    def _others_busy(self, req: Request) -> bool:
        """Something besides `req` holds pages: running, loading or pinned requests."""
        return bool(self.running or self.loading or any(r is not req for r in self._pinned))

    @property
    def pinned(self) -> list[Request]:
        """Waiting requests holding pages restored or matched for them."""
        return list(self._pinned)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _pages_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.page_size) - len(req.pages)

    def _preempt(self, victim: Request) -> None:
        self._swap_out(victim)  # with Redis the only lower tier: its pages Redis lacks go to the writer
        self._release(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._looked_up.discard(victim)  # its pages may have moved to the host tier meanwhile
        self.running.remove(victim)
        self._enqueue(victim)

    def schedule(self) -> list[ScheduledChunk]:
        self._poll_loading()
        budget = self.max_num_batched_tokens
        prefills = sum(r.num_tokens - r.num_computed > 1 for r in self.running) + len(self.waiting) + len(self.loading)
        share = self.prefill_share if prefills > 1 else budget
        chunks: list[ScheduledChunk] = []
        planned: set[Request] = set()
        preempted: set[Request] = set()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req in preempted:
                continue
            n = self._make_room(req, min(req.num_tokens - req.num_computed, budget, share), planned, preempted)
            if n == 0:
                continue
            req.pages.append(self.pool.allocate(self._pages_needed(req, n)))
            self.peak_request_pages = max(self.peak_request_pages, req.pages.num_live)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            planned.add(req)
            budget -= n
        self._promised = sum(self._pages_needed(r, r.num_tokens - r.num_computed) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # Requests holding their restored pages go first (in key order), then the head.
            req = min(self._pinned, key=self.key) if self._pinned else self.waiting[0]
            if req in preempted:  # not back in the step that preempted it
                break
            state = self._match_prefix(req)
            if state == PARKED:
                self.waiting.remove(req)  # parked in self.loading
                self._pinned.pop(req, None)
                self._prefetched.pop(req, None)
                continue
            if state == BLOCKED:
                others = [r for r in self._pinned if r is not req]
                if not self.running and not self.loading and others:  # idle: they give way
                    self._unpin(max(others, key=self.key))
                    continue
                self._hold(req)
                break
            n = min(req.num_tokens - req.num_computed, budget, share)
            need = self._pages_needed(req, n)
            if not self.running and not self.loading:  # idle: pinned others give way to it
                others = sorted((r for r in self._pinned if r is not req), key=self.key)
                while need > self.pool.num_free and others:
                    self._unpin(others.pop())
            # Bounded by the pages its whole prompt needs: admitting more than the pool can
            # carry would preempt a running request and push its pages out.
            rest = self._pages_needed(req, req.num_tokens - req.num_computed)
            if need > self.pool.num_free or (self.running and rest > self.pool.num_free - self._promised):
                self._hold(req)  # keeps its pages while waiting (within the budget)
                break
            self.waiting.remove(req)
            self._pinned.pop(req, None)
            self._prefetched.pop(req, None)
            if self.namespace is not None:
                self._count_admission(req)
            req.pages.append(self.pool.allocate(need))
            self._promised += rest - need
            self.peak_request_pages = max(self.peak_request_pages, req.pages.num_live)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        self.running.sort(key=self.key)
        if self.waiting:
            self._prefetch_waiting()
        return chunks

    def _make_room(self, req: Request, n: int, planned: set[Request], preempted: set[Request]) -> int:
        """Pages for `n` tokens of a running request, preempting requests not in the plan; returns
        how many tokens it computes this step (0: it waits or was preempted)."""
        while self._pages_needed(req, n) > self.pool.num_free:
            if self._pinned:  # a waiting request's kept pages go before a running one's
                self._unpin(max(self._pinned, key=self.key))
                self.num_unpinned += 1
                continue
            victim = max((r for r in self.running if r not in planned), key=self.key)
            if victim is not req:
                self._preempt(victim)
                preempted.add(victim)
                continue
            room = (len(req.pages) + self.pool.num_free) * self.page_size - req.num_computed
            if room > 0:
                return room  # a shorter prefill chunk
            if not any(self.key(r) > self.key(req) for r in planned):
                self._preempt(req)  # the newest of all: its pages let the older ones go on
                preempted.add(req)
            return 0  # else it waits for a newer planned request to finish or to be preempted
        return n

    def _release(self, req: Request) -> None:
        self.pool.free(req.pages.clear())  # named pages stay revivable in the free list
        req.num_computed = 0
        self._named.pop(req, None)
        self._restored.pop(req, None)

    def _poll_loading(self) -> None:
        now = time.monotonic()
        for item in list(self.loading):
            ready = item.fetch.ready()
            if ready or now >= item.deadline:
                self.loading.remove(item)
                self.num_lookup_timeouts += not ready
                req = item.request
                self._complete(req, item.fetch, expired=not ready, start=item.start, pages=item.pages)
                if self.window is None and req.pages:
                    # Back to waiting holding what it restored (pinned: its pages were taken
                    # within the budget when the fetch started), admitted before the others.
                    self._pinned[req] = None
                else:
                    # A windowed request goes back without pages; they keep their names and
                    # come back by hash on admission.
                    self._release(req)
                self._enqueue(req)

    def computed(self, reqs: list[Request]) -> None:
        """After a step: name the pages that became full and offer them to the connector; with a
        window, release the pages the requests' next tokens no longer read."""
        if self.namespace is not None:
            self._name_full_pages(reqs)
        if self.window is not None:
            for req in reqs:
                released = req.pages.release_front(self.first_needed(req.num_computed))
                if released:
                    self.pool.free(released)
                    self.num_reclaimed_pages += len(released)

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's pages, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if self._pinned.pop(req, 0) is None:  # pinned: what it restored is left unused
                self.unused_pages["aborted"] += self._restored.get(req, 0)
        for item in self.loading:
            if item.request is req:
                self.loading.remove(item)
                self.unused_pages["aborted"] += item.fetch.take(expired=True)
                if item.pages:
                    self.pool.free(item.pages)
                break
        self._release(req)
        self._hashes.pop(req, None)
        self._looked_up.discard(req)
        self._prefetched.pop(req, None)
        self._order.pop(req, None)
