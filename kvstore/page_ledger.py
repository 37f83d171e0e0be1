"""What the Redis writer holds or has stored, by page hash.

Two questions are asked of the write-behind that Redis cannot answer in time:

- A lookup meets a page that is queued but not yet written (a request preempted, or a
  turn that comes back, within milliseconds of the page filling). Redis does not have it
  yet, but the writer holds its copy: `queued` hands that copy out, so the lookup loads it
  instead of stopping there and recomputing the rest. A page leaves the queue only after
  its `SET` answered (`settle`), so a lookup that checks the queue first and Redis second
  finds every page that was queued (it cannot fall between the two).
- A request is preempted with Redis as the only tier below the pool: its pages' device
  memory will be reused, so those neither queued nor known to be stored (dropped while the
  queue was full or writes were down) must be handed to the writer before they are freed
  (`holds` says which need it). Pages known to be stored are remembered in a bounded LRU:
  Redis may still have evicted one since, which a lookup then finds missing (recomputed).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

STORED_PAGES = 1 << 16  # pages remembered as stored (LRU): about a million tokens at 16 per page


class PageLedger:
    def __init__(self, max_stored: int = STORED_PAGES):
        self.max_stored = max_stored
        self._queued: dict[bytes, tuple[int, torch.Tensor]] = {}  # hash -> (save seq, page copy)
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def queue(self, seq: int, page_hashes: list[bytes], pages: torch.Tensor) -> None:
        """A save (`seq`) of pages [N, L, 2, P, H, D] (a copy no one writes to) was queued."""
        with self._lock:
            for h, page in zip(page_hashes, pages, strict=True):
                self._queued[h] = (seq, page)

    def settle(self, seq: int, page_hashes: list[bytes], stored: list[bool]) -> None:
        """The writer is done with save `seq`: each page was stored or not (dropped, failed).
        A page queued again by a later save stays queued under that one."""
        with self._lock:
            for h, ok in zip(page_hashes, stored, strict=True):
                entry = self._queued.get(h)
                if entry is not None and entry[0] == seq:
                    del self._queued[h]
                if ok:
                    self.mark_stored([h], locked=True)
                else:
                    self._stored.pop(h, None)

    def mark_stored(self, page_hashes: list[bytes], locked: bool = False) -> None:
        """These pages are in Redis (written, or just read back)."""
        if not locked:
            with self._lock:
                self.mark_stored(page_hashes, locked=True)
            return
        for h in page_hashes:
            self._stored[h] = None
            self._stored.move_to_end(h)
        while len(self._stored) > self.max_stored:
            self._stored.popitem(last=False)

    def forget(self, page_hashes: list[bytes]) -> None:
        """These pages were found gone from Redis (expired, evicted, lost)."""
        with self._lock:
            for h in page_hashes:
                self._stored.pop(h, None)

    def queued(self, page_hash: bytes) -> torch.Tensor | None:
        """The writer's copy [L, 2, P, H, D] of a page still queued, else None."""
        with self._lock:
            entry = self._queued.get(page_hash)
        return None if entry is None else entry[1]

    def holds(self, page_hash: bytes) -> bool:
        """Queued, or known to be stored: nothing to hand the writer."""
        with self._lock:
            return page_hash in self._queued or page_hash in self._stored

    @property
    def num_queued(self) -> int:
        return len(self._queued)
