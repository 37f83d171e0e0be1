"""Tiny random vision-language checkpoints, saved with their processors and a small tokenizer,
and ways to run them through our engine against transformers.

Each family's checkpoint is a real transformers model (random weights, norms and biases
randomised) saved with `save_pretrained` beside its processor: our loader, image processor and
engine read the same directory a user's checkpoint would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.loading.images import ImageProcessor
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from engine.model.vision.inputs import ImageInput
from engine.model_runner import Chunk, ModelRunner
from engine.scheduling.encoder_cache import EncoderCache
from engine.scheduling.images import ImageFeeder, RequestImages
from kvstore.block_pool import BlockPool
from tests.tiny_models import _randomize_norms_and_biases, make_runner

TEXT = "The quick brown fox jumps over the lazy dog. What is in this picture? A red square on blue sky."
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ IMAGE }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = {
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
    "smolvlm": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
    "llava": ["<image>"],
    "llava_siglip": ["<image>"],
    "qwen3_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}
MARKERS = {f: "<image>" for f in ("idefics3", "smolvlm", "llava", "llava_siglip")} | {
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>"
}
# Families whose transformers processor is saved (the others: image processor and tokenizer).
WITH_PROCESSOR = ("idefics3", "llava", "llava_siglip")


def tiny_tokenizer(family: str) -> Any:
    """A byte-level BPE of 300 tokens trained on `TEXT`, with the family's special tokens and a
    ChatML template that renders image parts as the family's marker."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    tok.train_from_iterator([TEXT] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[family]})
    fast.chat_template = CHAT_TEMPLATE.replace("IMAGE", repr(MARKERS[family]))
    return fast


def _ids(tok: Any, *names: str) -> list[int]:
    return [int(i) for i in tok.convert_tokens_to_ids(list(names))]


TEXT_SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)  # fmt: skip


def build_checkpoint(family: str, path: Path, seed: int = 0, **text: Any) -> Any:
    """A tiny random model of `family` saved with its processor into `path`; returns the
    transformers model (float32, eval)."""
    from transformers import AutoProcessor

    tok = tiny_tokenizer(family)
    V = len(tok)
    torch.manual_seed(seed)
    cfg: Any  # each family's config, model and image processor classes
    ref: Any
    ip: Any
    if family == "idefics3":
        from transformers import (
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessorPil,
            Idefics3Processor,
        )

        cfg = Idefics3Config(
            text_config=dict(model_type="llama", vocab_size=V, **(TEXT_SMALL | text)),
            vision_config=dict(
                hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8,
            ),
            scale_factor=2, image_token_id=_ids(tok, "<image>")[0],
        )  # fmt: skip
        ref = Idefics3ForConditionalGeneration(cfg)
        ip = Idefics3ImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
        )
        Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4).save_pretrained(path)
    elif family == "smolvlm":  # its processor needs torchvision and num2words: saved without it
        from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

        cfg = SmolVLMConfig(
            text_config=dict(model_type="llama", vocab_size=V, **(TEXT_SMALL | text)),
            vision_config=dict(
                hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8,
            ),
            scale_factor=2, image_token_id=_ids(tok, "<image>")[0],
        )  # fmt: skip
        ref = SmolVLMForConditionalGeneration(cfg)
        SmolVLMImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
        ).save_pretrained(path)
        tok.save_pretrained(path)
    elif family == "llava_siglip":  # a SigLIP tower (no CLS token: every patch), a Qwen2 decoder
        from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessorPil

        cfg = LlavaConfig(
            text_config=dict(model_type="qwen2", vocab_size=V, **(TEXT_SMALL | text)),
            vision_config=dict(
                model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=2, image_size=28, patch_size=7,
            ),
            image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=-1, vision_feature_select_strategy="full",
            multimodal_projector_bias=True, tie_word_embeddings=True,
        )  # fmt: skip
        ref = LlavaForConditionalGeneration(cfg)
        ip = SiglipImageProcessorPil(size={"height": 28, "width": 28})
        LlavaProcessor(
            image_processor=ip, tokenizer=tok, patch_size=7, vision_feature_select_strategy="full",
            num_additional_image_tokens=0,
        ).save_pretrained(path)  # fmt: skip
    elif family == "llava":
        from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

        cfg = LlavaConfig(
            text_config=dict(model_type=text.pop("model_type", "llama"), vocab_size=V, **(TEXT_SMALL | text)),
            vision_config=dict(
                model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32,
            ),
            image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )  # fmt: skip
        ref = LlavaForConditionalGeneration(cfg)
        ip = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        LlavaProcessor(
            image_processor=ip, tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        ).save_pretrained(path)  # fmt: skip
    elif family == "qwen3_vl":
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        start, end, pad, video = _ids(tok, *SPECIAL["qwen3_vl"])
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        cfg = Qwen3VLMoeConfig(
            text_config=dict(
                vocab_size=V, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1, rope_parameters=rope, **(TEXT_SMALL | {"num_hidden_layers": 3} | text),
            ),
            vision_config=dict(
                depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
            ),
            image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        )  # fmt: skip
        ref = Qwen3VLMoeForConditionalGeneration(cfg)
        ip = Qwen2VLImageProcessorPil(
            patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
        )
        ip.save_pretrained(path)
        tok.save_pretrained(path)
    else:
        raise ValueError(family)
    ref = ref.eval()
    _randomize_norms_and_biases(ref)
    with torch.no_grad():  # the vision side's norms too (layer_norm1, post_layernorm, norm1, ln_q, ...)
        for name, p in ref.named_parameters():
            if p.dim() == 1 and name.endswith(".weight") and ("norm" in name or ".ln_" in name):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    ref.save_pretrained(path)
    if family in WITH_PROCESSOR:
        AutoProcessor.from_pretrained(path)  # loads back
    return ref


