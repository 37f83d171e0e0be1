"""Linear layers with weights prepacked for oneDNN, for bfloat16 on CPU.

torch's `F.linear` on CPU reorders a bf16 weight into oneDNN's blocked layout on every call;
for the small-batch matmuls of decoding that reorder costs as much as the product itself.
Packing each weight once after loading (what inductor's freezing does) removes it. The
packed tensor holds the same bytes; results equal `F.linear`'s (the same kernel runs).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("longctx.linear")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


class PackedLinear(nn.Module):
    """`y = x W^T (+ b)` with W prepacked; x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1), False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a loaded bf16 CPU model by a `PackedLinear`. Returns how many."""
    params = list(model.parameters())
    if not params or not packing_supported(params[0].dtype, params[0].device):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, PackedLinear(child))
                count += 1
    log.debug("prepacked %d linear layers for oneDNN", count)
    return count
