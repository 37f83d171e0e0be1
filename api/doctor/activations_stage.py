"""Stage 4, activations: size of the key intermediate tensors per layer on the fixed prompts.

A NaN or Inf fails naming where it first appears; an absmax near the dtype's largest value
(fp16's 65504; bf16's range is float32's) warns naming the layer, since the next release of
the same weights, or a longer prompt, would overflow there.
"""

from __future__ import annotations

import math

import torch

from api.doctor.context import DoctorContext
from api.doctor.report import StageResult

NEAR_LIMIT = 0.25  # of the dtype's largest finite value


def _stats(ts: list[torch.Tensor]) -> tuple[float, float, float, bool]:
    """(mean, variance, absmax) of the finite values, and whether all were finite; NaN for the
    statistics of a tensor with no finite value at all."""
    flat = torch.cat([t.reshape(-1) for t in ts])
    finite = bool(torch.isfinite(flat).all())
    f = flat[torch.isfinite(flat)]
    if f.numel() == 0:
        return math.nan, math.nan, math.nan, finite
    return float(f.mean()), float(f.var()) if f.numel() > 1 else 0.0, float(f.abs().max()), finite


def activations_stage(ctx: DoctorContext, st: StageResult) -> None:
    caps = ctx.ours
    limit = torch.finfo(ctx.dtype).max * NEAR_LIMIT
    hidden = ctx.loaded.config.hidden_size
    named: list[tuple[str, list[torch.Tensor]]] = [("embeddings", [c.embed for c in caps])]
    for i in range(ctx.loaded.config.num_layers):
        named.append((f"layer {i} attention", [c.attn[i] for c in caps]))
        named.append((f"layer {i} MLP", [c.mlp[i] for c in caps]))
        named.append((f"layer {i} output", [c.hidden[i] for c in caps]))
    named.append(("final norm", [c.norm for c in caps]))
    named.append(("logits", [c.logits for c in caps]))
    rows: list[list[object]] = []
    peak = 0.0
    nonfinite: list[str] = []
    tokens = sum(len(c.ids) for c in caps)
    for name, ts in named:
        mean, var, absmax, finite = _stats(ts)
        width = ts[0].shape[-1]
        rows.append([name, f"[{tokens}, {width}]", mean, var, absmax])
        peak = max(peak, absmax) if name != "logits" and math.isfinite(absmax) else peak
        if not finite:
            nonfinite.append(name)
            if len(nonfinite) == 1:  # where it first appears; everything after inherits it
                bad = sum(int((~torch.isfinite(t)).sum()) for t in ts)
                st.fail(f"{name}: {bad} NaN or Inf values in the output (the first tensor with any)")
        elif absmax > limit:
            st.warn(f"{name}: absmax {absmax:.3g} is near {ctx.dtype_name}'s limit ({torch.finfo(ctx.dtype).max:.3g})")
    if len(nonfinite) > 1:
        st.note(f"{len(nonfinite) - 1} later tensors hold NaN or Inf too (down to {nonfinite[-1]})")
    st.table(["tensor", "shape", "mean", "variance", "absmax"], rows)
    st.data = {"rows": rows, "dtype": ctx.dtype_name, "hidden_size": hidden}
    st.note(f"largest activation {peak:.3g} ({peak / torch.finfo(ctx.dtype).max:.1e} of {ctx.dtype_name}'s range)")
