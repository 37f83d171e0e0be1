"""Who this process is in a sharded engine (rank, world size, process group), and its collectives.

Every collective the model issues goes through a `ParallelContext`, so one object counts the
bytes communicated per step (`CommStats`) and the single-process case costs nothing: with
`world_size == 1` each collective returns its input untouched and torch.distributed is
never imported into the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class CommStats:
    """Bytes this rank sent into collectives, by kind (payload sizes, not wire bytes)."""

    all_reduce: int = 0
    all_gather: int = 0
    all_to_all: int = 0
    broadcast: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.all_reduce + self.all_gather + self.all_to_all + self.broadcast

    def reset(self) -> None:
        self.all_reduce = self.all_gather = self.all_to_all = self.broadcast = self.calls = 0


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's (start, size) of `n` items split as evenly as possible (the first ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ParallelContext:
    """Tensor/expert parallel placement of this process. The default is a single process.

    Attributes:
        rank: this process's rank in the tensor-parallel group.
        world_size: ranks in that group.
        expert_parallel: experts split across ranks (MoE), attention still tensor-parallel.
        group: the torch.distributed process group (None when world_size == 1).
        comm: bytes communicated so far (mutable, not part of the identity).
    """

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: Any = None
    comm: CommStats = field(default_factory=CommStats, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and broadcasts each step's plan."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def split(self, n: int) -> tuple[int, int]:
        """(start, size) of this rank's share of `n` items."""
        return split_range(n, self.world_size, self.rank)

    def split_even(self, n: int, what: str) -> tuple[int, int]:
        """Like `split`, but `n` must divide evenly (head and MLP splits)."""
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.world_size}")
        size = n // self.world_size
        return self.rank * size, size

    # ---- collectives (identity on one process) ----

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        self.comm.all_reduce += x.numel() * x.element_size()
        self.comm.calls += 1
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`; rank r's part has `sizes[r]` entries there.

        Parts are padded to the largest size: gloo's all_gather needs equal shapes.
        """
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dim = dim % x.dim()
        width = max(sizes)
        if x.shape[dim] < width:
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat((x, x.new_zeros(pad)), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.comm.all_gather += x.numel() * x.element_size()
        self.comm.calls += 1
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)

    def all_to_all(self, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Rows [sum(send_sizes), ...] -> rows [sum(recv_sizes), ...]: block r of `x` goes to rank r,
        and block s of the result came from rank s (`all_to_all_single`: gloo has no list form)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        self.comm.all_to_all += x.numel() * x.element_size()
        self.comm.calls += 1
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=self.group)
        return out

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.comm.calls += 1
        if self.rank == 0:
            import pickle

            self.comm.broadcast += len(pickle.dumps(obj))
        return box[0]


SINGLE = ParallelContext()
