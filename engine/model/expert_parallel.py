"""Expert parallelism: each rank holds whole experts, and tokens travel to them and back.

Attention is tensor parallel, so after its all-reduce every rank holds all T tokens. Each rank
takes its own share of the tokens (T/N of them), sends each (token, expert) row to the rank
that owns the expert with one `all_to_all_single`, runs its experts on what it received, sends
the results back the same way, combines its share's k results per token, and an all-gather
restores all T tokens on every rank. The router runs on every rank over every token, with the
same weights and inputs, so every rank knows every split size without exchanging counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.distributed.parallel import ParallelContext, split_range


class ExpertBlock(Protocol):
    """What the dispatch needs of a sparse MoE block (`engine.model.moe.SparseMoE`)."""

    parallel: ParallelContext
    top_k: int
    num_experts: int
    local_experts: int
    expert_start: int
    last_load: torch.Tensor
    last_expert_calls: int

    def expert_forward(self, e: int, rows: torch.Tensor) -> torch.Tensor: ...


def expert_parallel_forward(
    moe: ExpertBlock, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """The routed experts' output for every token.

    Args:
        moe: the block; this rank holds experts [moe.expert_start, + moe.local_experts).
        x: [T, H] activations, identical on every rank.
        weights: [T, k] routing weights (float32 or x's dtype); experts: [T, k] int64 ids.
    Returns:
        [T, H] in x's dtype, identical on every rank.
    """
    ctx = moe.parallel
    N, r = ctx.world_size, ctx.rank
    T, H = x.shape
    k, per_rank = moe.top_k, moe.local_experts
    moe.last_load = torch.bincount(experts.reshape(-1), minlength=moe.num_experts).cpu()  # [E], all tokens
    shares = [split_range(T, N, s) for s in range(N)]
    # What every rank sends: its share's slots sorted by expert, hence grouped by owner rank.
    sorted_ids: list[torch.Tensor] = []
    for t0, n in shares:
        sorted_ids.append(torch.sort(experts[t0 : t0 + n].reshape(-1), stable=True).values)  # [n k]
    t0, n = shares[r]
    mine = experts[t0 : t0 + n].reshape(-1)  # [n k], slot i*k + j
    order = torch.argsort(mine, stable=True)  # [n k]
    send_sizes = torch.bincount(mine // per_rank, minlength=N).tolist()
    inbound = [ids[ids // per_rank == r] for ids in sorted_ids]  # expert id of each row rank s sends here
    recv_sizes = [len(ids) for ids in inbound]
    got = ctx.all_to_all(x[t0 + order // k], send_sizes, recv_sizes)  # [R, H]
    # Run each local expert once over all the rows it received, from every rank.
    recv_experts = torch.cat(inbound)  # [R]
    by_expert = torch.argsort(recv_experts, stable=True)  # [R]
    rows = got[by_expert]
    done = torch.empty_like(rows)
    counts = torch.bincount(recv_experts - moe.expert_start, minlength=per_rank).tolist()
    start = calls = 0
    for i, c in enumerate(counts):
        if c:
            done[start : start + c] = moe.expert_forward(moe.expert_start + i, rows[start : start + c])
            start += c
            calls += 1
    moe.last_expert_calls = calls
    results = torch.empty_like(done)
    results[by_expert] = done  # back in arrival order
    back = ctx.all_to_all(results, recv_sizes, send_sizes)  # [n k, H], in `order`
    weighted = back * weights[t0 : t0 + n].reshape(-1)[order, None]  # [n k, H]
    slots = torch.empty(n * k, H, dtype=x.dtype, device=x.device)
    slots[order] = weighted.to(x.dtype)
    share = slots.view(n, k, H).sum(dim=1)  # [n, H]
    return ctx.all_gather(share, [size for _, size in shares], dim=0)  # [T, H]
