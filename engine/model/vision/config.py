"""What a vision-language checkpoint adds to the text decoder's `ModelConfig`.

The decoder of every supported architecture is one our `CausalLM` already runs (Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE), read from the checkpoint's `text_config`; the vision side (tower,
connector, placeholder token, DeepStack, M-RoPE grids) is described here. The vision tower and
its connector are transformers' own modules, built from the checkpoint's config (kept as JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The checkpoint class -> the family of its vision side (`engine/model/vision/encoder.py`).
VISION_ARCHITECTURES = {
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",
    "LlavaForConditionalGeneration": "llava",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
}
# A `text_config.model_type` -> the text architecture that runs it.
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
}
# Checkpoint name prefixes of the text decoder, both transformers 5's layout and the older one
# most published checkpoints still use, rewritten to our `model.` / `lm_head`.
TEXT_PREFIXES = (
    ("model.text_model.", "model."),  # Idefics3, SmolVLM
    ("model.language_model.", "model."),  # Llava, Qwen3-VL (transformers 5)
    ("language_model.model.", "model."),  # Llava (older)
    ("language_model.lm_head.", "lm_head."),  # Llava (older)
    ("model.language_model.lm_head.", "lm_head."),
)
# Vision-side prefixes (tower, connector or projector) -> our `vision.` module's.
VISION_PREFIXES = {
    "idefics3": (("model.vision_model.", "vision.tower."), ("model.connector.", "vision.connector.")),
    "llava": (
        ("model.vision_tower.", "vision.tower."),
        ("model.multi_modal_projector.", "vision.projector."),
        ("vision_tower.", "vision.tower."),
        ("multi_modal_projector.", "vision.projector."),
    ),
    "qwen3_vl": (("model.visual.", "vision.tower."), ("visual.", "vision.tower.")),
}


@dataclass(frozen=True)
class VisionConfig:
    """The vision side of a vision-language checkpoint.

    Attributes:
        architecture: the checkpoint's class (e.g. `Idefics3ForConditionalGeneration`).
        family: how its tower, connector and positions work (`VISION_ARCHITECTURES`).
        image_token_id: the placeholder token each image feature replaces (one id for every image).
        hf_config: the checkpoint's whole config, JSON (transformers builds the tower from it).
        deepstack_layers: decoder layers after which DeepStack adds visual features (Qwen3-VL).
        spatial_merge_size: patches merged per feature along each side (M-RoPE grids).
    """

    architecture: str
    family: str
    image_token_id: int
    hf_config: str
    deepstack_layers: int = 0
    spatial_merge_size: int = 1

    @property
    def raw(self) -> dict[str, Any]:
        return dict(json.loads(self.hf_config))

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in our model's terms (`model.`, `lm_head`, `vision.`)."""
        for old, new in VISION_PREFIXES[self.family]:
            if name.startswith(old):
                return new + name[len(old) :]
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name


def text_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config as `ModelConfig.from_hf` reads it: the checkpoint's `text_config`,
    with the text architecture named and the top-level values that govern the decoder."""
    arch = raw["architectures"][0]
    text = dict(raw.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"{arch}: unsupported text decoder {model_type!r}; supported: {', '.join(TEXT_ARCHITECTURES)}")
    text["architectures"] = [TEXT_ARCHITECTURES[model_type]]
    # transformers ties the LM head by the top-level flag (`PreTrainedModel.tie_weights`).
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if model_type == "qwen3_vl_moe_text":
        text["norm_topk_prob"] = True  # its router always renormalises the top-k weights
    return text


def vision_config(raw: dict[str, Any]) -> VisionConfig:
    """The vision side of a checkpoint config dictionary (`PretrainedConfig.to_dict()`)."""
    arch = raw["architectures"][0]
    family = VISION_ARCHITECTURES[arch]
    vision = raw.get("vision_config") or {}
    image_token = raw.get("image_token_id", raw.get("image_token_index"))
    if image_token is None:
        raise ValueError(f"{arch}: the config names no image token (image_token_id)")
    return VisionConfig(
        architecture=arch,
        family=family,
        image_token_id=int(image_token),
        hf_config=json.dumps(raw, sort_keys=True, default=str),
        deepstack_layers=len(vision.get("deepstack_visual_indexes") or ()) if family == "qwen3_vl" else 0,
        spatial_merge_size=int(vision.get("spatial_merge_size", 1)) if family == "qwen3_vl" else 1,
    )
