"""Who this process is in a sharded engine: rank, world size and process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelContext:
    """Tensor/expert parallel placement of this process. The default is a single process.

    Attributes:
        rank: this process's rank in the tensor-parallel group.
        world_size: ranks in that group.
        expert_parallel: experts split across ranks (MoE), attention still tensor-parallel.
        group: the torch.distributed process group (None when world_size == 1).
    """

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and broadcasts each step's plan."""
        return self.rank == 0


SINGLE = ParallelContext()
