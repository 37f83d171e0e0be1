"""KV tiers below device memory: a host-memory pool and Redis, behind one connector.

`TieredStore` is the engine's KV connector. Pages whose device memory is reused go to the
host tier (its own byte budget, LRU; a page it holds already is not copied again); full pages
computed by the engine are written behind
to Redis. A lookup takes the leading pages found in host memory at once, and asks Redis for
the rest on a background thread; the engine admits the request when that completes.

Pages of requests still waiting for room in the pool may be read from Redis ahead of their
admission (`prefetch`, on a thread of its own) into a staging buffer in host memory
(`staged`, its own byte budget, LRU); a lookup takes them from there at once, as it takes
host pages, so a request admitted after a queue does not then wait for Redis.

A request preempted with Redis as the only lower tier hands the writer its pages that Redis
lacks before they are freed (`swap_out`), and until the writer has stored a page, lookups read
its queued copy (`kvstore.page_ledger`): a swap, not a recompute.

Pages used again (matched in the device pool by hash, or restored from host memory or Redis
and named there by the scheduler) are `touch`ed: their Redis TTL
is refreshed, and those Redis turned out not to have (expired,
lost in an outage, never written while it was down) are written again from device memory.
The writer thread copies such a page itself (`_copy_for_rewrite`); a page's memory is only
reused after `evict` has named it, and `evict` takes the same lock, so the copy is never of
a page being overwritten.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.codec import PageCodec, Payload
from kvstore.kv_cache import KVCache
from kvstore.prefix import find_tail
from kvstore.redis_tier import RedisTier

PROBE_BATCH = 512  # pages whose presence a tail lookup asks about at once (one pipelined EXISTS)


@dataclass(slots=True)
class HostCounters:
    stored: int = 0  # pages copied in from device memory
    hits: int = 0  # pages loaded back into device memory
    evicted: int = 0  # pages dropped for the byte budget
    kept: int = 0  # pages evicted from device memory that were held here already: not copied again
    copied_ahead: int = 0  # of `stored`: free device pages copied in while the engine idled, before their eviction


class HostTier:
    """Payloads (storage dtype) of pages evicted from device memory, LRU within `budget_bytes`."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._pages: OrderedDict[bytes, Payload] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = HostCounters()

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, page_hash: bytes, payload: Payload) -> None:
        if len(payload) > self.budget_bytes:
            return
        with self._lock:
            old = self._pages.pop(page_hash, None)
            if old is not None:
                self.num_bytes -= len(old)
            while self.num_bytes + len(payload) > self.budget_bytes:
                _, dropped = self._pages.popitem(last=False)
                self.num_bytes -= len(dropped)
                self.counters.evicted += 1
            self._pages[page_hash] = payload
            self.num_bytes += len(payload)
            self.counters.stored += 1

    def holds(self, page_hash: bytes) -> bool:
        """Whether this page is held here (no LRU touch; any thread)."""
        with self._lock:
            return page_hash in self._pages

    def keep(self, page_hashes: list[bytes]) -> list[bool]:
        """Per hash, whether it is held here; those held become the most recently used, as a
        `put` of them would make them (their payload is the same: pages are named by content)."""
        out = []
        with self._lock:
            for h in page_hashes:
                held = h in self._pages
                if held:
                    self._pages.move_to_end(h)
                out.append(held)
            self.counters.kept += sum(out)
        return out

    def take_prefix(self, hashes: list[bytes]) -> list[Payload]:
        """Remove and return the payloads of the leading `hashes` held here (a staging buffer's
        pages are used once: they move into the device pool)."""
        out = []
        with self._lock:
            for h in hashes:
                payload = self._pages.pop(h, None)
                if payload is None:
                    break
                self.num_bytes -= len(payload)
                out.append(payload)
            self.counters.hits += len(out)
        return out

    def get_prefix(self, hashes: list[bytes]) -> list[Payload]:
        """Payloads of the leading `hashes` held here (stops at the first miss)."""
        out = []
        with self._lock:
            for h in hashes:
                payload = self._pages.get(h)
                if payload is None:
                    break
                self._pages.move_to_end(h)
                out.append(payload)
        return out


