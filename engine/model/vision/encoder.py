"""The image encoder of a vision-language model: its vision tower and the connector (Idefics3's
pixel shuffle + projection, Llava's MLP projector, Qwen3-VL's patch merger) that maps the tower's
output into the decoder's embedding space.

The tower and connector are transformers' own modules, built from the checkpoint's config and
filled by our loader (`vision.tower.*`, `vision.connector.*` / `vision.projector.*`); only the
glue of each family's `get_image_features` lives here. An encoder runs once per image, outside
the paged decoder step, so nothing of it needs paging or batching across requests; under tensor
parallelism it is replicated (rank 0 encodes and the features travel with the step's plan).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import torch
from torch import nn

from engine.model.vision.config import VisionConfig


class ImageFeatures(NamedTuple):
    """One image's features, in placeholder order.

    embeds: [N, hidden], replacing the embeddings of its N placeholder tokens.
    deepstack: per DeepStack layer, [N, hidden] added to that layer's output at the same rows
        (Qwen3-VL; empty otherwise).
    """

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


def hf_config(vision: VisionConfig) -> Any:
    """The checkpoint's transformers config object (its tower and connector are built from it)."""
    from transformers import AutoConfig

    raw = json.loads(vision.hf_config)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


class ImageEncoder(nn.Module):
    """`stages(inputs)` gives every stage's output (for the doctor), `forward(inputs)` the features.

    `inputs` is what the checkpoint's image processor returned for one image (its tensors, with
    their batch dimension), e.g. `pixel_values` and `pixel_attention_mask` (Idefics3),
    `pixel_values` (Llava), `pixel_values` and `image_grid_thw` (Qwen3-VL)."""

    def stages(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def forward(self, inputs: dict[str, torch.Tensor]) -> ImageFeatures:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class Idefics3Encoder(ImageEncoder):
    """SigLIP tower over each (sub-)image, then pixel shuffle and a linear projection
    (`Idefics3Model.get_image_features`; SmolVLM is the same)."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.idefics3 import modeling_idefics3 as idefics3
        from transformers.models.smolvlm import modeling_smolvlm as smolvlm

        smol = config.model_type == "smolvlm"
        tower: Any = smolvlm.SmolVLMVisionTransformer if smol else idefics3.Idefics3VisionTransformer
        self.tower = tower._from_config(config.vision_config)
        self.connector = smolvlm.SmolVLMConnector(config) if smol else idefics3.Idefics3Connector(config)
        self.patch_size = config.vision_config.patch_size

    def stages(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pixels = inputs["pixel_values"].to(self.dtype)  # [1, images, 3, H, W] (images: sub-images + global)
        pixels = pixels.view(-1, *pixels.shape[2:])
        real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels.shape[1:].numel()  # padding images are all zeros
        pixels = pixels[real].contiguous()
        mask = inputs.get("pixel_attention_mask")
        if mask is None:
            mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool, device=pixels.device)
        else:
            mask = mask.view(-1, *mask.shape[2:])[real].contiguous()
        P = self.patch_size
        patches = mask.unfold(dimension=1, size=P, step=P).unfold(dimension=2, size=P, step=P)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).bool()
        tower = self.tower(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state  # [n, seq, D]
        features = self.connector(tower)  # [n, seq / scale^2, hidden]
        return {"tower": tower, "connector": features.reshape(-1, features.shape[-1])}

    def forward(self, inputs: dict[str, torch.Tensor]) -> ImageFeatures:
        return ImageFeatures(self.stages(inputs)["connector"])


class LlavaEncoder(ImageEncoder):
    """CLIP or SigLIP tower, the configured layer's hidden states (CLS dropped under the default
    strategy), then the two-layer MLP projector (`LlavaModel.get_image_features`)."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        self.layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy

    def stages(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pixels = inputs["pixel_values"].to(self.dtype)  # [1, 3, H, W]
        hidden = self.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        pool = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]
        selected = torch.cat(pool, dim=-1)  # [1, patches, D * layers]
        features = self.projector(selected)
        return {"tower": selected, "projector": features.reshape(-1, features.shape[-1])}

    def forward(self, inputs: dict[str, torch.Tensor]) -> ImageFeatures:
        return ImageFeatures(self.stages(inputs)["projector"])


class Qwen3VLEncoder(ImageEncoder):
    """The Qwen3-VL vision transformer with its patch merger, and the DeepStack mergers' features
    from early tower blocks (`Qwen3VLModel.get_image_features`)."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers import AutoModel

        self.tower = AutoModel.from_config(config.vision_config)

    def _run(self, inputs: dict[str, torch.Tensor]) -> Any:
        pixels = inputs["pixel_values"].to(self.dtype)  # [patches, C * T * P * P]
        return self.tower(pixels, grid_thw=inputs["image_grid_thw"], return_dict=True)

    def stages(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self._run(inputs)
        stages = {"tower": out.last_hidden_state, "merger": out.pooler_output}
        stages |= {f"deepstack {i}": f for i, f in enumerate(out.deepstack_features)}
        return stages

    def forward(self, inputs: dict[str, torch.Tensor]) -> ImageFeatures:
        out = self._run(inputs)
        return ImageFeatures(out.pooler_output, tuple(out.deepstack_features))


ENCODERS: dict[str, type[ImageEncoder]] = {
    "idefics3": Idefics3Encoder,
    "llava": LlavaEncoder,
    "qwen3_vl": Qwen3VLEncoder,
}


def build_encoder(vision: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> ImageEncoder:
    """The family's encoder with uninitialised parameters of `dtype` on `device` (the loader fills
    them); buffers (position ids, rotary frequencies) keep what transformers computed."""
    from transformers.initialization import no_init_weights

    config = hf_config(vision)
    with no_init_weights(), torch.device(device):
        encoder = ENCODERS[vision.family](config)
    for p in encoder.parameters():
        p.data = p.data.to(dtype)
    return encoder.eval()
