"""One image as a request carries it into the engine: what the checkpoint's image processor made
of it, the placeholder tokens it fills, and a hash of its content.

The hash names the preprocessed tensors (names, dtypes, shapes, bytes), so it is what the
encoder will see: the same picture preprocessed alike hashes alike whatever file format it came
in, and an M-RoPE grid (part of the tensors) is covered too. It keys the encoder cache and is
mixed into the hashes of the KV pages that hold the image's placeholder tokens
(`engine/scheduling/images.py`): every image uses the same placeholder id, so two different
images of the same size would otherwise share pages.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """Attributes:
    content_hash: 16 bytes, `content_hash(tensors)`.
    tensors: the image processor's outputs for this image alone, batch dimension kept
        (`pixel_values`, and `pixel_attention_mask` or `image_grid_thw` where the family has them).
    num_tokens: its placeholder tokens in the prompt (= rows of its encoded features).
    grid: (t, h, w) of its features after the spatial merge, for M-RoPE positions; None for
        models with 1-D positions.
    """

    content_hash: bytes
    tensors: dict[str, torch.Tensor]
    num_tokens: int
    grid: tuple[int, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def content_hash(tensors: dict[str, torch.Tensor]) -> bytes:
    """blake2b-128 over each tensor (by name): its name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
    return h.digest()
