"""The error bounds a serving path is held to, per dtype, measured max|a - b| / max|b| on logits.

`COMPILED_VS_EAGER`: the compiled step against the eager modules in the same dtype. float32
graphs differ from eager by summation order (~1e-6); bf16 graphs round fewer intermediates than
eager's separate ops (measured on the demo model: 0.3-1% per bucket), so bf16's bound leaves a
few times that. A broken kernel or graph (a wrong layout, a mis-bound weight, a dropped bias)
moves logits by 10% or more: far past either bound.

`agreement_floor`: teacher-forced top-1 agreement with eager float32 where float32 decides for
the path's dtype (`agreement.decided`), the floor per (dtype, quantization). Quantization changes
the weights, so its floor is lower; the demo model's measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch

COMPILED_VS_EAGER = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2}


def compiled_bound(dtype: torch.dtype) -> float:
    """The largest relative logit error of a compiled bucket against eager in `dtype`."""
    return COMPILED_VS_EAGER.get(dtype, 5e-2)


# Served configurations' floors of top-1 agreement with eager float32 over the fixed text, where
# float32 decides (measured on the demo model: bf16 ~99%, int8 ~97%, int4 ~90%, in docs/benchmarks.md).
AGREEMENT_FLOORS = {"none": 0.97, "int8": 0.93, "int4": 0.85}


def agreement_floor(dtype: torch.dtype, quantization: str = "none") -> float:
    """The least top-1 agreement with eager float32 a configuration may have and count as valid."""
    if dtype == torch.float32 and quantization == "none":
        return 0.999
    return AGREEMENT_FLOORS[quantization]