def image(seed: int, height: int = 40, width: int = 56) -> Any:
    """A random RGB Pillow image."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


@dataclass
class TinyVLM:
    family: str
    ref: Any  # transformers' model, float32
    path: Path
    config: ModelConfig
    model: CausalLM
    processor: ImageProcessor

    def prompt(self, text: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        return self.processor.prompt(text, images)


def build_tiny_vlm(family: str, path: Path, dtype: torch.dtype = torch.float32, **text: Any) -> TinyVLM:
    ref = build_checkpoint(family, path, **text)
    config = ModelConfig.from_pretrained_dir(path)
    model, _ = load_model(config, SafetensorsSource(path), dtype, progress=False)
    return TinyVLM(family, ref, path, config, model, ImageProcessor.load(path, config.vision))  # type: ignore[arg-type]


def reference_logits(t: TinyVLM, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
    """transformers' full-sequence forward over the same ids and preprocessed images: [T, V]."""
    with torch.no_grad():
        return t.ref(**reference_inputs(t, ids, images), use_cache=False).logits[0].float()


def run_chunks(
    t: TinyVLM, runner: ModelRunner, pool: BlockPool, ids: list[int], images: list[ImageInput], chunk: int,
    feeder: ImageFeeder | None = None,
) -> torch.Tensor:  # fmt: skip
    """Our logits for every position, `chunk` tokens per step, images fed as the engine feeds them."""
    vision = t.config.vision
    assert vision is not None and t.model.vision is not None
    placed = RequestImages.build(ids, images, vision.image_token_id, bool(t.config.rope.mrope_section))
    feeder = feeder or ImageFeeder(t.model.vision, EncoderCache(1 << 20), torch.device("cpu"))
    owner = object()
    pages = pool.allocate(-(-len(ids) // runner.kv_cache.spec.page_size))
    try:
        outs = []
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            inputs = feeder.chunk(owner, placed, start, end)
            outs.append(runner.run([Chunk(ids[start:end], pages, end, 0, inputs)], all_logits=True))
            feeder.computed(owner, placed, end)
        return torch.cat(outs)
    finally:
        pool.free(pages)
        feeder.finish(owner, placed)


def vlm_runner(t: TinyVLM) -> tuple[ModelRunner, BlockPool]:
    runner = make_runner(t.config, t.model)
    return runner, BlockPool(runner.kv_cache.num_pages)


def reference_inputs(t: TinyVLM, ids: list[int], images: list[ImageInput]) -> dict[str, Any]:
    """transformers' forward / generate arguments for these ids and preprocessed images (the
    doctor's vision stage builds them the same way)."""
    from api.doctor.vision_stage import reference_kwargs

    vision = t.config.vision
    assert vision is not None
    if not images:
        return {"input_ids": torch.tensor([ids])}
    return reference_kwargs(vision.family, ids, images, vision.image_token_id)


def reference_greedy(t: TinyVLM, ids: list[int], images: list[ImageInput], n: int) -> list[int]:
    """transformers' greedy `generate` of n tokens (end-of-sequence ignored)."""
    t.ref.generation_config.eos_token_id = None
    t.ref.generation_config.pad_token_id = 0
    kwargs = reference_inputs(t, ids, images)
    with torch.no_grad():
        out = t.ref.generate(**kwargs, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return [int(x) for x in out[0, len(ids) :]]
