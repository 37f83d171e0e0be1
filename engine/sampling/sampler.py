"""Turns a batch of next-token logits into token ids, once per decode step.

Stages (bitmask, penalties, temperature, top-k, top-p, min-p) run only when some row uses
them, only on those rows, as tensor ops over [rows, V], and never torch.sort (~3 ms a 49k
row on CPU). Draws invert the CDF with uniforms that, for a seeded request, hash (seed,
output index) alone: batching, row order, preemption and other requests never change a
seeded result, in any process.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
from torch import Tensor

from engine.sampling.logits_processor import process_logits
from engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_M64 = (1 << 64) - 1
_BLOCK = 256  # tokens per block of the two-level inverse CDF


class TokenLogprobs(NamedTuple):
    """Log-probabilities under the raw model distribution (before penalties, temperature, masks)."""

    token_id: int
    logprob: float
    top_ids: list[int]  # the params.logprobs most likely tokens, most likely first
    top_logprobs: list[float]


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw, never of a token with probability 0.

    Two-level, in float64: a block of `_BLOCK` tokens by u[:, 0], then a token in it by u[:, 1],
    so that small probabilities do not drown in a float32 cumsum's rounding near 1.

    Args:
        probs: [n, V] float32, each row with some positive entry (need not sum to 1).
        u: [n, 2] float64 uniforms in [0, 1).

    Returns:
        [n] int64 token ids.
    """
    n, V = probs.shape
    full = V - V % _BLOCK
    sums = probs[:, :full].view(n, -1, _BLOCK).sum(dim=-1)  # [n, NB]; a view, no copy
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    block = _invert(sums.double(), u[:, :1])  # [n, 1]
    cols = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # [n, BLOCK]
    inside = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0)  # [n, BLOCK]
    return (cols[:, :1] + _invert(inside.double(), u[:, 1:])).squeeze(1)


def _invert(weights: Tensor, u: Tensor) -> Tensor:
    """First index whose cumulative weight exceeds u * total: [n, W] float64, [n, 1] -> [n, 1] int64."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the index found has weight > 0 even when u * total rounds up.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


def seeded_uniforms(seed: int, index: int) -> tuple[float, float]:
    """Two uniforms in [0, 1) that depend only on (seed, output token index): splitmix64, no Python hash()."""
    h1 = _splitmix64(_splitmix64(seed & _M64) ^ (index & _M64))
    h2 = _splitmix64(h1)
    return (h1 >> 11) * 2.0**-53, (h2 >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Sampler:
    """Chooses each row's next token; unseeded rows share one random stream."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)  # None: seeded from the OS

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        bitmask: Tensor | None = None,
    ) -> SamplerOutput:
        """Args:
            logits: [B, V] float32, the model's last-position logits.
            params: B requests' settings.
            prompt_ids, output_ids: B token lists; len(output_ids[r]) is the index of the token drawn.
            bitmask: [B, ceil(V / 32)] int32 grammar mask (see `apply_token_bitmask_`), or None.

        Returns:
            One token id per row, and its logprobs where requested.
        """
        x = process_logits(logits, params, prompt_ids, output_ids, bitmask)  # [B, V]
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if len(sampled) < len(params):
            tokens = x.max(dim=-1).indices  # [B]; first of ties, like argmax, but ~3x faster on CPU
        else:
            tokens = torch.empty(len(params), dtype=torch.int64, device=x.device)
        if sampled:
            idx = torch.tensor(sampled, device=x.device)
            u = [self._uniforms(params[r].seed, len(output_ids[r])) for r in sampled]
            rows = x if len(sampled) == len(params) else x[idx]
            tokens[idx] = sample_from_probs(rows.softmax(dim=-1), torch.tensor(u, dtype=torch.float64, device=x.device))
        token_ids: list[int] = tokens.tolist()
        return SamplerOutput(token_ids, _logprobs(logits, params, tokens, token_ids))

    def _uniforms(self, seed: int | None, index: int) -> tuple[float, float]:
        return (self._rng.random(), self._rng.random()) if seed is None else seeded_uniforms(seed, index)


def _logprobs(
    logits: Tensor, params: list[SamplingParams], tokens: Tensor, token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Chosen and top-n logprobs under log_softmax of the raw logits, for rows that ask."""
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    logp = (logits if len(rows) == len(params) else logits[idx]).float().log_softmax(dim=-1)  # [n, V]
    chosen = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
    n = max(params[r].logprobs or 0 for r in rows)
    top_vals, top_ids = logp.topk(n) if n else (logp[:, :0], logp[:, :0].long())
    for i, r in enumerate(rows):
        k = params[r].logprobs or 0
        out[r] = TokenLogprobs(token_ids[r], chosen[i], top_ids[i, :k].tolist(), top_vals[i, :k].tolist())
    return out
