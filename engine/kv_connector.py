"""The KV connector: where pages not found in device memory may be found instead.

The scheduler asks `fetch` for a request's leading full pages missing from the device pool
(by content hash), or, for a model whose every layer has a sliding window, `fetch_tail` for
the pages of the window at the furthest resume point the tiers can serve; the lookup runs
off the step thread and the request waits in a loading state until `ready()` (or a
deadline). `take` then says how many pages arrived (from `offset` on) and `load` copies them
into freshly allocated device pages. Full pages computed by the engine
are offered to `save` (write-behind: it must never block the step), pages matched in the
device pool are offered to `touch` (an outer tier keeps them alive), pages whose device
memory is about to be reused are offered to `evict` (the host tier keeps a copy), and a
preempted request's pages, before they are freed, to `swap_out` (Redis keeps a copy when it
is the only tier). Pages of requests that wait for room in the pool may be read ahead into host
memory (`prefetch`), so that their lookup, once admitted, finds them at hand.
`kvstore.tiers.TieredStore` provides the host and Redis tiers; `NoConnector` has nothing.

The deadline of a lookup comes from its cost (`lookup_plan`): a request waits for a tier
while fetching its pages is expected to beat recomputing them, so a Redis answering in
300 ms still restores a long history, and a slow one never holds a short prompt back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

LOOKUP_FLOOR_S = 0.1  # the least wait: covers a local tier's jitter and the step's polling
LOOKUP_SLACK = 1.5  # wait this many times the expected fetch before giving up


def lookup_plan(fetch_s: float, recompute_s: float, cap_s: float) -> tuple[bool, float]:
    """Whether to ask the remote tiers, and how long a request may wait for its lookup.

    While fetching is expected to beat recomputing (`fetch_s` < `recompute_s`): ask, and wait as
    long as a recompute would take (at least `LOOKUP_SLACK` x the expected fetch and
    `LOOKUP_FLOOR_S`), never past `cap_s`: a fetch slower than its estimate still restores while
    waiting costs no more than recomputing.
    Otherwise take only what is at hand (host memory), and a remote tier is not asked at all:
    its answer would come after the recompute, and it would hold up the lookups behind it.
    """
    if fetch_s >= recompute_s:
        return False, min(cap_s, LOOKUP_FLOOR_S)
    return True, min(cap_s, max(LOOKUP_FLOOR_S, LOOKUP_SLACK * fetch_s, recompute_s))


class PendingFetch(Protocol):
    offset: int  # index, in the hashes the fetch was given, of the first page it loads (a tail's window)

    def ready(self) -> bool:
        """The lookup has finished (never blocks)."""

    def take(self, expired: bool) -> int:
        """Ends the lookup: how many leading pages can be loaded. With `expired`, only what
        is already at hand counts (a lookup past its deadline is a miss)."""

    def copy_into(self, pages: list[int]) -> None:
        """The device pages taken for this fetch (as many as hashes it was given): pages may be
        copied into them as they arrive, until `take`; `load` is then given a prefix of them."""

    def load(self, pages: list[int]) -> None:
        """Copy the first `len(pages)` fetched pages into these device pages."""

    def sources(self) -> tuple[int, int]:
        """After `take`: how many of the pages it can load came from host memory, and how many
        from a remote tier (Redis)."""


class KVConnector(Protocol):
    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> PendingFetch | None:
        """Start looking up these leading pages; None when there is nowhere to look. Without
        `remote`, only tiers that answer at once (host memory) are asked."""

    def fetch_tail(
        self, page_hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool = True
    ) -> PendingFetch | None:
        """For a model whose every layer has a sliding window: look for the furthest resume
        point k in (beyond, len(page_hashes)] whose window, pages `first_needed(k) .. k - 1`, the
        tiers hold (`kvstore.prefix.find_tail`), and fetch that window only (`offset` =
        `first_needed(k)`); nothing when there is none. None when there is nowhere to look."""

    def fetch_cost_s(self, num_pages: int) -> float:
        """Expected seconds for a lookup of `num_pages` pages (measured by the tiers)."""

    def prefetch_pages(self) -> int:
        """How many pages may be read ahead for waiting requests (0: no reading ahead)."""

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        """Start reading these leading pages of a request that waits for room in the pool into
        host memory, so that its lookup finds them at hand (must not block the step). False
        when nothing is read."""

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        """Offer full, computed device pages for storage (must not block the step)."""

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        """A preempted request's full pages, named by these hashes, are about to be freed: keep a
        copy in a lower tier, if one would not already have it (must not block the step).
        Returns how many pages were copied."""

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        """These device pages, named by these hashes in the pool, were matched and are used
        again (must not block the step). Until `evict` names a page, it holds its hash's KV."""

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        """(page, hash) pairs whose device memory is about to be reused."""


class NoConnector:
    """Nothing outside device memory."""

    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> PendingFetch | None:
        return None

    def fetch_tail(
        self, page_hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool = True
    ) -> PendingFetch | None:
        return None

    def fetch_cost_s(self, num_pages: int) -> float:
        return 0.0

    def prefetch_pages(self) -> int:
        return 0

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        return False

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        return None

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        return 0

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        return None

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        return None
