"""Who this process is in a sharded engine (rank, world size, process group), and its collectives.

Ranks form a grid of pipeline stages x tensor-parallel ranks: global rank `g` is stage
`g // T`, tensor-parallel rank `g % T` of a stage's T ranks. `rank`, `world_size` and `group`
describe the tensor-parallel group (one stage); the stage and the whole world are separate.

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
    p2p: int = 0  # pipeline stages: hidden states to the next stage, logits back to rank 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.all_reduce + self.all_gather + self.all_to_all + self.broadcast + self.p2p

    def reset(self) -> None:
        self.all_reduce = self.all_gather = self.all_to_all = self.broadcast = self.p2p = self.calls = 0


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's (start, size) of `n` items split as evenly as possible (the first ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def parse_layer_split(text: str) -> tuple[int, ...]:
    """`--pipeline-layer-split 10,10,12` -> (10, 10, 12); empty -> () (even)."""
    if not text:
        return ()
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-layer-split: {text!r} is not a comma-separated list of layer counts") from None
    if any(n < 1 for n in split):
        raise ValueError(f"--pipeline-layer-split: {text!r}: every stage needs at least one layer")
    return split


@dataclass(frozen=True)
class ParallelContext:
    """Tensor/expert/pipeline parallel placement of this process. The default is a single process.

    Attributes:
        rank: this process's rank in the tensor-parallel group (its stage's ranks).
        world_size: ranks in that group.
        expert_parallel: experts split across ranks (MoE), attention still tensor-parallel.
        group: the tensor-parallel torch.distributed process group (None when world_size == 1).
        pp_rank: this process's pipeline stage; pp_size: the number of stages.
        layer_split: layers per stage (empty: as even as possible, the first stages one more).
        world: the group of every rank (plan broadcasts); None: `group` is the world.
        comm: bytes communicated so far (mutable, not part of the identity).
    """

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    layer_split: tuple[int, ...] = ()
    world: Any = None
    comm: CommStats = field(default_factory=CommStats, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"stage {self.pp_rank} outside pipeline size {self.pp_size}")
        if self.layer_split and len(self.layer_split) != self.pp_size:
            raise ValueError(
                f"--pipeline-layer-split has {len(self.layer_split)} stages, --pipeline-parallel-size {self.pp_size}"
            )

    @property
    def is_driver(self) -> bool:
        """Global rank 0 runs the scheduler and broadcasts each step's plan."""
        return self.global_rank == 0

    @property
    def sharded(self) -> bool:
        """Tensor parallel: this stage's tensors are split over `world_size` ranks."""
        return self.world_size > 1

    @property
    def pipelined(self) -> bool:
        return self.pp_size > 1

    @property
    def distributed(self) -> bool:
        """More than one process (tensor or pipeline parallel)."""
        return self.world_size > 1 or self.pp_size > 1

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.world_size + self.rank

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """Where this rank sits, for logs: `stage 1 of 2, tensor-parallel rank 0 of 2`."""
        parts = []
        if self.pipelined:
            parts.append(f"stage {self.pp_rank} of {self.pp_size}")
        if self.sharded:
            parts.append(f"tensor-parallel rank {self.rank} of {self.world_size}")
        return ", ".join(parts) or "one process"

    def stage_rank(self, stage: int) -> int:
        """The global rank of this process's tensor-parallel peer in `stage`."""
        return stage * self.world_size + self.rank

    def stage_layers(self, num_layers: int, stage: int | None = None) -> range:
        """The layers `stage` (default: this one) holds: a contiguous slice of the model's."""
        stage = self.pp_rank if stage is None else stage
        if not self.layer_split:
            if num_layers < self.pp_size:
                raise ValueError(f"{num_layers} layers cannot fill {self.pp_size} pipeline stages")
            start, size = split_range(num_layers, self.pp_size, stage)
            return range(start, start + size)
        if sum(self.layer_split) != num_layers:
            raise ValueError(
                f"--pipeline-layer-split {','.join(map(str, self.layer_split))} sums to {sum(self.layer_split)}, "
                f"the model has {num_layers} layers"
            )
        start = sum(self.layer_split[:stage])
        return range(start, start + self.layer_split[stage])

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

    def send(self, x: torch.Tensor, dst: int) -> Any:
        """Start sending `x` to global rank `dst`; returns the request (`.wait()` before reusing `x`)."""
        import torch.distributed as dist

        self.comm.p2p += x.numel() * x.element_size()
        self.comm.calls += 1
        return dist.isend(x.contiguous(), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        """A tensor of `shape` and `dtype` from global rank `src` (blocks until it is in)."""
        import torch.distributed as dist

        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src)
        return out

    def broadcast_object(self, obj: object = None) -> object:
        """Global rank 0's `obj` on every rank of every stage (pickled)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.world if self.world is not None else self.group)
        self.comm.calls += 1
        if self.is_driver:
            import pickle

            self.comm.broadcast += len(pickle.dumps(obj))
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj`, by global rank, on every rank of every stage (pickled)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[object] = [None] * (self.world_size * self.pp_size)
        dist.all_gather_object(out, obj, group=self.world if self.world is not None else self.group)
        self.comm.calls += 1
        return out


SINGLE = ParallelContext()
