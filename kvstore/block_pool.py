"""A pool of KV pages: ids, reference counts, the free list and the prefix-cache table.
Plain Python, no tensors.

Free pages are kept in an insertion-ordered dict used as an LRU list: allocation takes the
least recently freed page, and a page can be taken back out of the middle of the list in
O(1). A full, computed page may carry its content hash (`kvstore.prefix`); the hash stays
with the page after it is freed, so a later request with the same prefix revives it, until
allocation reuses its memory. Then the hash is dropped and `on_evict` is told, so that an
outer tier (host memory) can keep a copy before the page is overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class OutOfPages(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""


@dataclass(slots=True)
class PrefixCounters:
    queries: int = 0  # requests matched against the table
    hits: int = 0  # requests that found at least one page
    hit_tokens: int = 0  # tokens whose pages were found
    skipped_tokens: int = 0  # tokens neither found nor computed: behind a sliding window's resume point
    evicted: int = 0  # hashed pages whose memory was reused


class BlockPool:
    def __init__(self, num_pages: int, on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None):
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: dict[int, None] = dict.fromkeys(range(num_pages))
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # content hash -> page holding it
        self.on_evict = on_evict  # called with (page, hash) pairs before their memory is reused
        self.counters = PrefixCounters()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take the `n` least recently freed pages (reference count 1 each), in ascending order:
        a sequence's K/V then lies at rising addresses however the free list was shuffled,
        which the CPU decode kernel reads fastest (8k keys a layer: ~140 us ascending, ~154
        descending, ~178 shuffled on a Zen 5 core pair)."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = []
        evicted: list[tuple[int, bytes]] = []
        for _ in range(n):
            page = next(iter(self._free))
            del self._free[page]
            self.ref_counts[page] = 1
            h = self.page_hash[page]
            if h is not None:
                evicted.append((page, h))
                self._drop_hash(page, h)
            pages.append(page)
        pages.sort()
        if evicted:
            self.counters.evicted += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
        return pages

    def share(self, page: int) -> None:
        """Add a reference to a page in use, or revive a free one (removed from the free list)."""
        if self.ref_counts[page] == 0:
            del self._free[page]
        self.ref_counts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero go to the free list's tail.

        Pages are released in reverse order so that a sequence's last pages (least likely to be
        shared as a prefix) are reused first.
        """
        for page in reversed(pages):
            count = self.ref_counts[page]
            assert count > 0, f"page {page} freed more often than allocated"
            self.ref_counts[page] = count - 1
            if count == 1:
                self._free[page] = None

    def next_evicted(self, scan: int) -> list[tuple[int, bytes]]:
        """The named free pages among the first `scan` of the free list, in the order allocation
        would reuse them (and `on_evict` be told): what an outer tier may copy ahead while idle."""
        out = []
        for i, page in enumerate(self._free):
            if i >= scan:
                break
            h = self.page_hash[page]
            if h is not None:
                out.append((page, h))
        return out

    def is_free(self, page: int) -> bool:
        return page in self._free

    # ---- prefix cache ----

    def register(self, page: int, page_hash: bytes) -> bool:
        """Name a full, computed page by its content hash. Returns False (and changes nothing)
        when the hash already names another page or this page already has a hash."""
        assert self.ref_counts[page] > 0, f"page {page} registered while free"
        if page_hash in self.cached or self.page_hash[page] is not None:
            return False
        self.cached[page_hash] = page
        self.page_hash[page] = page_hash
        return True

    def match(self, hashes: list[bytes]) -> list[int]:
        """Share the pages holding the leading `hashes` (stops at the first miss); the caller
        owns one reference to each returned page."""
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            self.share(page)
            pages.append(page)
        return pages

    def num_cached(self, hashes: list[bytes]) -> int:
        """How many of the leading `hashes` name a page here (nothing is shared or moved)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def _drop_hash(self, page: int, page_hash: bytes) -> None:
        del self.cached[page_hash]
        self.page_hash[page] = None
