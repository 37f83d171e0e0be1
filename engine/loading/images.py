"""A vision-language checkpoint's image preprocessing: its own image processor (transformers',
Pillow backend) and how its prompts spell an image's placeholder run.

Each image becomes its placeholder ids (the run of image tokens and whatever the family puts
around them) and an `ImageInput` (the processor's tensors, their content hash, the token count,
and the M-RoPE grid). Idefics3 and Llava expand through the checkpoint's transformers processor,
one image at a time (their expansions start and end with special tokens, so splicing them
between text tokenized alone changes no id). Processors that bundle a video processor cannot be
built without torchvision (SmolVLM's also wants `num2words`); for those the image processor runs
alone and the run is written as the processor writes it: SmolVLM's by transformers' own
`get_image_prompt_string` over the image processor's tile rows and columns, Qwen3-VL's as
`<|vision_start|>` + `<|image_pad|>` x (grid / merge^2) + `<|vision_end|>`.

transformers picks torchvision-backed image processors when torchvision imports; the torchvision
wheel for our torch does not import here, and the Pillow backends need nothing else.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from engine.model.vision.config import VisionConfig
from engine.model.vision.inputs import ImageInput, content_hash

QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


class BadImage(ValueError):
    """Bytes Pillow cannot read as an image."""


def open_image(data: bytes | str | Path | Any) -> Any:
    """A Pillow RGB image from bytes, a path or an image; a GIF's first frame (PNG, JPEG, WebP,
    GIF, and whatever else Pillow reads)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        return data.convert("RGB")
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else Path(data))
        image.seek(0)
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadImage(f"not a readable image: {e}") from e
    return image.convert("RGB")


class ImageProcessor:
    """Args: vision: the checkpoint's vision side; processor: its transformers processor (None
    for Qwen3-VL); image_processor: its image processor; tokenizer: the processor's tokenizer."""

    def __init__(self, vision: VisionConfig, processor: Any, image_processor: Any, tokenizer: Any):
        self.vision = vision
        self.processor = processor
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_seq_len = 0  # SmolVLM without its processor: image tokens per tile
        if vision.family == "qwen3_vl":
            self.marker = QWEN_MARKER
            ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
            self.wrap: tuple[int, int] = (int(ids[0]), int(ids[1]))
        elif processor is None:  # SmolVLM's tokens, as its processor names them
            self.marker = str(getattr(tokenizer, "image_token", "<image>"))
            raw = vision.raw
            v = raw.get("vision_config") or {}
            per_side = int(v.get("image_size", 512)) // int(v.get("patch_size", 16))
            self.image_seq_len = int(per_side**2 / int(raw.get("scale_factor", 1)) ** 2)
        else:
            self.marker = str(processor.image_token)

    @classmethod
    def load(cls, directory: str | Path, vision: VisionConfig) -> ImageProcessor:
        """The processor saved with the checkpoint in `directory`."""
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        if vision.family != "qwen3_vl":
            try:
                processor = AutoProcessor.from_pretrained(str(directory), backend="pil")
            except (ImportError, TypeError, AttributeError, ValueError, OSError):
                if vision.architecture != "SmolVLMForConditionalGeneration":
                    raise
            else:
                return cls(vision, processor, processor.image_processor, processor.tokenizer)
        image_processor = AutoImageProcessor.from_pretrained(str(directory), backend="pil")
        return cls(vision, None, image_processor, AutoTokenizer.from_pretrained(str(directory)))

    def image(self, image: Any) -> tuple[list[int], ImageInput]:
        """One image (bytes, path or Pillow image): its placeholder ids and its `ImageInput`."""
        picture = open_image(image)
        token = self.vision.image_token_id
        if self.processor is None and self.vision.family == "idefics3":
            return self._smolvlm(picture)
        if self.processor is None:  # Qwen3-VL: the image processor alone, the run written here
            out = self.image_processor(images=[picture], return_tensors="pt")
            tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            t, h, w = (int(n) for n in tensors["image_grid_thw"][0])
            m = self.vision.spatial_merge_size
            n = t * h * w // (m * m)
            ids = [self.wrap[0], *([token] * n), self.wrap[1]]
            return ids, ImageInput(content_hash(tensors), tensors, n, (t, h // m, w // m))
        out = self.processor(text=[self.marker], images=[[picture]], return_tensors="pt", add_special_tokens=False)
        ids = [int(i) for i in out["input_ids"][0]]
        tensors = {
            k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k not in ("input_ids", "attention_mask")
        }
        n = sum(1 for i in ids if i == token)
        return ids, ImageInput(content_hash(tensors), tensors, n)

    def _smolvlm(self, picture: Any) -> tuple[list[int], ImageInput]:
        """SmolVLM's image processor alone; the run from transformers' `get_image_prompt_string`."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        out = self.image_processor(images=[[picture]], return_tensors="pt", return_row_col_info=True)
        tok = self.tokenizer
        text = get_image_prompt_string(
            int(out["rows"][0][0]), int(out["cols"][0][0]), self.image_seq_len,
            fake_token_around_image=str(getattr(tok, "fake_image_token", "<fake_token_around_image>")),
            image_token=self.marker, global_image_token=str(getattr(tok, "global_image_token", "<global-img>")),
        )  # fmt: skip
        ids = [int(i) for i in tok.encode(text, add_special_tokens=False)]
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        n = sum(1 for i in ids if i == self.vision.image_token_id)
        return ids, ImageInput(content_hash(tensors), tensors, n)

    def prompt(
        self, text: str, images: list[Any], add_special_tokens: bool = True
    ) -> tuple[list[int], list[ImageInput]]:
        """Token ids of `text` with each image's placeholder run where the text has the marker
        (`self.marker`), in order; a text without markers gets the images first. Returns the ids
        and the images' inputs.

        Raises:
            ValueError: the text has markers, but not one per image.
        """
        parts = text.split(self.marker)
        if len(parts) == 1 and images:
            parts = [""] * len(images) + [text]
        if len(parts) != len(images) + 1:
            raise ValueError(f"the prompt has {len(parts) - 1} image markers ({self.marker}) for {len(images)} images")
        ids = [int(i) for i in self.tokenizer.encode(parts[0], add_special_tokens=add_special_tokens)]
        inputs = []
        for image, part in zip(images, parts[1:], strict=True):
            run, item = self.image(image)
            ids += run
            inputs.append(item)
            ids += [int(i) for i in self.tokenizer.encode(part, add_special_tokens=False)] if part else []
        return ids, inputs

    def chat_text(self, tokenizer: Any, text: str, num_images: int) -> str:
        """The user turn `[images..., text]` rendered by the chat template (with the generation
        prompt), images written as markers: the model's template where it renders image parts,
        else the markers before the text in a plain message."""
        parts: list[dict[str, Any]] = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        for content in (parts, self.marker * num_images + text):
            try:
                rendered = tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
                )
            except Exception:  # a template that cannot render content lists
                continue
            if isinstance(rendered, str) and rendered.count(self.marker) == num_images:
                return rendered
        raise ValueError("the chat template renders no image markers")
