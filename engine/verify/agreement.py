"""How close a serving path's logits are to a reference's (eager float32): the relative error,
and teacher-forced top-1 agreement over a fixed text, counted where the reference decides.

A lower-precision path cannot order two tokens whose reference logits differ by less than its
own rounding step at that magnitude (bf16 at a logit of ~25: 0.125), so top-1 agreement is
counted at the positions where the reference's top-1 beats its runner-up by more than that step
(`decided`); agreement over all positions is reported beside it. Any non-finite value is a
failure, never a pass: NaN compares as "no error" under `>`, so the measures return inf instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# The fixed English text every agreement figure is measured on (>= 256 tokens with common
# tokenizers): prose that no calibration or test prompt contains.
TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with two-wheeled machines that riders pushed along with their feet. These early "
    "designs were heavy and uncomfortable, but they showed that a person could balance on two wheels "
    "while moving. Over the following decades, engineers added pedals to the front wheel, which made "
    "the machine faster but also more dangerous, because the front wheel grew larger and larger to "
    "increase speed. The so-called safety bicycle, introduced in the 1880s, solved this problem with "
    "two wheels of equal size and a chain that drove the rear wheel. Pneumatic tires followed soon "
    "after, making the ride smoother and more pleasant. Within a few years, millions of people in "
    "cities and villages around the world were riding bicycles to work, to school, and for pleasure. "
    "The bicycle gave ordinary people a new kind of freedom: they could travel farther than they could "
    "walk, without the cost of keeping a horse. Women in particular found that cycling changed their "
    "lives, and the bicycle became a symbol of independence. Today, bicycles remain one of the most "
    "efficient forms of transport ever invented, converting the energy of the rider into motion with "
    "very little waste, and many cities are building new lanes to encourage people to ride them."
)
TOKENS = 256

# A second text, run beside the first (mixed steps: its prefill chunks next to the first's decodes).
TEXT_B = (
    "A lighthouse keeper's day followed the sun. Before dusk he climbed the spiral stairs, trimmed "
    "the wick, polished the great lens until no fingerprint dulled it, and wound the clockwork that "
    "turned the light. Through the night he watched for ships and wrote the weather in his log every "
    "four hours: wind, sea, visibility, and any vessel that passed. At dawn he put the flame out, "
    "drew the curtains around the lens so the sun would not scorch it, and slept until noon."
)

# Mantissa bits per dtype: a value x is rounded to steps of 2^(floor(log2|x|) - bits).
_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|; inf when either holds a NaN or an infinity."""
    a, b = ours.float(), ref.float()
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s representable numbers at each of `values`' magnitudes."""
    bits = _MANTISSA.get(dtype, 7)
    return torch.exp2(torch.floor(torch.log2(values.float().abs().clamp(min=1e-30))) - bits)


def decided(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ref [N, V] -> [N] bool: positions whose top-1 beats the runner-up by more than `dtype`'s
    rounding step at the top-1's magnitude (a `dtype` path can order them)."""
    top2 = ref.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > rounding_step(top2[:, 0], dtype)


class Agreement(NamedTuple):
    decided: float  # top-1 equal to the reference's, over the positions the reference decides
    overall: float  # ... over all positions
    positions: int  # positions compared
    decided_positions: int
    error: float  # relative logit error (`rel_error`)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.error)

    def describe(self) -> str:
        return (
            f"top-1 {self.decided:.1%} where decided ({self.decided_positions}/{self.positions}), "
            f"{self.overall:.1%} overall; logit error {self.error:.2e}"
        )


def agreement(logits: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Agreement:
    """Top-1 agreement of logits [N, V] with ref [N, V] (counted where ref decides for `dtype`)
    and their relative error. A non-finite logit anywhere is no agreement at all."""
    error = rel_error(logits, ref)
    n = ref.shape[0]
    if not math.isfinite(error):
        return Agreement(0.0, 0.0, n, 0, error)
    same = logits.float().argmax(dim=-1) == ref.float().argmax(dim=-1)
    mask = decided(ref, dtype)
    count = int(mask.sum())
    return Agreement(float(same[mask].float().mean()) if count else 1.0, float(same.float().mean()), n, count, error)
