"""bf16 linears on CPUs whose bf16 matmuls are emulated: AVX-512 without AVX512-BF16 or AMX.

There oneDNN's bf16 matmuls, `PackedLinear`'s and plain `F.linear`'s alike, run several times
slower than float32 ones (measured on such a CPU with the demo model's shapes: a 16-row product
~8x, a 512-row prefill ~3.5x the float32 time). `WidenedLinear` keeps the bf16 weight (the same
bytes) and computes in float32: up to `KERNEL_ROWS` rows with `linear_bf16.cpp` (each weight
vector widened in registers as it is read, so a decode step reads the bf16 bytes once), more
rows by widening the weight and calling float32 `F.linear` (the widening is small beside a
prefill's product). Products and sums are float32 either way and the output is rounded to bf16
once, as oneDNN's bf16 matmul rounds its float32 sums.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_kernel

# Rows up to which the kernel beats widening the weight for float32 `F.linear` (measured with
# the demo model's shapes: the kernel ~2x faster at 16 rows, even at 64, slower at 128).
KERNEL_ROWS = 32


@functools.cache
def bf16_emulated() -> bool:
    """Whether this CPU has AVX-512 but neither AVX512-BF16 nor AMX: oneDNN then emulates bf16."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_kernel.cpu_flag_set()
    return "avx512f" in flags and not flags & {"avx512_bf16", "amx_bf16"}


def widened_matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + b -> [M, N] in bf16, computed in float32."""
    op = cpu_kernel.linear_bf16()
    if op is not None and x.shape[0] <= KERNEL_ROWS and x.shape[1] % 16 == 0:
        return op(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


class WidenedLinear(nn.Module):
    """`y = x W^T (+ b)` with a bf16 W, computed in float32; x [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight [out, in] bf16, bias [out] or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = widened_matmul(x.reshape(-1, shape[-1]), self.weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bf16 widened to float32"
