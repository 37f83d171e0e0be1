"""Layer-by-layer comparison of two runs over the same prompts, naming where they diverge.

Errors propagate: once one sub-module computes something wrong, every later output is wrong
too. So the fault is where the error first passes the threshold, walking the model in order
(embeddings, then per layer attention, then MLP, then the final norm and logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

SUBMODULES = (("attn", "attention"), ("mlp", "MLP"))


class Divergence(NamedTuple):
    where: str  # "layer 3 attention", "embeddings", "logits"
    layer: int | None
    error: float


def first_divergence(
    num_layers: int, error: Callable[[str, int | None], float], limit: float
) -> tuple[Divergence | None, list[list[object]]]:
    """Walks the model in order. `error(kind, layer)` gives the error of `embed`, `attn`, `mlp`
    (per layer) and `logits`. Returns (the first divergence past `limit` or None, per-layer rows
    [layer, attention error, MLP error])."""
    found: Divergence | None = None
    embed = error("embed", None)
    if embed > limit:
        found = Divergence("embeddings", None, embed)
    rows: list[list[object]] = []
    for i in range(num_layers):
        row: list[object] = [i]
        for kind, label in SUBMODULES:
            e = error(kind, i)
            row.append(e)
            if found is None and e > limit:
                found = Divergence(f"layer {i} {label}", i, e)
        rows.append(row)
    logits = error("logits", None)
    if found is None and logits > limit:
        found = Divergence("logits (final norm or LM head)", None, logits)
    return found, rows
