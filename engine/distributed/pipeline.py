"""Pipeline parallelism: one step through the stages, in micro-batches so that stages overlap.

Every rank holds one stage: a contiguous slice of the layers and those layers' KV pages (the
page table is global rank 0's, the same for every stage). A step's chunks split into up to P
micro-batches of about equal tokens (`micro_batches`); stage s runs micro-batch m while stage
s+1 runs m-1. Stage 0 embeds, every stage but the last sends its hidden states [T, hidden]
(the residual stream, already summed) to the next by a point-to-point send, and the last
stage's tensor-parallel rank 0 sends the float32 logits [N, V] back to global rank 0, which
samples. Under tensor parallelism each rank of stage s sends to its peer (same tensor-parallel
rank) of stage s+1: every rank of a stage holds the whole hidden state.

What remains idle (the bubble): with M micro-batches, each stage waits (P-1)/(M+P-1) of a step
at best; a step with fewer chunks than stages (a few decoding sequences, one long prompt's
chunk) runs as one micro-batch and idles (P-1)/P. The runner measures it: `busy_s` (time in
this stage's layers) against `wall_s` (the steps' time on this rank).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class StageRunner(Protocol):
    """What a stage uses of the model runner (`engine.model_runner.ModelRunner`, which calls
    `run_stage`): its model, device, attention backend and KV cache, the step's inputs and counters."""

    model: Any
    step: Any
    device: torch.device
    backend: Any
    kv_cache: Any
    max_micro_batches: int
    busy_s: float
    wall_s: float

    def inputs(self, chunks: Any, all_logits: bool) -> tuple[Any, torch.Tensor, torch.Tensor | None]: ...

    def count(self, chunks: Any) -> None: ...


def micro_batches(token_counts: list[int], stages: int, most: int) -> list[int]:
    """Boundaries [0, b1, ..., len] of a step's chunks split into up to `most` contiguous groups
    of about equal tokens; one group when there are fewer chunks than `stages` (a split would
    leave stages idle all the same and cost each of them a pass over its weights)."""
    n = len(token_counts)
    m = min(most, n)
    if n < stages or m <= 1:
        return [0, n]
    total = sum(token_counts)
    bounds, acc = [0], 0
    for i, t in enumerate(token_counts[:-1]):
        acc += t
        closed = len(bounds)  # groups closed once this cut is made
        if closed < m and (acc * m >= total * closed or n - (i + 1) == m - closed):
            bounds.append(i + 1)
    bounds.append(n)
    return bounds


def run_stage(runner: StageRunner, chunks: Sequence[Any], all_logits: bool, bounds: list[int] | None) -> torch.Tensor:
    """This rank's stage of one step (see the module's docstring).

    Args:
        bounds: the micro-batches, as global rank 0 split them (None: split here).
    Returns:
        on global rank 0, float32 logits [B, V] (each chunk's last token) or [T, V] (every
        token, `all_logits`); on the other ranks an empty tensor.
    """
    p = runner.model.parallel
    config = runner.model.config
    if bounds is None:
        bounds = micro_batches([len(c.token_ids) for c in chunks], p.pp_size, runner.max_micro_batches)
    t0 = time.perf_counter()
    dtype = runner.model.model.norm.weight.dtype
    sends: list[tuple[Any, torch.Tensor]] = []  # in flight: the request and the tensor it reads
    kept: list[torch.Tensor] = []
    rows: list[int] = []
    for a, b in itertools.pairwise(bounds):
        part = chunks[a:b]
        meta, ids, logits_indices = runner.inputs(part, all_logits)
        rows.append(meta.num_tokens if all_logits else len(part))
        if p.first_stage:
            x = ids
        else:
            x = p.recv((meta.num_tokens, config.hidden_size), dtype, runner.device, p.stage_rank(p.pp_rank - 1))
        s0 = time.perf_counter()
        runner.backend.plan(meta)
        # the stage's step: `CausalLM.stage_forward`, or the compiled step over this stage's layers
        out = runner.step(x, meta, runner.kv_cache.layers, runner.backend, logits_indices)
        runner.busy_s += time.perf_counter() - s0
        if not p.last_stage:
            sends.append((p.send(out, p.stage_rank(p.pp_rank + 1)), out))
        elif p.rank == 0:
            sends.append((p.send(out, 0), out))
    if p.is_driver:
        last = (p.pp_size - 1) * p.world_size  # the last stage's tensor-parallel rank 0
        kept = [p.recv((n, config.vocab_size), torch.float32, runner.device, last) for n in rows]
    for request, _ in sends:
        request.wait()
    runner.count(chunks)
    runner.wall_s += time.perf_counter() - t0
    return torch.cat(kept) if kept else torch.empty(0)
