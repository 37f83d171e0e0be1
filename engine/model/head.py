"""The LM head, whose logits are float32 on every path: bf16, int8 and float32 weights, tied or
not, CPU or CUDA, sharded or not.

A head that rounds its output to the model dtype throws away what decides the next token: at
the demo model's logit magnitude (~25) bf16's spacing is 0.125, so two tokens 0.09 apart in
float32 ("The" 25.33, "L" 25.24 for the France question) can round to one value, and argmax then
takes the lower id. So the head accumulates in float32 and keeps the sums: `linear_bf16_f32` /
`linear_int8_f32` (`linear_bf16.cpp`) read the bf16 or int8 weight once and write float32,
without a float32 copy of the weight (which would add the table's size again to every step's
reads: 56 MB on the demo model). CUDA has `torch.mm(..., out_dtype=float32)`. Elsewhere the
weight is widened a block of rows at a time (the block stays in cache) and multiplied in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_kernel
from engine.model.quant import QuantLinear

# bf16 heads multiply by widening the weight to float32 even where the CPU has VDPBF16PS, int8
# heads their codes even where it has AVX512-VNNI (the paths of CPUs without them; set by
# `engine/verify/paths.py` to check them on CPUs that do not need them).
FORCE_WIDENED = False

# Weight rows widened at a time where no float32-output kernel serves (a 4096 x 576 block is
# 9 MB in float32: it stays in L2/L3 while multiplied).
_BLOCK_ROWS = 4096


def float32_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] float32, x and w in the same dtype, float32 sums kept."""
    if w.dtype == torch.float32:
        return F.linear(x.float(), w)
    if x.device.type == "cuda":
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    op = cpu_kernel.linear_bf16_f32()
    if op is not None and w.dtype == torch.bfloat16 and x.shape[1] % 16 == 0 and w.is_contiguous():
        return op(x.contiguous() if x.stride(-1) != 1 else x, w, FORCE_WIDENED)
    xf = x.float()
    return torch.cat([F.linear(xf, block.float()) for block in w.split(_BLOCK_ROWS)], dim=1)


def quantized_float32(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """An int8 head's logits in float32: x [M, K] -> [M, N]. The int8 kernel writes x's dtype, so
    bf16 activations go through `linear_int8_f32`, or a block-wise dequantized float32 product."""
    assert layer.mode == "int8", "the LM head is int8 under int4 (`head_quant`)"
    assert layer.bias is None, "LM heads have no bias"
    if x.dtype == torch.float32:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales.float())
    op = cpu_kernel.linear_int8_f32()
    if op is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[1] % 16 == 0:
        return op(x.contiguous() if x.stride(-1) != 1 else x, layer.qweight, layer.scales, FORCE_WIDENED)
    xf = x.float()
    scales = layer.scales.float().split(_BLOCK_ROWS)
    blocks = layer.qweight.split(_BLOCK_ROWS)
    return torch.cat([F.linear(xf, q.float() * s[:, None]) for q, s in zip(blocks, scales, strict=True)], dim=1)


class FloatHead(nn.Module):
    """An unquantized LM head: `logits = x W^T` in float32 with W kept in the model dtype
    (contiguous, never prepacked: the float32-output kernel reads it as it is)."""

    def __init__(self, weight: torch.Tensor):
        """weight [V, hidden] in the model dtype."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, V] float32."""
        return float32_product(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight.dtype} weights, float32 logits"


def head_logits(head: nn.Module | None, table: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The logits of normed hidden states x [N, hidden] -> [N, V_local] float32, from the head
    module (`FloatHead`, an int8 `QuantLinear`, or a plain `nn.Linear`) or, for a tied model whose
    head was never converted, the embedding `table` [V_local, hidden]."""
    if isinstance(head, QuantLinear):
        return quantized_float32(head, x)
    if isinstance(head, FloatHead):
        return head(x)
    if isinstance(head, nn.Linear):
        logits = float32_product(x, head.weight)
        return logits if head.bias is None else logits + head.bias.float()
    assert head is None and table is not None, f"unexpected LM head module {type(head).__name__}"
    return float32_product(x, table)