class _Fetch:
    """One lookup: host payloads at hand, Redis payloads (verified) arriving batch by batch.

    Given the device pages it will fill (`copy_into`, on a CPU cache), the lookup thread copies
    each batch from Redis into them as it arrives, while the next batch is read: the copy no
    longer follows the whole read. `take` stops it (waiting for a batch copy under way), so no
    page is written once the scheduler may free it."""

    def __init__(self, store: TieredStore, host: list[Payload], staged: int = 0):
        self.store = store
        self.host = host  # payloads at hand: the host tier's, then `staged` read ahead from Redis
        self.staged = staged
        self.remote: Future[None] | None = None
        self.arrived: list[Payload] = []  # appended by the lookup thread
        self.cancel = threading.Event()
        self.payloads: list[Payload] = []
        self.offset = 0  # a tail fetch: index of its first page in the hashes it was given
        self._dest: list[int] = []  # device pages for host + arrived payloads, in order
        self._copied = 0  # arrived payloads already copied into _dest[len(host):]
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return self.remote is None or self.remote.done()

    def copy_into(self, pages: list[int]) -> None:
        """(step thread) The device pages taken for this fetch: Redis pages may be copied into
        them as they arrive (CPU cache, page images only; else all at `load`)."""
        if self.store.codec.as_image and self.store.kv_cache.has_images:
            with self._lock:
                self._dest = pages
            self.copy_arrived()  # what arrived before the pages were taken

    def copy_arrived(self) -> None:
        """(lookup thread, after each batch) Copy what arrived since into its device pages."""
        with self._lock:
            if self.cancel.is_set() or not self._dest:
                return
            h = len(self.host)
            n = min(len(self.arrived), len(self._dest) - h)
            if n > self._copied:
                self.store.write(self._dest[h + self._copied : h + n], self.arrived[self._copied : n])
                self._copied = n

    def take(self, expired: bool) -> int:
        """With `expired`, the pages that arrived in time are used and the lookup is stopped."""
        self.cancel.set()
        with self._lock:  # a batch copy under way ends first; none starts after
            self.payloads = self.host + self.arrived[:]  # a snapshot: the lookup thread may still append
        return len(self.payloads)

    def sources(self) -> tuple[int, int]:
        n_host = min(len(self.host) - self.staged, len(self.payloads))
        return n_host, len(self.payloads) - n_host

    def load(self, pages: list[int]) -> None:
        if not pages:
            return
        n_host = min(len(self.host) - self.staged, len(pages))
        self.store.host.counters.hits += n_host
        if self.store.redis is not None:
            self.store.redis.counters.loaded += len(pages) - n_host
        h = len(self.host)
        done = h + self._copied  # pages [h, done) were copied as they arrived
        if self._copied and len(pages) > h:
            assert pages[h : min(done, len(pages))] == self._dest[h : min(done, len(pages))]
        if pages[:h]:
            self.store.write(pages[:h], self.payloads[:h])
        if pages[done:]:
            self.store.write(pages[done:], self.payloads[done : len(pages)])
        # Not touched here: the scheduler touches the pages it could name; one it could not name
        # would be reused without `evict`, so its page number must not be kept.


