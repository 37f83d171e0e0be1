"""Encoded images by content hash, under a byte budget.

An image is encoded once, at the step whose prefill chunk first reaches its placeholder tokens,
and its features wait here until the prefill has consumed them all: a chunked prefill may split
an image across steps, and a request preempted mid-image finds its features again instead of
re-encoding. A request holds the entries of its images it has yet to consume; held entries are
never evicted. Entries nobody holds stay, least recently used first out, while the budget lasts:
the same image sent again (the next turn of a conversation, another user) skips its encoder.
The budget bounds what is kept for reuse; images in use are kept whatever their size (a request
whose features outgrow the budget still runs).

Plain Python over opaque values with a size: no tensor is touched here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=Sized)


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0  # lookups that found the features
    misses: int = 0  # lookups that had to encode
    evictions: int = 0
    encoded_bytes: int = 0


class EncoderCache(Generic[V]):
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, V] = OrderedDict()  # least recently used first
        self._holders: dict[bytes, set[object]] = {}
        self.num_bytes = 0
        self.stats = EncoderCacheStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> V | None:
        """The features under `key` (now the most recently used), or None; counted as a hit or miss."""
        value = self._entries.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: V) -> None:
        """Keep freshly encoded features, then evict unheld entries over the budget."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        self._entries[key] = value
        self.num_bytes += value.nbytes
        self.stats.encoded_bytes += value.nbytes
        self._evict()

    def hold(self, key: bytes, owner: object) -> None:
        """`owner` still needs the entry: it stays until released (it need not be present yet)."""
        self._holders.setdefault(key, set()).add(owner)

    def release(self, key: bytes, owner: object) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(owner)
            if not holders:
                del self._holders[key]
        self._evict()

    def held(self, key: bytes) -> bool:
        return bool(self._holders.get(key))

    def _evict(self) -> None:
        if self.num_bytes <= self.budget_bytes:
            return
        for key in [k for k in self._entries if not self._holders.get(k)]:
            if self.num_bytes <= self.budget_bytes:
                break
            self.num_bytes -= self._entries.pop(key).nbytes
            self.stats.evictions += 1
