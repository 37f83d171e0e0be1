"""The sparse mixture-of-experts feed-forward block: Mixtral, Qwen2-MoE, Qwen3-MoE.

A router scores every expert per token and keeps the top k. The step's (token, expert)
pairs are then sorted by expert, so each expert that received tokens runs once, as two
matmuls over its contiguous rows, and experts that received none are skipped: the work
is tokens x top_k rows, never tokens x experts. Expert weights are stacked per layer
(`w13 [E, 2I, H]`, gate rows then up rows; `w2 [E, H, I]`), which is also the layout of
transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`.

Routing follows each architecture's transformers code exactly: softmax over all experts
in float32, top-k, then Mixtral always renormalises the k weights and keeps them in
float32, while Qwen renormalises only with `norm_topk_prob` and casts them to the
activations' dtype before weighting the experts' outputs.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import SINGLE, ParallelContext
from engine.model.config import ModelConfig
from engine.model.expert_parallel import expert_parallel_forward
from engine.model.layers import OTHER_RANK, DenseMLP, set_shards
from engine.model.tp import SourceSlice, rows, set_source_slices

# Per-expert checkpoint names (transformers' save_pretrained layout; Mixtral's w1/w3/w2).
_EXPERT_TENSOR = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class SparseMoE(nn.Module):
    """Router, stacked experts and (Qwen2-MoE) a sigmoid-gated shared expert.

    Parameters, and the checkpoint tensors they are loaded from (names relative to the block):
        gate.weight [E, H]: the router (`gate.weight`).
        w13 [E, 2I, H]: per expert, gate rows then up rows (`experts.N.gate_proj.weight` and
            `experts.N.up_proj.weight`, Mixtral's `experts.N.w1/w3.weight`, or transformers 5's
            fused `experts.gate_up_proj`).
        w2 [E, H, I]: down projections (`experts.N.down_proj.weight`, Mixtral's `w2`, or
            the fused `experts.down_proj`).
        shared_expert, shared_expert_gate.weight [1, H]: Qwen2-MoE only.

    Observability (host values, refreshed by every forward):
        last_load: [E] int64 on CPU, tokens routed to each expert in the last step (the
            router load); `router_loads(model)` collects it per layer.
        last_expert_calls: experts run in the last step (those with a non-zero load).
        num_expert_calls: experts run since construction.

    Sharded, the router is replicated (every rank routes every token identically) and either
    each expert's intermediate columns are split like a dense MLP's (tensor parallel: one
    all-reduce), or, with `expert_parallel`, each rank holds whole experts
    [expert_start, expert_start + local_experts) and tokens travel to them (`expert_parallel.py`).
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        moe = config.moe
        assert moe is not None
        E, H, I_full = moe.num_experts, config.hidden_size, moe.intermediate_size
        self.parallel = parallel
        self.expert_parallel = parallel.sharded and parallel.expert_parallel
        e0, n_e = parallel.split_even(E, "num_experts") if self.expert_parallel else (0, E)
        i0, I = (
            (0, I_full)
            if self.expert_parallel or not parallel.sharded
            else parallel.split_even(I_full, "moe_intermediate_size")
        )
        self.expert_start, self.local_experts = e0, n_e
        self.num_experts, self.top_k, self.intermediate_size = E, moe.top_k, I
        self.norm_topk_prob = moe.norm_topk_prob
        # Mixtral keeps its routing weights in float32; Qwen casts them to the activations' dtype.
        self.float32_routing_weights = config.architecture == "MixtralForCausalLM"
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.empty(n_e, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(n_e, H, I))
        S = moe.shared_expert_intermediate_size
        # Tensor parallel: the shared expert's partial sum joins the experts' in one all-reduce.
        self.shared_expert = DenseMLP(H, S, parallel, reduce=self.expert_parallel) if S else None
        self.shared_expert_gate = nn.Linear(H, 1, bias=False) if S else None
        local = range(e0, e0 + n_e)
        set_shards(
            self,
            "w13",
            {(e, p): (e - e0, slice(i * I, (i + 1) * I)) for e in local for i, p in enumerate(("gate", "up"))},
        )
        set_shards(self, "w2", {(e, "down"): (e - e0,) for e in local})
        if self.expert_parallel:  # whole experts: a row range of the fused tensors
            set_source_slices(self, "w13", {None: rows(e0, n_e)})
            set_source_slices(self, "w2", {None: rows(e0, n_e)})
        elif parallel.sharded:  # columns [i0, i0 + I) of every expert
            fused = SourceSlice(1, ((i0, I), (I_full + i0, I)))
            set_source_slices(self, "w13", {None: fused} | {(e, p): rows(i0, I) for e in local for p in ("gate", "up")})
            set_source_slices(self, "w2", {None: rows(i0, I, dim=2)} | {(e, "down"): rows(i0, I, dim=1) for e in local})
        # Per expert, packed or quantized modules replacing w13 / w2 after loading (`linear.py`).
        self.w13_linears: nn.ModuleList | None = None
        self.w2_linears: nn.ModuleList | None = None
        self.last_load = torch.zeros(E, dtype=torch.int64, device="cpu")  # not on the meta device
        self.last_expert_calls = 0
        self.num_expert_calls = 0

    def checkpoint_name_map(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name (relative to this block) -> (parameter name, shard key), or None.

        A fused tensor maps to the whole parameter (shard None), covering all its parts.
        """
        if name == "gate.weight":
            return name, None
        if name == "experts.gate_up_proj":
            return "w13", None
        if name == "experts.down_proj":
            return "w2", None
        m = _EXPERT_TENSOR.fullmatch(name)
        if m is not None:
            e, part = int(m.group(1)), _PART[m.group(2)]
            if e >= self.num_experts:
                return None
            if not self.expert_start <= e < self.expert_start + self.local_experts:
                return OTHER_RANK
            return ("w2" if part == "down" else "w13"), (e, part)
        if self.shared_expert is not None:
            if name in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"):
                return "shared_expert.gate_up_proj.weight", name.split(".")[1].removesuffix("_proj")
            if name in ("shared_expert.down_proj.weight", "shared_expert_gate.weight"):
                return name, None
        return None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k] int64), as transformers computes them."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def expert_forward(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `e` (global id, held by this rank) on its rows: [n, H] -> [n, H] (SwiGLU)."""
        self.num_expert_calls += 1
        i = e - self.expert_start
        w13 = self.w13_linears[i](rows) if self.w13_linears is not None else F.linear(rows, self.w13[i])
        gate, up = w13.chunk(2, dim=-1)  # [n, I] each
        h = F.silu(gate) * up
        return self.w2_linears[i](h) if self.w2_linears is not None else F.linear(h, self.w2[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        T, H = x.shape
        k = self.top_k
        weights, experts = self.route(x)  # [T, k]
        if self.expert_parallel:
            out = expert_parallel_forward(self, x, weights, experts)
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out
        flat = experts.reshape(-1)  # [T k], slot t*k + j
        order = torch.argsort(flat, stable=True)  # [T k] slots grouped by expert
        load = torch.bincount(flat, minlength=self.num_experts).cpu()  # [E], one host sync
        rows = x[order // k]  # [T k, H], the token of each sorted slot
        out_sorted = torch.empty_like(rows)
        calls = 0
        start = 0
        for e, n in enumerate(load.tolist()):
            if n:
                out_sorted[start : start + n] = self.expert_forward(e, rows[start : start + n])
                start += n
                calls += 1
        self.last_load = load
        self.last_expert_calls = calls
        weighted = out_sorted * weights.reshape(-1)[order, None]  # [T k, H]
        out_slots = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
        out_slots[order] = weighted.to(x.dtype)  # back to slot order
        out = out_slots.view(T, k, H).sum(dim=1)  # [T, H]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)  # tensor parallel: partial sums over I


def router_loads(model: nn.Module) -> dict[int, torch.Tensor]:
    """Per MoE layer index, the [E] int64 CPU tensor of tokens each expert got in the last step."""
    loads = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):  # model.layers.<i>.mlp
            loads[int(name.split(".")[2])] = module.last_load
    return loads
