"""The KV connector: where pages not found in device memory may be found instead.

The scheduler asks `lookup` how many of a request's leading full pages (by content hash)
are available outside device memory, `load`s them into freshly allocated device pages
before prefilling the rest, and hands full pages to `save` once computed. The default
connector has nothing and stores nothing; `kvstore/tiers.py` provides host and Redis tiers.
"""

from __future__ import annotations

from typing import Protocol


class KVConnector(Protocol):
    def lookup(self, page_hashes: list[bytes]) -> int:
        """How many of these leading pages can be loaded (a prefix: stops at the first miss)."""

    def load(self, page_hashes: list[bytes], pages: list[int]) -> int:
        """Fill device `pages` with the stored KV of `page_hashes`; returns how many loaded."""

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        """Offer full, computed device pages for storage (must not block the step)."""


class NoConnector:
    """Nothing outside device memory."""

    def lookup(self, page_hashes: list[bytes]) -> int:
        return 0

    def load(self, page_hashes: list[bytes], pages: list[int]) -> int:
        return 0

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        return None
