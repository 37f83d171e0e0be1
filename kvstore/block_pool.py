"""A pool of KV pages: ids, reference counts, and the free list. Plain Python, no tensors.

Free pages are kept in an insertion-ordered dict used as an LRU list: allocation takes
the least recently freed page, and a page can be taken back out of the middle of the
list in O(1) (the prefix cache revives a freed page whose contents are still valid).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""


class BlockPool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: dict[int, None] = dict.fromkeys(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (reference count 1 each), least recently freed first."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            page = next(iter(self._free))
            del self._free[page]
            self.ref_counts[page] = 1
            pages.append(page)
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

    def is_free(self, page: int) -> bool:
        return page in self._free
