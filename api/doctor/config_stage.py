"""Stage 1, config: is the architecture supported, what we read from the checkpoint's
configuration, the sizes that follow, and what the checkpoint declares that we ignore.

An ignored field that is not known to be harmless (training-only or bookkeeping) warns, named:
it may change the computation in a way this build does not reproduce.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from api.doctor.report import StageResult
from engine.loading.model_source import ModelPath
from engine.model.config import ModelConfig
from engine.model.vision.config import VISION_ARCHITECTURES

# config.json fields `ModelConfig.from_hf` reads.
READ_FIELDS = {
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
    "rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias", "qkv_bias", "hidden_act", "mlp_bias",
    "pretraining_tp", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    "sliding_window", "use_sliding_window", "layer_types", "max_window_layers", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "partial_rotary_factor",
}  # fmt: skip
# Fields that do not change inference: training, bookkeeping, output options.
HARMLESS_FIELDS = {
    "_name_or_path", "attention_dropout", "chunk_size_feed_forward", "id2label", "label2id", "initializer_range",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "output_router_logits",
    "pad_token_id", "problem_type", "return_dict", "router_aux_loss_coef", "router_jitter_noise",
    "transformers_version", "use_cache", "tokenizer_class", "tie_encoder_decoder", "torchscript",
    "use_bfloat16", "unsloth_version", "finetuning_task", "task_specific_params", "prefix", "sep_token_id",
}  # fmt: skip
# A vision-language checkpoint's top-level fields its vision side reads (the tower and connector
# are built by transformers from the whole config; `engine/model/vision/config.py`), or that only
# name tokens and video inputs this build does not take. Its `text_config` is checked as above.
VISION_FIELDS = {
    "text_config", "vision_config", "image_token_id", "image_token_index", "scale_factor", "vision_feature_layer",
    "vision_feature_select_strategy", "projector_hidden_act", "multimodal_projector_bias", "image_seq_length",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "_pad_token_id", "vocab_size",
}  # fmt: skip
GGUF_HARMLESS_PREFIXES = ("general.", "tokenizer.", "quantize.", "split.")
# GGUF keys that repeat what is read elsewhere (the vocabulary size is the token embedding's rows).
GGUF_REDUNDANT_SUFFIXES = (".vocab_size",)


def parameter_counts(c: ModelConfig) -> tuple[int, int]:
    """(total parameters, parameters active per token), from the config alone."""
    H, D = c.hidden_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    attn = H * (q + 2 * kv) + q * H + 2 * H
    attn += (q + 2 * kv) * c.attention_bias + H * c.o_proj_bias + 2 * D * c.qk_norm
    total = active = c.vocab_size * H * (1 if c.tie_word_embeddings else 2) + H
    for i in range(c.num_layers):
        total += attn
        active += attn
        if c.moe is None or i in c.moe.dense_layers:
            total += 3 * H * c.intermediate_size
            active += 3 * H * c.intermediate_size
            continue
        m = c.moe
        expert = 3 * H * m.intermediate_size
        shared = 3 * H * m.shared_expert_intermediate_size + (H if m.shared_expert_intermediate_size else 0)
        total += m.num_experts * expert + H * m.num_experts + shared
        active += m.top_k * expert + H * m.num_experts + shared
    return total, active


def ignored_fields(source: ModelPath, reader_keys: set[str] | None, arch_prefix: str = "") -> list[str]:
    """Checkpoint configuration this build does not read and does not know to be harmless."""
    if source.kind == "gguf":
        assert reader_keys is not None
        from gguf import GGUFReader

        keys = GGUFReader(source.path).fields.keys()
        harmless = GGUF_HARMLESS_PREFIXES
        return sorted(
            k
            for k in keys
            if k.startswith(arch_prefix)
            and k not in reader_keys
            and not k.startswith(harmless)
            and not k.endswith(GGUF_REDUNDANT_SUFFIXES)
        )
    raw: dict[str, Any] = json.loads((source.path / "config.json").read_text())
    known = READ_FIELDS | HARMLESS_FIELDS
    if (raw.get("architectures") or [""])[0] in VISION_ARCHITECTURES:
        text = raw.get("text_config") or {}
        ignored = [k for k in raw if k not in known and k not in VISION_FIELDS]
        ignored += [f"text_config.{k}" for k in text if k not in known and k not in ("mrope_section", "_pad_token_id")]
        return sorted(ignored)
    return sorted(k for k in raw if k not in known)


def config_stage(source: ModelPath, config: ModelConfig, st: StageResult, ignored: list[str]) -> None:
    rows: list[list[object]] = [["source", f"{source.kind}: {source.path}"]]
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in ("rope", "moe") and value is not None:  # only what differs from the defaults
            value = ", ".join(
                f"{k.name}={getattr(value, k.name)}" for k in fields(value) if getattr(value, k.name) != k.default
            )
        if f.name == "sliding_windows" and value:
            value = f"{sorted({w for w in value if w})} on {sum(w is not None for w in value)} layers"
        rows.append([f.name, value])
    total, active = parameter_counts(config)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    active_text = f" ({active / 1e6:.1f} M active per token)" if config.moe else ""
    rows.append(["parameters", f"{total / 1e6:.1f} M{active_text}"])
    rows.append(["KV bytes per token", f"float32 {kv * 4:,}, bf16/fp16 {kv * 2:,}, int8 {kv:,} (+ scales)"])
    rows.append(
        [
            "max context",
            f"{config.max_position_embeddings:,} tokens "
            f"({config.max_position_embeddings * kv * 2 / 1e9:.2f} GB of bf16 KV per sequence)",
        ]
    )
    st.table(["field", "value"], rows)
    st.data = {
        "parameters": total,
        "active_parameters": active,
        "kv_bytes_per_token_bf16": kv * 2,
        "ignored": ignored,
        "architecture": config.architecture,
    }
    for name in ignored:
        st.warn(f"the checkpoint declares {name!r}, which this build ignores")
    st.note(f"architecture {config.architecture} is supported")
