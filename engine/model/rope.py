"""Rotary position embeddings: inverse frequencies per scaling type, and their application.

The inverse frequencies are float32, as transformers computes them; the angles of a step's
positions are formed in float64 from int64 positions and reduced modulo 2*pi before cos/sin,
so a position near 1M (angle ~1e6 rad, where a float32 product is off by ~0.06 rad) is as
exact as position 0. q and k are rotated in the NeoX (rotate-half) convention that
Llama/Qwen/Mistral checkpoints use.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig, RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32 on CPU, attention_factor applied to cos and sin).

    Always computed on the CPU, also inside a meta-device context: the first meta-device
    arange loads torch's reference kernels, ~170 MB of resident memory for nothing."""
    dim = head_dim
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.type == "dynamic":
        # A fixed NTK-aware base for the whole extended context (max_position x factor):
        # transformers' dynamic formula evaluated at seq_len = max_position * factor.
        seq_len = max_position_embeddings * rope.factor
        f = rope.factor
        base = base * ((f * seq_len / max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3(inv_freq, rope, max_position_embeddings)
    elif rope.type == "yarn":
        inv_freq, attention_factor = _yarn(rope, dim, max_position_embeddings)
    return inv_freq, attention_factor


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding of one model: cos/sin computed once per step for that step's positions.

    No table over the whole context is kept: for a 128k-token model it would cost more memory
    than the step's [T, D] product it saves.
    """

    inv_freq: torch.Tensor
    axes: torch.Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, attention_factor = inv_frequencies(config.rope, config.head_dim, config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor
        # M-RoPE: the position axis (0 temporal, 1 height, 2 width) of each frequency pair.
        self.register_buffer("axes", mrope_axes(config.rope, config.head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: positions [T] int64. Returns (cos, signed sin), each [T, 1, D] in `dtype`; the
        sine's first half is negated so that `apply_rotary` needs no negation of its own."""
        freqs = rope_angles(positions, self.inv_freq)  # [T, D/2] float32 in [0, 2*pi)
        a = self.attention_factor
        cos = torch.cat((freqs, freqs), dim=-1).cos_()
        sin = torch.cat((-freqs, freqs), dim=-1).sin_()  # sin(-f) = -sin(f)
        if a != 1.0:
            cos.mul_(a)
            sin.mul_(a)
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def cos_sin_axes(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE: positions [3, T] int64 (temporal, height, width); each frequency pair rotates
        by its own axis's position (`mrope_axes`). Returns what `cos_sin` does."""
        assert self.axes.numel(), "the model has no M-RoPE sections"
        angles = torch.stack([rope_angles(p, self.inv_freq) for p in positions])  # [3, T, D/2]
        freqs = angles.gather(0, self.axes.expand(1, angles.shape[1], -1))[0]  # [T, D/2]
        cos = torch.cat((freqs, freqs), dim=-1).cos_()
        sin = torch.cat((-freqs, freqs), dim=-1).sin_()
        if self.attention_factor != 1.0:
            cos.mul_(self.attention_factor)
            sin.mul_(self.attention_factor)
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def mrope_axes(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[D/2] int64, the position axis of each frequency pair under M-RoPE (empty without it).

    Qwen2-VL gives the axes three runs of `mrope_section` pairs; Qwen3-VL interleaves them
    (pair j is height's when j % 3 == 1 and j < 3 * section[1], width's when j % 3 == 2 and
    j < 3 * section[2], else temporal), as transformers' rotary embeddings of each do."""
    section = rope.mrope_section
    if not section:
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    half = head_dim // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} does not sum to head_dim / 2 = {half}")
    axes = torch.zeros(half, dtype=torch.int64, device="cpu")
    if rope.mrope_interleaved:
        axes[1 : 3 * section[1] : 3] = 1
        axes[2 : 3 * section[2] : 3] = 2
    else:
        axes[section[0] : section[0] + section[1]] = 1
        axes[section[0] + section[1] :] = 2
    return axes


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """positions [T] (int64) x inv_freq [D/2] -> angles [T, D/2] float32, reduced to [0, 2*pi).

    The product is taken in float64 (exact to ~1e-10 rad at position 1M) and reduced before
    narrowing, so the float32 cos/sin that follow carry only their own rounding (~1e-7)."""
    if positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return torch.remainder(angles, 2 * math.pi).to(torch.float32)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Args: x [T, H, D] (q and k heads together); cos, signed sin [T, 1, D] from `cos_sin`.
    Returns x rotated (rotate-half convention) in three kernels:
    `x * cos + roll(x, D/2) * sin`, where roll(x) = [x2, x1] and sin = [-sin, sin]."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)
