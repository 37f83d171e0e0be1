"""RoPE at long positions: inverse frequencies and attention factor equal transformers' rope
init functions on random configs (default with large theta, llama3, yarn), and cos/sin at
positions up to 2^20 (and past 2^32) equal a float64 evaluation of the same frequencies."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding, rope_angles

POSITIONS = [0, 1, 4095, 65_537, 262_143, 999_983, 1_048_575, 1_048_576]


def random_configs() -> list[tuple[str, dict[str, Any], int]]:
    rng = random.Random(7)
    out: list[tuple[str, dict[str, Any], int]] = []
    for _ in range(3):
        theta = rng.choice([5e5, 1e6, 1e7, 5e7])
        out.append(("default", {"rope_type": "default", "rope_theta": theta}, 1 << 20))
        orig = rng.choice([4096, 8192, 32768])
        factor = rng.choice([8.0, 32.0, 128.0])
        llama3 = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": rng.choice([1.0, 2.0]),
            "high_freq_factor": rng.choice([4.0, 8.0]),
            "original_max_position_embeddings": orig,
        }
        out.append(("llama3", llama3, int(orig * factor)))
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": rng.choice([1e4, 1e6]),
            "factor": factor,
            "original_max_position_embeddings": orig,
            "beta_fast": rng.choice([32.0, 16.0]),
            "beta_slow": rng.choice([1.0, 2.0]),
            "truncate": rng.choice([True, False]),
        }
        if rng.random() < 0.5:
            yarn |= {"mscale": 1.0, "mscale_all_dim": rng.choice([0.5, 1.0])}
        out.append(("yarn", yarn, int(orig * factor)))
    # Qwen-style YaRN to 1M (32k x 32), and one with an explicit attention factor.
    qwen = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 32768}
    out.append(("yarn", qwen, 1 << 20))
    out.append(("yarn", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "attention_factor": 1.3}, 1 << 20))
    return out


@pytest.mark.parametrize(("rope_type", "params", "max_pos"), random_configs())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_transformers_at_1m(rope_type: str, params: dict[str, Any], max_pos: int, head_dim: int) -> None:
    hf = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )
    if rope_type == "default":
        want_inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        want_factor = 1.0
    else:
        want_inv, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    ours = RotaryEmbedding(ModelConfig.from_hf(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]}))
    torch.testing.assert_close(ours.inv_freq, want_inv.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(want_factor, rel=1e-12)

    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    cos, sin = ours.cos_sin(positions, torch.float32)  # [T, 1, D]
    angles = positions.double()[:, None] * want_inv.double()[None, :]
    exact_cos = torch.cat((angles, angles), -1).cos() * want_factor
    exact_sin = torch.cat((-angles, angles), -1).sin() * want_factor
    assert (cos[:, 0].double() - exact_cos).abs().max() < 2e-6
    assert (sin[:, 0].double() - exact_sin).abs().max() < 2e-6


def test_float32_angles_would_not_do() -> None:
    """The reason for float64 angles: a float32 product at position 2^20 is off by > 1e-3 rad."""
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))
    pos = torch.tensor([1_048_575], dtype=torch.int64)
    exact = torch.remainder(pos.double()[:, None] * inv.double(), 2 * math.pi)
    naive = torch.remainder((pos.float()[:, None] * inv).double(), 2 * math.pi)
    ours = rope_angles(pos, inv).double()
    wrap = lambda x: torch.remainder(x + math.pi, 2 * math.pi) - math.pi  # noqa: E731
    assert wrap(naive - exact).abs().max() > 1e-3
    assert wrap(ours - exact).abs().max() < 1e-6


def test_positions_past_int32() -> None:
    inv = torch.tensor([1.0, 1e-3, 1e-6])
    pos = torch.tensor([3_000_000_017], dtype=torch.int64)
    want = torch.remainder(torch.tensor([3_000_000_017.0], dtype=torch.float64)[:, None] * inv.double(), 2 * math.pi)
    assert (rope_angles(pos, inv).double() - want).abs().max() < 1e-5
    with pytest.raises(TypeError, match="positions"):
        rope_angles(pos.float(), inv)
