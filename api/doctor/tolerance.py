"""Error thresholds per dtype, for max|a - b| / max|b| of a layer's output.

float32 differences between two correct implementations stay near 1e-6 (summation order);
bf16 and fp16 round every product, and the rounding differs between implementations, so their
thresholds are the size of a few roundings compounded over a deep model. Every fault the doctor
is meant to find (a permuted, transposed, swapped or scaled tensor, a wrong RoPE) moves an
output by 10% or more.
"""

from __future__ import annotations

import torch

THRESHOLDS = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 8e-2}


def threshold(*dtypes: torch.dtype) -> float:
    """The threshold for comparing runs in these dtypes: the loosest of theirs."""
    return max(THRESHOLDS.get(d, 8e-2) for d in dtypes)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), name
    return dtype
