"""Error bounds of the CPU kernels' products, shared by the kernel and LM-head tests."""

from __future__ import annotations

import torch


def int16_rounding(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most the VNNI tiles' int16 activations can move x's products with q's rows
    times their scales: each value rounded to a step of its row's max |x| / 32767 (half a step,
    with a little over for float32's rounding of the step)."""
    step = x.double().abs().amax(dim=1, keepdim=True) / 32767
    return 0.501 * step * (q.double().abs().sum(dim=1) * scales.double())[None, :]
