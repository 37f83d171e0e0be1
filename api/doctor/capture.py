"""Intermediate tensors of a forward pass, through forward hooks, on our model and on transformers'.

Both models have the same residual structure (`x + attn(norm(x))`, then `+ mlp(norm(x))`), so
the outputs of `self_attn` and `mlp` (before the residual add) and of each decoder layer are
comparable one to one. Our model runs through `ModelRunner` over a paged KV cache (the code
that serves), each prompt as one chunk; transformers runs the full sequence without cache.
Under tensor parallelism our attention and MLP outputs are already all-reduced inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model.model import CausalLM
from engine.model_runner import Chunk, ModelRunner
from engine.verify.agreement import rel_error as verify_rel_error
from kvstore.block_pool import BlockPool

# The fixed prompts (raw text, no chat template): prose, code and a list, short enough for any model.
PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
PAGE_SIZE = 16


@dataclass
class Capture:
    """One prompt's tensors, float32 on CPU; per-layer lists have one `[T, hidden]` entry per layer."""

    ids: list[int]
    embed: torch.Tensor  # [T, hidden]
    attn: list[torch.Tensor]
    mlp: list[torch.Tensor]
    hidden: list[torch.Tensor]  # each layer's output (residual stream after it)
    norm: torch.Tensor  # [T, hidden], the final norm's output
    logits: torch.Tensor  # [T, vocab]


def _first(out: Any) -> torch.Tensor:
    """A module's main output: transformers' attention returns (output, weights), some MoE blocks
    (output, router logits); drop the batch dimension."""
    t = out[0] if isinstance(out, tuple | list) else out
    assert isinstance(t, torch.Tensor)
    return (t[0] if t.dim() == 3 else t).detach().float().cpu().clone()


class _Hooks:
    """Records the outputs of named modules for one forward pass."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.seen: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_m: nn.Module, _inp: Any, out: Any) -> None:
            self.seen[name] = _first(out)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def capture(self, ids: list[int], num_layers: int, logits: torch.Tensor) -> Capture:
        s = self.seen
        return Capture(
            ids,
            s["embed"],
            [s[f"attn{i}"] for i in range(num_layers)],
            [s[f"mlp{i}"] for i in range(num_layers)],
            [s[f"layer{i}"] for i in range(num_layers)],
            s["norm"],
            logits.detach().float().cpu(),
        )


def _modules(backbone: Any) -> dict[str, nn.Module]:
    mods: dict[str, nn.Module] = {"embed": backbone.embed_tokens, "norm": backbone.norm}
    for i, layer in enumerate(backbone.layers):
        mods[f"attn{i}"] = layer.self_attn
        mods[f"mlp{i}"] = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        mods[f"layer{i}"] = layer
    return mods


def runner_for(model: CausalLM, max_tokens: int) -> tuple[ModelRunner, BlockPool]:
    """A runner whose KV cache holds `max_tokens` tokens, with its page pool."""
    c = model.config
    dtype = next(model.parameters()).dtype
    per_token = 2 * c.num_layers * model.local_kv_heads * c.head_dim * dtype.itemsize
    pages = -(-max_tokens // PAGE_SIZE) + 1
    runner = ModelRunner.for_model(model, PAGE_SIZE, pages * PAGE_SIZE * per_token, "auto")
    return runner, BlockPool(runner.kv_cache.num_pages)


def capture_ours(model: CausalLM, prompts: list[list[int]]) -> list[Capture]:
    """Each prompt prefilled as one chunk through our runner, every layer's outputs recorded."""
    runner, pool = runner_for(model, max(len(p) for p in prompts))
    hooks = _Hooks(_modules(model.model))
    try:
        out = []
        for ids in prompts:
            pages = pool.allocate(-(-len(ids) // PAGE_SIZE))
            logits = runner.run([Chunk(ids, pages, len(ids))], all_logits=True)
            pool.free(pages)
            out.append(hooks.capture(ids, model.config.num_layers, logits))
        return out
    finally:
        hooks.remove()


def capture_reference(hf_model: Any, prompts: list[list[int]]) -> list[Capture]:
    """transformers' full-sequence forward without cache, every layer's outputs recorded."""
    hooks = _Hooks(_modules(hf_model.model))
    try:
        out = []
        for ids in prompts:
            with torch.no_grad():
                logits = hf_model(torch.tensor([ids]), use_cache=False).logits[0]
            out.append(hooks.capture(ids, len(hf_model.model.layers), logits))
        return out
    finally:
        hooks.remove()


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| (the measure the differential tests use); inf when either holds
    a NaN or an infinity (NaN against NaN is a failure, not "no error")."""
    return verify_rel_error(ours, ref)
