"""Tensor-parallel pieces the model is built from when a `ParallelContext` spans several ranks.

The model is built with its local shapes (heads, MLP columns, vocabulary rows, experts of this
rank), so before a byte is read the loader knows which part of each checkpoint tensor this
rank needs: every split parameter declares a `SourceSlice` (a dimension and the ranges along
it), and the loader reads only those bytes. Parameters this rank has no part of (another
rank's experts, the row-parallel bias kept on rank 0 only) are declared too, so that their
checkpoint tensors are skipped rather than reported as unexpected.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import ParallelContext, split_range


class SourceSlice(NamedTuple):
    """The part of a checkpoint tensor one rank reads: along `dim`, the `(start, size)` ranges,
    concatenated in order (two ranges for a fused gate+up tensor split by columns)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] = sum(n for _, n in self.ranges)
        return tuple(out)

    def fits(self, full: tuple[int, ...]) -> bool:
        return self.dim < len(full) and all(s >= 0 and s + n <= full[self.dim] for s, n in self.ranges)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This slice of a whole tensor (for sources that cannot read a part)."""
        return torch.cat([t.narrow(self.dim, s, n) for s, n in self.ranges], dim=self.dim)


def rows(start: int, size: int, dim: int = 0) -> SourceSlice:
    return SourceSlice(dim, ((start, size),))


def set_source_slices(module: nn.Module, param: str, slices: dict[object, SourceSlice]) -> None:
    """Declare which part of the checkpoint tensor(s) of `module.<param>` this rank reads, per
    shard key (None for a parameter loaded whole). Kept on the module, like `set_shards`."""
    table: dict[str, dict[object, SourceSlice]] = module.__dict__.setdefault("source_slices", {})
    table.setdefault(param, {}).update(slices)


def set_other_rank(module: nn.Module, *params: str) -> None:
    """Parameters (relative names) that exist in the checkpoint but live on other ranks only."""
    module.__dict__.setdefault("other_rank_params", set()).update(params)


class HeadSplit(NamedTuple):
    """This rank's attention heads: query heads [q_start, q_start + heads), KV heads
    [kv_start, kv_start + kv_heads). KV heads are replicated when there are fewer than ranks."""

    q_start: int
    heads: int
    kv_start: int
    kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, parallel: ParallelContext) -> HeadSplit:
    n = parallel.world_size
    q_start, heads = parallel.split_even(num_heads, "num_attention_heads")
    if num_kv_heads >= n:
        kv_start, kv_heads = parallel.split_even(num_kv_heads, "num_key_value_heads")
        return HeadSplit(q_start, heads, kv_start, kv_heads)
    if n % num_kv_heads:
        raise ValueError(f"tensor-parallel size {n} is not a multiple of num_key_value_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads  # query heads per KV head; this rank's heads share one
    return HeadSplit(q_start, heads, q_start // group, 1)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the vocabulary; other ids embed to zero here, and
    the all-reduce sums the one rank that owns each id."""

    def __init__(self, vocab_size: int, dim: int, parallel: ParallelContext):
        self.start, size = parallel.split(vocab_size)
        super().__init__(size, dim, _weight=torch.empty(size, dim))  # no random init: the loader fills it
        self.parallel = parallel
        set_source_slices(self, "weight", {None: rows(self.start, size)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # [T, hidden]
        x = x.masked_fill(outside[:, None], 0)
        return self.parallel.all_reduce(x)


def gather_vocab(logits: torch.Tensor, vocab_size: int, parallel: ParallelContext) -> torch.Tensor:
    """[N, V_local] logits of this rank's vocabulary rows -> [N, V] on every rank."""
    n = parallel.world_size
    sizes = [split_range(vocab_size, n, r)[1] for r in range(n)]
    return parallel.all_gather(logits, sizes, dim=-1)
