"""Model configuration: one frozen dataclass built from `config.json` or GGUF metadata.

Everything the model, the loader and the KV cache need is here and nothing else;
values measured at run time (load statistics, KV capacity) live elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.model.vision.config import VISION_ARCHITECTURES, VisionConfig, text_dict, vision_config


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    # Multi-axis RoPE (Qwen-VL): rotary frequency pairs per axis (temporal, height, width), and
    # whether the axes take the pairs in turn (Qwen3-VL) rather than in three runs (Qwen2-VL).
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise UnsupportedModel(f"unsupported RoPE scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE block parameters; absent for dense models."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert
    # Layers whose MLP is dense instead of sparse (Qwen MoE's mlp_only_layers / decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    o_proj_bias: bool = False  # output projection bias (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    moe: MoEConfig | None = None
    # Per layer: the attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # a vision-language checkpoint's image side

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {self.architecture!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must have one entry per layer")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` through transformers (which normalises old RoPE fields)."""
        from transformers import AutoConfig

        config_file = Path(path) / "config.json"
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UnsupportedModel(f"cannot read {config_file}: {e}") from e
        archs = raw.get("architectures") or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES + tuple(VISION_ARCHITECTURES):
            raise UnsupportedModel(
                f"{config_file}: unsupported architecture {archs!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES + tuple(VISION_ARCHITECTURES))
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModel(
                f"{config_file}: unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        try:
            hf = AutoConfig.from_pretrained(str(path))
        except (ValueError, KeyError, TypeError) as e:
            raise UnsupportedModel(f"{config_file}: invalid config: {e}") from e
        if archs[0] in VISION_ARCHITECTURES:
            return cls.from_hf_vision(hf.to_dict() | {"architectures": archs})
        return cls.from_hf(hf.to_dict() | {"architectures": archs})

    @classmethod
    def from_hf_vision(cls, d: dict[str, Any]) -> ModelConfig:
        """A vision-language checkpoint: its text decoder's config, with the vision side attached."""
        try:
            text, vision = text_dict(d), vision_config(d)
        except (ValueError, KeyError, TypeError) as e:
            raise UnsupportedModel(str(e)) from e
        text.setdefault("dtype", d.get("dtype") or d.get("torch_dtype"))
        config = cls.from_hf(text)
        rope = config.rope
        if rope.mrope_section:  # Qwen3-VL interleaves the axes' frequency pairs
            rope = replace(rope, mrope_interleaved=vision.family == "qwen3_vl")
        return replace(config, rope=rope, vision=vision)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers config dictionary (`PretrainedConfig.to_dict()`)."""
        arch = (d.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {arch!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"unsupported hidden_act {act!r}; supported: silu")
        if d.get("mlp_bias"):
            raise UnsupportedModel("unsupported option mlp_bias=true")
        if d.get("pretraining_tp", 1) not in (1, None):
            pass  # pretraining_tp only changes how transformers splits matmuls, not the result
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope = _rope_from_hf(d)
        num_layers = d["num_hidden_layers"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rope=rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM"
            or (arch == "Qwen2MoeForCausalLM" and bool(d.get("qkv_bias", True)))
            or bool(d.get("attention_bias", False)),
            o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
            and bool(d.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            moe=_moe_from_hf(arch, d, num_layers),
            sliding_windows=_windows_from_hf(arch, d, num_layers),
            dtype=str(dtype).replace("torch.", ""),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    p = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "layer_types" in p or any(isinstance(v, dict) for v in p.values()):
        raise UnsupportedModel("per-layer RoPE parameters are not supported")
    theta = p.get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=float(theta),
        type=str(rtype),
        factor=float(p.get("factor") or 1.0),
        original_max_position_embeddings=p.get("original_max_position_embeddings"),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=p.get("attention_factor"),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        truncate=bool(p.get("truncate", True)),
        mrope_section=tuple(int(n) for n in p.get("mrope_section") or ()),
    )


def _moe_from_hf(arch: str, d: dict[str, Any], num_layers: int) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    # Qwen3-MoE's config maps `num_experts` to `num_local_experts` (attribute_map), so its
    # `to_dict()` and the config.json transformers writes carry only the latter.
    num_experts = d.get("num_experts") or d.get("num_local_experts")
    if not num_experts:
        raise UnsupportedModel(f"{arch}: the config gives no number of experts")
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=num_experts,
            top_k=d["num_experts_per_tok"],
            intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
        )
    step = d.get("decoder_sparse_step", 1) or 1
    only = set(d.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=d["num_experts_per_tok"],
        intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM")),
        shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size") or 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
        dense_layers=dense,
    )


def _windows_from_hf(arch: str, d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows as transformers 5.24 applies them (key `kv_idx > q_idx - window`: a
    query at position p sees keys p-window+1 .. p).

    Mistral/Mixtral: `sliding_window` on every layer. Llama ignores the field. The Qwen
    family needs `use_sliding_window` (otherwise transformers sets the window to None/0);
    then Qwen3-MoE windows every layer, and Qwen2/Qwen3/Qwen2-MoE follow `layer_types`,
    whose default differs: Qwen2/Qwen3 window layers `i >= max_window_layers`, Qwen2-MoE
    the even layers `i < max_window_layers`.
    """
    window = d.get("sliding_window")
    if not window or arch == "LlamaForCausalLM":
        return ()
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return tuple(window for _ in range(num_layers))
    if not d.get("use_sliding_window", False):
        return ()
    if arch == "Qwen3MoeForCausalLM":
        return tuple(window for _ in range(num_layers))
    layer_types = d.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise UnsupportedModel(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModel(f"unsupported layer_types {sorted(unknown)}")
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        mwl = d.get("max_window_layers", 28)  # transformers' default
        if arch == "Qwen2MoeForCausalLM":
            windows = tuple(window if i % 2 == 0 and i < mwl else None for i in range(num_layers))
        else:
            windows = tuple(window if i >= mwl else None for i in range(num_layers))
    return windows if any(w is not None for w in windows) else ()
