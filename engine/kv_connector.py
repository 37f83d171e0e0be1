"""The KV connector: where pages not found in device memory may be found instead.

The scheduler asks `fetch` for a request's leading full pages missing from the device pool
(by content hash); the lookup runs off the step thread and the request waits in a loading
state until `ready()` (or a deadline). `take` then says how many leading pages arrived and
`load` copies them into freshly allocated device pages. Full pages computed by the engine
are offered to `save` (write-behind: it must never block the step), and pages whose device
memory is about to be reused are offered to `evict` (the host tier keeps a copy).
`kvstore.tiers.TieredStore` provides the host and Redis tiers; `NoConnector` has nothing.
"""

from __future__ import annotations

from typing import Protocol


class PendingFetch(Protocol):
    def ready(self) -> bool:
        """The lookup has finished (never blocks)."""

    def take(self, expired: bool) -> int:
        """Ends the lookup: how many leading pages can be loaded. With `expired`, only what
        is already at hand counts (a lookup past its deadline is a miss)."""

    def load(self, pages: list[int]) -> None:
        """Copy the first `len(pages)` fetched pages into these device pages."""


class KVConnector(Protocol):
    def fetch(self, page_hashes: list[bytes]) -> PendingFetch | None:
        """Start looking up these leading pages; None when there is nowhere to look."""

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        """Offer full, computed device pages for storage (must not block the step)."""

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        """(page, hash) pairs whose device memory is about to be reused."""


class NoConnector:
    """Nothing outside device memory."""

    def contains(self, page_hashes: list[bytes]) -> int:
        """A connector may also answer, from any thread and without loading anything, how many
        of these leading pages it holds (`Engine.cached_prefix_tokens` uses it when present)."""
        return 0

    def fetch(self, page_hashes: list[bytes]) -> PendingFetch | None:
        return None

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        return None

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        return None
