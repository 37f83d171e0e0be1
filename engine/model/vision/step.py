"""What a decoder step takes besides token ids when images are in it, and the three places the
decoder uses it: the input embeddings (image features replace the placeholders'), the rotary
angles (M-RoPE positions per axis), and the outputs of the DeepStack layers (features added).

`CausalLM.forward` and the compiled step call the same three functions, so both paths merge
images identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class StepImages:
    """One step's image inputs, in the rows of its flat batch (all tensors on the model's device).

    Attributes:
        rows: [N] int64, the step's rows whose embeddings are image features (ascending).
        embeds: [N, hidden], the features for those rows, in the model's dtype.
        deepstack: per DeepStack layer, [N, hidden] added to that layer's output at `rows`.
        rope_positions: [3, T] int64 (temporal, height, width) positions of every row of the
            step for M-RoPE, or None when every row's position is its KV index.
    """

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()
    rope_positions: torch.Tensor | None = None


def merge_embeddings(x: torch.Tensor, images: StepImages | None) -> torch.Tensor:
    """x [T, hidden] (token embeddings) with the image rows replaced by their features."""
    if images is None or images.rows.numel() == 0:
        return x
    return x.index_copy(0, images.rows, images.embeds.to(x.dtype))


def rotary(
    rope: RotaryEmbedding, positions: torch.Tensor, images: StepImages | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, D] of the step: from the M-RoPE positions when the step has them, else from
    the 1-D positions [T]. A padded step (the compiled step's bucket) pads M-RoPE positions too."""
    if images is None or images.rope_positions is None:
        return rope.cos_sin(positions, dtype)
    axes = images.rope_positions
    pad = positions.shape[0] - axes.shape[1]
    if pad > 0:
        axes = torch.nn.functional.pad(axes, (0, pad))
    return rope.cos_sin_axes(axes, dtype)


def add_deepstack(x: torch.Tensor, images: StepImages | None, layer: int) -> torch.Tensor:
    """After decoder layer `layer`: its output x [T, hidden] (one addend of it: the residual is
    added later) plus that layer's DeepStack features at the image rows (Qwen3-VL)."""
    if images is None or layer >= len(images.deepstack) or images.rows.numel() == 0:
        return x
    return x.index_add(0, images.rows, images.deepstack[layer].to(x.dtype))


@dataclass(frozen=True)
class ChunkImages:
    """One sequence chunk's image inputs (`engine.model_runner.Chunk.images`), rows counted from
    the chunk's first token.

    Attributes:
        rows: the chunk's rows that take image features, ascending.
        embeds: [len(rows), hidden] features; deepstack: per DeepStack layer, the same shape.
        rope_positions: [3, q] int64 M-RoPE positions of the chunk's q tokens (None: its KV index).
    """

    rows: list[int]
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()
    rope_positions: torch.Tensor | None = None


def gather_step(
    chunks: list[tuple[int, int, ChunkImages | None]], positions: torch.Tensor, device: torch.device
) -> StepImages | None:
    """The step's `StepImages` from its chunks' (first row, tokens, images), or None when no chunk
    has any. `positions` [T]: the step's 1-D positions, the M-RoPE positions of chunks without
    their own (all three axes alike)."""
    parts = [(offset, n, c) for offset, n, c in chunks if c is not None]
    if not parts:
        return None
    rows = [offset + r for offset, _, c in parts for r in c.rows]
    embeds = [c.embeds for _, _, c in parts if c.rows]
    layers = max(len(c.deepstack) for _, _, c in parts)
    rope = None
    if any(c.rope_positions is not None for _, _, c in parts):
        rope = positions.to(device).expand(3, -1).clone()  # [3, T]
        for offset, n, c in parts:
            if c.rope_positions is not None:
                rope[:, offset : offset + n] = c.rope_positions.to(device)
    hidden = embeds[0].shape[-1] if embeds else 0
    dtype = embeds[0].dtype if embeds else torch.float32
    return StepImages(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        embeds=torch.cat(embeds).to(device) if embeds else torch.empty(0, hidden, dtype=dtype, device=device),
        deepstack=tuple(torch.cat([c.deepstack[i] for _, _, c in parts if c.rows]).to(device) for i in range(layers)),
        rope_positions=rope,
    )
