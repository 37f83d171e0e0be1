"""The per-layer regions of the decoder as plain functions of tensors, for `torch.compile`.

Two regions cover a dense layer outside attention: `pre_attention` (residual add -> RMSNorm ->
QKV -> q/k norm -> RoPE) and `post_attention` (o_proj -> residual add -> RMSNorm -> MLP). Under
tensor parallelism `post_attention` is two regions, `o_projection` and `mlp_block`, so that the
all-reduces after the row-parallel o_proj and down projection run eager between them. Every
weight arrives as an argument, never read from a module, so one compiled graph serves all the
layers of a model (a module attribute would make the graph specialize on that layer). A linear
travels as a `LinearSpec`: a static kind (part of the compiled graph's guards) and its tensors.
The functions compute exactly what the modules of `model.py` / `layers.py` / `quant.py` do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.linear import PackedLinear
from engine.model.linear_bf16 import WidenedLinear, widened_matmul
from engine.model.quant import QuantLinear, quantized_matmul

# (kind, weight, bias, scales, int4 group size); kind one of linear, packed, widened, int8, int4.
LinearSpec = tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]


def linear_spec(module: nn.Module) -> LinearSpec:
    """The tensors and kind of a linear layer, as `apply_linear` takes them."""
    if isinstance(module, QuantLinear):
        return (module.mode, module.qweight, module.bias, module.scales, module.group_size)
    if isinstance(module, PackedLinear):
        return ("packed", module.weight, module.bias, None, 0)
    if isinstance(module, WidenedLinear):
        return ("widened", module.weight, module.bias, None, 0)
    if isinstance(module, nn.Linear):
        return ("linear", module.weight, module.bias, None, 0)
    raise TypeError(f"no compiled form for the linear layer {type(module).__name__}")


def apply_linear(x: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    """x [T, in] -> [T, out], as the module of `spec` computes it."""
    kind, w, b, scales, group = spec
    if kind == "linear":
        return F.linear(x, w, b)
    if kind == "packed":
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    if kind == "widened":
        return widened_matmul(x, w, b)
    assert scales is not None
    y = quantized_matmul(x, kind, w, scales, group)
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`: one fused call in float32, the weight multiplied after rounding otherwise."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def pre_attention(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    qkv: LinearSpec,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int, int],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, residual) [T, hidden] -> (q [T, H, D], kv [2, T, KVH, D] (k, then v), h = x + residual)."""
    H, KVH, D = heads
    T = x.shape[0]
    h = x + residual
    y = apply_linear(rms_norm(h, norm_w, eps), qkv).view(T, H + 2 * KVH, D)
    if q_norm_w is not None and k_norm_w is not None:
        qk = torch.cat((rms_norm(y[:, :H], q_norm_w, eps), rms_norm(y[:, H : H + KVH], k_norm_w, eps)), dim=1)
    else:
        qk = y[:, : H + KVH]
    qk = torch.addcmul(qk * cos, torch.roll(qk, D // 2, dims=-1), sin)
    kv = torch.stack((qk[:, H:], y[:, H + KVH :]))  # one buffer, v after k: one KV write (`write_kv`)
    # Outputs are their own buffers, no views of another (views would be rebuilt in Python by
    # the compiled graph's wrapper on every call).
    return qk[:, :H].clone(), kv, h


def post_attention(
    o: torch.Tensor,
    h: torch.Tensor,
    o_proj: LinearSpec,
    norm_w: torch.Tensor,
    gate_up: LinearSpec | None,
    down: LinearSpec | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output o [T, H, D] and residual h [T, hidden] -> (MLP(norm(o_proj(o) + h)), o_proj(o) + h).

    Without `gate_up` / `down` (an MoE layer, whose experts run eager) it returns the normed
    input of the MLP instead of its output."""
    T = o.shape[0]
    h = apply_linear(o.reshape(T, -1), o_proj) + h
    normed = rms_norm(h, norm_w, eps)
    if gate_up is None or down is None:
        return normed, h
    gate, up = apply_linear(normed, gate_up).chunk(2, dim=-1)
    return apply_linear(F.silu(gate) * up, down), h


def o_projection(o: torch.Tensor, o_proj: LinearSpec) -> torch.Tensor:
    """This rank's part of o_proj(o) [T, hidden] (row-parallel: the parts are summed after)."""
    return apply_linear(o.reshape(o.shape[0], -1), o_proj)


def mlp_block(
    attn: torch.Tensor,
    h: torch.Tensor,
    norm_w: torch.Tensor,
    gate_up: LinearSpec | None,
    down: LinearSpec | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`post_attention` after o_proj's all-reduce: (this rank's part of MLP(norm(attn + h)), attn + h);
    without `gate_up` / `down` (an MoE layer) the normed input of the MLP instead."""
    h = attn + h
    normed = rms_norm(h, norm_w, eps)
    if gate_up is None or down is None:
        return normed, h
    gate, up = apply_linear(normed, gate_up).chunk(2, dim=-1)
    return apply_linear(F.silu(gate) * up, down), h
