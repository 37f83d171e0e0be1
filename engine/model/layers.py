"""Building blocks shared by the dense and MoE layers: RMSNorm, the dense MLP, and the
declarations that tell the loader how checkpoint tensors map onto packed or sharded parameters."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import SINGLE, ParallelContext
from engine.model.tp import rows, set_source_slices

# A destination inside a packed parameter: `param.data[index]`.
ShardIndex = tuple[int | slice, ...]

# `checkpoint_name_map`'s answer for a tensor that belongs to other ranks only (skipped, not unexpected).
OTHER_RANK: tuple[str, object] = ("", "other rank")


def set_shards(module: nn.Module, param: str, specs: Mapping[object, ShardIndex]) -> None:
    """Declare the checkpoint tensors a packed parameter (`module.<param>`) is assembled from.

    Kept on the module, not the parameter: materialising a meta model replaces parameters.
    """
    table: dict[str, dict[object, ShardIndex]] = module.__dict__.setdefault("shard_specs", {})
    table[param] = dict(specs)


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, transformers' formula: torch's `rms_norm` accumulates in float32
    and rounds to x's dtype, then the weight multiplies. In float32 one fused kernel; in bf16
    the weight stays a separate multiply (folding it into the kernel before the rounding moves
    a tiny MoE's logits 5% off transformers')."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


def add_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next norm: returns (norm(x + residual), x + residual),
    both [T, hidden]. Called through the module so forward hooks still see the norm's output."""
    h = x + residual
    return norm(h), h


class DenseMLP(nn.Module):
    """Under tensor parallelism columns [start, start + I) of gate/up and the same rows of down,
    then one all-reduce (`reduce=False` leaves it to the caller, which sums more in first)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, parallel: ParallelContext = SINGLE, reduce: bool = True
    ):
        super().__init__()
        start, I = parallel.split_even(intermediate_size, "intermediate_size")
        self.parallel, self.reduce = parallel, reduce
        self.intermediate_size = I
        self.gate_up_proj = nn.Linear(hidden_size, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, hidden_size, bias=False)
        parts: dict[object, ShardIndex] = {"gate": (slice(0, I),), "up": (slice(I, 2 * I),)}
        set_shards(self.gate_up_proj, "weight", parts)
        if parallel.sharded:
            set_source_slices(self.gate_up_proj, "weight", {"gate": rows(start, I), "up": rows(start, I)})
            set_source_slices(self.down_proj, "weight", {None: rows(start, I, dim=1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        y = self.down_proj(F.silu(gate) * up)  # [T, hidden], this rank's partial sum
        return self.parallel.all_reduce(y) if self.reduce else y
