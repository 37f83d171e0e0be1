"""A sequence's page table, kept from step to step: appended to as the sequence grows, released
at the front as a sliding window leaves pages behind, never rebuilt.

Logical page i holds the sequence's tokens `i * page_size .. (i + 1) * page_size - 1`. Pages
`first .. len(table) - 1` are live (held, with a reference in the pool); those before `first`
were released (their KV is no longer read). The ids live in an int32 tensor that grows by
doubling and is compacted when the released front outgrows the live part, so appending a
page, releasing one and handing the live pages to attention (`live`: a view, no copy) each
cost O(1) amortized, whatever the sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

MIN_CAPACITY = 16


class PageTable:
    __slots__ = ("_base", "_buf", "_end", "entries_written", "first")

    def __init__(self, pages: list[int] | None = None, first: int = 0):
        """Args: pages: the live pages, logical pages `first ..`; first: pages before them (released)."""
        self._buf = torch.empty(MIN_CAPACITY, dtype=torch.int32)
        self._base = first  # logical index of _buf[0]
        self._end = first  # logical length
        self.first = first
        self.entries_written = 0  # page ids written into the table since it was made (work counter)
        if pages:
            self.append(pages)

    def __len__(self) -> int:
        """Logical pages, released ones included: the sequence holds KV room for `len * page_size` tokens."""
        return self._end

    def __bool__(self) -> bool:
        return self._end > 0

    @property
    def num_live(self) -> int:
        return self._end - self.first

    def live(self) -> torch.Tensor:
        """The live page ids (logical pages `first ..`): a view, valid until the next change."""
        return self._buf[self.first - self._base : self._end - self._base]

    def __iter__(self) -> Iterator[int]:
        """The live page ids (O(live pages): for checks, not for the step)."""
        return iter(self.live().tolist())

    def __getitem__(self, i: int) -> int:
        """Page id of logical page `i` (must be live)."""
        if not self.first <= i < self._end:
            raise IndexError(f"logical page {i} is not live (live: {self.first}..{self._end - 1})")
        return int(self._buf[i - self._base])

    def append(self, pages: list[int]) -> None:
        n = len(pages)
        if n == 0:
            return
        used = self._end - self._base
        if used + n > self._buf.numel():
            self._grow(used + n)
            used = self._end - self._base
        self._buf[used : used + n] = torch.tensor(pages, dtype=torch.int32)
        self._end += n
        self.entries_written += n

    def _grow(self, need: int) -> None:
        """Room for `need` entries past `_base`: drop the released front, double if still short."""
        live = self.live()
        n_live = live.numel()
        shift = self.first - self._base
        need -= shift
        cap = self._buf.numel()
        while cap < 2 * need:  # at least half free after: the next compaction is cap/2 appends away
            cap *= 2
        buf = torch.empty(cap, dtype=torch.int32) if cap != self._buf.numel() else self._buf
        buf[:n_live] = live.clone() if buf is self._buf else live
        self._buf, self._base = buf, self.first

    def release_front(self, upto: int) -> list[int]:
        """Release the live pages before logical page `upto`; returns their ids (for the pool)."""
        upto = min(upto, self._end)
        if upto <= self.first:
            return []
        out = self._buf[self.first - self._base : upto - self._base].tolist()
        self.first = upto
        return out

    def clear(self) -> list[int]:
        """Empty the table; returns the live page ids (for the pool)."""
        out = self.live().tolist()
        self._buf = torch.empty(MIN_CAPACITY, dtype=torch.int32)
        self._base = self._end = self.first = 0
        return out
