"""Continuous batching: which requests compute how many tokens in the next step.

Order: a request's key is (`SamplingParams.priority`, arrival): lower priority numbers first,
then first come; a request keeps its key through loading and preemption. Each step has a token
budget (`max_num_batched_tokens`). Running requests that decode (one token each) come first, so
a long prompt never stalls streams already generating; then running prefills continue in
chunks; then waiting requests are admitted by key while budget, pages and `max_num_seqs` last
(the head that does not fit blocks the rest; admission never preempts). While more than one
request has prompt tokens to compute, a chunk takes at most `max_prefill_tokens_per_request`
(default half the budget). When a running request needs pages and none are free, the victim is
the running request with the largest key (lowest priority, newest) not yet in this step's plan:
its pages go back to the pool and it is recomputed later from its tokens (prompt + output so
far), so nothing is lost or emitted twice. If that is the request itself, a prefill chunk
shrinks to the pages free, else it waits (keeping its pages) behind a planned request of larger
key, else it is preempted. Only running and loading requests hold pages; waiting ones hold none.
So a step plans something whenever the pool could hold the first request alone.

Prefix cache: a request being admitted first takes the pages of its leading full pages
found in the device pool by content hash (shared, reference counted), then, once per
admission, asks the KV connector (host and Redis tiers) for the pages that follow. A lookup
runs off the step thread: the request is parked in `loading` while the others keep stepping,
and when the fetch completes (or at a deadline, with what had arrived) the pages are copied
in and named by their hash; the request then releases its pages (named pages stay revivable
in the pool's free list) and rejoins `waiting`, taking them back on admission. The deadline
gives the lookup as long as fetching is expected to beat recomputing (the connector's
measured cost against `recompute_s`), at most `lookup_timeout_s`; a remote tier is not even
asked when recomputing is cheaper. Pages matched in the pool or restored into it are
`touch`ed (the connector keeps their copies alive). Pages that fill up are named by their
hash once computed, and offered to the connector. (That side lives in
`engine/scheduler_prefix.py`.)

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

from engine.kv_connector import KVConnector, NoConnector
from engine.request import Request
from engine.scheduler_prefix import SALT_CACHE_SIZE, PrefixLookup, _Loading

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
        page_size: int,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        *,
        namespace: Namespace | None = None,
        connector: KVConnector | None = None,
        lookup_timeout_s: float = 5.0,
        max_prefill_tokens_per_request: int | None = None,
        recompute_s: Callable[[int], float] = lambda num_tokens: num_tokens / 1000.0,
        window: int | None = None,
    ):
        """Args:
        lookup_timeout_s: the longest a request waits for a connector lookup.
        max_prefill_tokens_per_request: a prefill chunk's cap while other requests also have
            prompt tokens to compute (None = half the step budget); alone, a prefill takes the budget.
        recompute_s: expected seconds to prefill this many tokens (`PrefillRate.seconds`).
        window: the largest sliding window when every layer has one (pages behind it are
            released as requests advance, and lookups address the tail); None keeps every page.
        """
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_prefill_tokens_per_request is not None and max_prefill_tokens_per_request < 1:
            raise ValueError(f"max_prefill_tokens_per_request must be >= 1, got {max_prefill_tokens_per_request}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 (or None), got {window}")
        self.pool = pool
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_share = max_prefill_tokens_per_request or max(1, max_num_batched_tokens // 2)
        self.namespace = namespace  # None: prefix caching off
        self.connector = connector or NoConnector()
        self.lookup_timeout_s = lookup_timeout_s
        self.recompute_s = recompute_s
        self.window = window
        self.num_reclaimed_pages = 0  # pages released behind a sliding window
        self.peak_request_pages = 0  # most live pages one request held in a step's plan
        self.waiting: list[Request] = []  # by key; none holds pages
        self.running: list[Request] = []  # by key: the last is the first to be preempted
        self.loading: list[_Loading] = []  # waiting for pages from the host or Redis tier
        self.num_preemptions = 0
        self.num_lookup_timeouts = 0
        self._arrivals = itertools.count()
        self._order: dict[Request, int] = {}  # arrival number, the second part of the key
        self._hashes: dict[Request, list[bytes]] = {}  # hashes of each request's full pages
        self._named: dict[Request, int] = {}  # leading pages already named (registered) in the pool
        self._looked_up: set[Request] = set()  # asked the connector since added or preempted: not again
        self._salts: OrderedDict[str, bytes] = OrderedDict()

    def add(self, req: Request) -> None:
        self._order[req] = next(self._arrivals)
        self._enqueue(req)

    def key(self, req: Request) -> tuple[int, int]:
        """(priority, arrival): smaller runs first; the largest is preempted first."""
        return req.params.priority, self._order[req]

    def _enqueue(self, req: Request) -> None:
        assert not req.pages and req.num_computed == 0, "a waiting request holds no pages"
        bisect.insort(self.waiting, req, key=self.key)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _pages_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.page_size) - len(req.pages)

    def _preempt(self, victim: Request) -> None:
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req in preempted:  # not back in the step that preempted it
                break
            if self._match_prefix(req):
                self.waiting.pop(0)  # parked in self.loading
                continue
            n = min(req.num_tokens - req.num_computed, budget, share)
            need = self._pages_needed(req, n)
            if need > self.pool.num_free:
                self._release(req)  # a waiting request holds no page: others may need them to finish
                break
            self.waiting.pop(0)
            if self.namespace is not None:
                self._count_admission(req)
            req.pages.append(self.pool.allocate(need))
            self.peak_request_pages = max(self.peak_request_pages, req.pages.num_live)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        self.running.sort(key=self.key)
        return chunks

    def _make_room(self, req: Request, n: int, planned: set[Request], preempted: set[Request]) -> int:
        """Pages for `n` tokens of a running request, preempting requests not in the plan; returns
        how many tokens it computes this step (0: it waits or was preempted)."""
        while self._pages_needed(req, n) > self.pool.num_free:
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

    def _poll_loading(self) -> None:
        now = time.monotonic()
        for item in list(self.loading):
            ready = item.fetch.ready()
            if ready or now >= item.deadline:
                self.loading.remove(item)
                self.num_lookup_timeouts += not ready
                self._complete(item.request, item.fetch, expired=not ready, start=item.start)
                # Back to waiting without pages (else a request put before it could wait forever
                # for them); its pages keep their names and come back by hash on admission.
                self._release(item.request)
                self._enqueue(item.request)

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
        for item in self.loading:
            if item.request is req:
                self.loading.remove(item)
                item.fetch.take(expired=True)
                break
        self._release(req)
        self._hashes.pop(req, None)
        self._looked_up.discard(req)
        self._order.pop(req, None)