class TieredStore:
    """The host and Redis tiers as the engine's KV connector.

    Args:
        kv_cache: the device KV tensors pages are copied from and into.
        codec: page encoding (storage dtype, namespace).
        host_cache_bytes: host tier budget (0 = no host tier).
        redis: the Redis tier, or None.
        prefetch_bytes: budget of the staging buffer that `prefetch` reads Redis pages into
            (0 = no reading ahead; unused without Redis).
    """

    def __init__(
        self,
        kv_cache: KVCache,
        codec: PageCodec,
        host_cache_bytes: int = 0,
        redis: RedisTier | None = None,
        prefetch_bytes: int = 0,
    ):
        self.kv_cache = kv_cache
        self.codec = codec
        self.host = HostTier(host_cache_bytes)
        self.redis = redis
        self.staged = HostTier(prefetch_bytes if redis is not None else 0)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="longctx-kv-lookup") if redis else None
        # Reading ahead has a thread of its own: a request being admitted never queues behind it.
        self._prefetches = ThreadPoolExecutor(1, thread_name_prefix="longctx-kv-prefetch") if redis else None
        # Touched pages still in device memory: hash -> page, until the page is evicted (at most
        # one entry per device page).
        self._resident: dict[bytes, int] = {}
        self._resident_lock = threading.Lock()
        # Called (on the lookup thread) when a Redis lookup ends, so that the step loop admits
        # its request at once instead of at its next poll; any thread may call it.
        self.on_fetched: Callable[[], None] | None = None
        if redis is not None:
            redis.writer.rewrite = self._copy_for_rewrite

    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> _Fetch | None:
        """Host pages, then pages read ahead (`prefetch`), at once; with `remote`, Redis is asked
        for the rest on the lookup thread. None when there is nowhere to look."""
        nowhere = self.host.budget_bytes == 0 and not self.staged.num_bytes and (self.redis is None or not remote)
        if not page_hashes or nowhere:
            return None
        host = self.host.get_prefix(page_hashes)
        staged = self.staged.take_prefix(page_hashes[len(host) :]) if self.staged.num_bytes else []
        fetch = _Fetch(self, host + staged, len(staged))
        rest = page_hashes[len(host) + len(staged) :]
        if rest and remote and self.redis is not None and self._lookups is not None and self.redis.readable():
            fetch.remote = self._lookups.submit(
                self.redis.get_prefix, rest, fetch.arrived, fetch.cancel, fetch.copy_arrived
            )
            fetch.remote.add_done_callback(self._fetched)
        return fetch

    def prefetch_pages(self) -> int:
        """How many pages the staging buffer holds (0: no reading ahead)."""
        if self.redis is None or not self.redis.readable():
            return 0
        return self.staged.budget_bytes // self.redis.value_bytes

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        """Read these leading pages of a waiting request from Redis into the staging buffer, on
        the prefetch thread, batch by batch; those the host tier or the buffer hold already are
        not read. False when nothing is read (no Redis, reads down, no budget)."""
        if not page_hashes or self._prefetches is None or not self.prefetch_pages():
            return False
        i = 0
        while i < len(page_hashes) and (self.host.holds(page_hashes[i]) or self.staged.holds(page_hashes[i])):
            i += 1
        rest = page_hashes[i:]
        if not rest:
            return False
        self._prefetches.submit(self._read_ahead, rest)
        return True

    def _read_ahead(self, page_hashes: list[bytes]) -> None:
        assert self.redis is not None
        arrived: list[Payload] = []
        done = [0]

        def stage() -> None:
            for h, payload in zip(page_hashes[done[0] :], arrived[done[0] :], strict=False):
                self.staged.put(h, payload)
            done[0] = len(arrived)

        self.redis.get_prefix(page_hashes, arrived, threading.Event(), stage)
        stage()

    def fetch_tail(
        self, page_hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool = True
    ) -> _Fetch | None:
        """The window of the furthest resume point whose pages the host tier or Redis hold
        (`find_tail`, probing back from the end: host membership, then Redis EXISTS in
        pipelined batches), then those pages only, as `fetch` would read them. With Redis it
        all runs on the lookup thread; host memory alone answers at once."""
        use_redis = remote and self.redis is not None and self._lookups is not None and self.redis.readable()
        if not page_hashes or (self.host.budget_bytes == 0 and not use_redis):
            return None
        fetch = _Fetch(self, [])
        if use_redis:
            assert self._lookups is not None
            fetch.remote = self._lookups.submit(self._fetch_tail, fetch, page_hashes, first_needed, beyond, True)
            fetch.remote.add_done_callback(self._fetched)
        else:
            self._fetch_tail(fetch, page_hashes, first_needed, beyond, False)
        return fetch

    def _fetch_tail(
        self, fetch: _Fetch, hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool
    ) -> None:
        redis = self.redis if remote else None
        known: dict[int, bool] = {}

        def present(i: int) -> bool:
            if i not in known:  # probe this page and up to a batch before it (the walk goes back)
                lo = max(0, i + 1 - PROBE_BATCH)
                batch = hashes[lo : i + 1]
                found = [self.host.holds(h) for h in batch]
                if redis is not None and not fetch.cancel.is_set():
                    missing = [j for j, f in enumerate(found) if not f]
                    for j, f in zip(missing, redis.exists([batch[j] for j in missing]), strict=True):
                        found[j] = f
                known.update(zip(range(lo, i + 1), found, strict=True))
            return known[i]

        end = find_tail(len(hashes), first_needed, present, beyond)
        if end <= beyond or fetch.cancel.is_set():
            return
        start = first_needed(end)
        window = hashes[start:end]
        fetch.offset = start
        fetch.host = self.host.get_prefix(window)
        rest = window[len(fetch.host) :]
        if rest and redis is not None:
            redis.get_prefix(rest, fetch.arrived, fetch.cancel)

    def _fetched(self, _: Future[None]) -> None:
        if self.on_fetched is not None:
            self.on_fetched()

    def fetch_cost_s(self, num_pages: int) -> float:
        """Expected seconds for a lookup of `num_pages` pages (as if all came from Redis)."""
        if self.redis is None or not self.redis.readable():
            return 0.0  # host memory only: at hand
        return self.redis.fetch_cost_s(num_pages)

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        if self.redis is None:
            return
        if not self.redis.writable():
            self.redis.counters.dropped += len(pages)  # writes are down: no copy is taken
            return
        self.redis.save(page_hashes, self.kv_cache.read_pages(pages))

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        """A preempted request's pages are about to be freed. With Redis the only tier below
        the pool, hand the writer a copy (taken now, before their memory can be reused) of
        those it neither holds queued nor knows stored: dropped when they were computed (queue
        full, writes down). With a host tier, `evict` copies them when their memory is reused.
        Returns how many pages were handed over."""
        redis = self.redis
        if redis is None or self.host.budget_bytes > 0 or not redis.writable():
            return 0
        todo = [(h, p) for h, p in zip(page_hashes, pages, strict=True) if not redis.writer.ledger.holds(h)]
        if not todo or not redis.save([h for h, _ in todo], self.kv_cache.read_pages([p for _, p in todo])):
            return 0
        redis.counters.swapped_out += len(todo)
        return len(todo)

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        """Device pages named by these hashes in the pool (matched there, so `evict` will be
        told before their memory is reused) were used again: refresh their Redis TTL, and write
        again those Redis was found to lack."""
        if self.redis is None or not page_hashes:
            return
        with self._resident_lock:
            self._resident.update(zip(page_hashes, pages, strict=True))
        self.redis.touch(page_hashes)

    def _copy_for_rewrite(self, page_hashes: list[bytes]) -> tuple[list[bytes], torch.Tensor] | None:
        """(writer thread) A copy of those of these pages still in device memory."""
        with self._resident_lock:
            found = [(h, self._resident[h]) for h in page_hashes if h in self._resident]
            if not found:
                return None
            return [h for h, _ in found], self.kv_cache.read_pages([p for _, p in found])

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        if self._resident:
            with self._resident_lock:
                for page, h in evicted:
                    if self._resident.get(h) == page:
                        del self._resident[h]
        if self.host.budget_bytes == 0 or not evicted:
            return
        # A page restored from here (or evicted before and matched again) is held here already:
        # only its LRU place changes. A conversation that cycles through the device pool turn
        # after turn then copies only its new pages, not its whole history each time.
        held = self.host.keep([h for _, h in evicted])
        todo = [e for e, kept in zip(evicted, held, strict=True) if not kept]
        if not todo:
            return
        for (_, h), payload in zip(todo, self._read([p for p, _ in todo]), strict=True):
            self.host.put(h, payload)

    def copy_ahead(self, candidates: list[tuple[int, bytes]], max_pages: int) -> int:
        """(step thread, while idle) Copy up to `max_pages` of these free device pages, next in
        line for reuse, into the host tier where it does not hold them, as long as it has room
        without dropping anything; their eviction then only moves them in its LRU order (`keep`).
        The copy into fresh host memory, page faults included (~30 ms for the 46 MB of a 2k-token
        history on a 2-core EPYC, against ~7 ms into memory touched before), then happens between
        turns instead of inside the next restore. Returns how many were copied (0: nothing to do)."""
        host = self.host
        if host.budget_bytes == 0 or max_pages <= 0:
            return 0
        todo = [(p, h) for p, h in candidates if not host.holds(h)][:max_pages]
        copied = 0
        for (_, h), payload in zip(todo, self._read([p for p, _ in todo]), strict=True):
            if host.num_bytes + len(payload) > host.budget_bytes:
                break
            host.put(h, payload)
            copied += 1
        host.counters.copied_ahead += copied  # of `stored`
        return copied

    def _read(self, pages: list[int]) -> list[Payload]:
        """These device pages' payloads (storage dtype): in the model dtype on CPU, each page's
        image copied straight out of the cache."""
        out: list[Payload] = []
        if self.codec.as_image and self.kv_cache.has_images:
            out += self.kv_cache.read_images(pages)
        else:
            out += self.codec.payloads(self.kv_cache.read_pages(pages))
        return out

    def write(self, pages: list[int], payloads: list[Payload]) -> None:
        """Fill these device pages from verified payloads: in the model dtype on CPU, straight
        into the cache (no joined copy, no tensor); else decoded into one tensor and copied."""
        if self.codec.as_image and self.kv_cache.has_images:
            self.kv_cache.write_images(pages, payloads)
        else:
            self.kv_cache.write_pages(pages, self.codec.to_tensor(payloads))

    def close(self) -> None:
        for pool in (self._lookups, self._prefetches):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.redis is not None:
            self.redis.close()
