"""A request's images inside the engine: where their placeholder tokens lie in the prompt, their
M-RoPE positions, what each page of the prompt mixes into its hash, and (`ImageFeeder`) the
features each prefill chunk takes, encoded once through the encoder cache.

Placeholders are matched to images in order: the first `images[0].num_tokens` placeholder tokens
of the prompt are the first image's feature rows, and so on (an Idefics3 image split into tiles
has several runs, with row and column tokens between them).

M-RoPE (Qwen-VL): a text token's three positions are equal and one past the previous token's
largest; an image's tokens take (start, start + row, start + column) over its feature grid, and
the text after it resumes at start + max(rows, columns). So positions after an image run behind
the KV index; generated tokens continue at index + `rope_delta`. Pages hash these positions too
(`page_extra`): a page's KV depends on them, and they are no longer implied by its index.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field

import torch

from engine.model.vision.encoder import ImageEncoder, ImageFeatures
from engine.model.vision.inputs import ImageInput
from engine.model.vision.step import ChunkImages
from engine.scheduling.encoder_cache import EncoderCache


@dataclass(slots=True, eq=False)
class RequestImages:
    """Attributes:
    images: the request's images, in prompt order.
    positions: prompt positions of every placeholder token, ascending.
    first_row: per image, the index in `positions` of its first placeholder.
    prompt_len: tokens in the prompt.
    rope: per axis (temporal, height, width), the M-RoPE position of every prompt token; None
        for models with 1-D positions.
    rope_delta: a generated token's M-RoPE position minus its index.
    held: indices of images whose features this request still needs from the encoder cache.
    """

    images: list[ImageInput]
    positions: list[int]
    first_row: list[int]
    prompt_len: int
    rope: list[list[int]] | None = None
    rope_delta: int = 0
    held: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, prompt_ids: list[int], images: list[ImageInput], image_token_id: int, mrope: bool) -> RequestImages:
        """Raises ValueError (naming `images`) when the prompt's placeholders do not match the images."""
        positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
        wanted = sum(im.num_tokens for im in images)
        if len(positions) != wanted:
            raise ValueError(
                f"images: the prompt has {len(positions)} image placeholder tokens (id {image_token_id}), "
                f"its {len(images)} image(s) fill {wanted}"
            )
        first_row, row = [], 0
        for im in images:
            if im.num_tokens < 1:
                raise ValueError("images: an image fills no placeholder token")
            first_row.append(row)
            row += im.num_tokens
        out = cls(list(images), positions, first_row, len(prompt_ids))
        if mrope:
            out.rope, out.rope_delta = out._mrope(len(prompt_ids))
        return out

    def _mrope(self, n: int) -> tuple[list[list[int]], int]:
        rope: list[list[int]] = [[], [], []]
        cur, i = 0, 0
        starts = {self.positions[r]: k for k, r in enumerate(self.first_row)}
        while i < n:
            k = starts.get(i)
            if k is None:
                for axis in rope:
                    axis.append(cur)
                cur, i = cur + 1, i + 1
                continue
            im = self.images[k]
            if im.grid is None:
                raise ValueError(f"images[{k}]: no feature grid, needed for M-RoPE positions")
            t, h, w = im.grid
            if t * h * w != im.num_tokens or self.positions[self.first_row[k] + im.num_tokens - 1] != i + t * h * w - 1:
                raise ValueError(
                    f"images[{k}]: its {im.num_tokens} placeholders are not one run of its {t}x{h}x{w} grid"
                )
            for tt in range(t):
                for r in range(h):
                    for c in range(w):
                        rope[0].append(cur + tt)
                        rope[1].append(cur + r)
                        rope[2].append(cur + c)
            cur, i = cur + max(h, w), i + t * h * w
        return rope, cur - n

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The placeholder rows (indices into `positions`) of tokens [start, end)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)

    def image_of(self, row: int) -> int:
        return bisect.bisect_right(self.first_row, row) - 1

    def end_of(self, k: int) -> int:
        """The prompt position just after image k's last placeholder."""
        return self.positions[self.first_row[k] + self.images[k].num_tokens - 1] + 1

    def rope_at(self, start: int, end: int) -> list[list[int]] | None:
        """Per axis, the M-RoPE positions of tokens [start, end) (prompt or generated)."""
        if self.rope is None:
            return None
        out = [axis[start : min(end, self.prompt_len)] for axis in self.rope]
        later = list(range(max(start, self.prompt_len) + self.rope_delta, end + self.rope_delta))
        return [axis + later for axis in out]

    def page_extra(self, page: int, page_size: int) -> bytes:
        """What page `page` mixes into its hash besides its token ids: for each image whose
        placeholders it holds, the image's content hash and the first feature row it holds; and
        under M-RoPE, the page's positions wherever they differ from its index. b"" for a page
        with neither (its hash is then what a text-only model's would be)."""
        a, b = page * page_size, (page + 1) * page_size
        ri, rj = self.rows_in(a, b)
        out = b""
        row = ri
        while row < rj:
            k = self.image_of(row)
            out += self.images[k].content_hash + struct.pack("<i", row - self.first_row[k])
            row = self.first_row[k] + self.images[k].num_tokens
        rope = self.rope_at(a, b)
        if rope is not None and any(p != a + j for axis in rope for j, p in enumerate(axis)):
            out += struct.pack(f"<{3 * (b - a)}i", *rope[0], *rope[1], *rope[2])
        return out


class ImageFeeder:
    """Gives each prefill chunk its image inputs, encoding each image once (`EncoderCache`)."""

    def __init__(self, encoder: ImageEncoder, cache: EncoderCache[ImageFeatures], device: torch.device):
        self.encoder = encoder
        self.cache = cache
        self.device = device
        self.encode_s = 0.0  # seconds spent in the encoder
        self.num_encoded = 0

    def chunk(self, owner: object, images: RequestImages, start: int, end: int) -> ChunkImages | None:
        """The inputs of tokens [start, end) of a request: its image rows' features and, under
        M-RoPE, the tokens' positions (None when the chunk needs neither)."""
        ri, rj = images.rows_in(start, min(end, images.prompt_len))
        rope = images.rope_at(start, end)
        if rope is not None and all(p == start + j for axis in rope for j, p in enumerate(axis)):
            rope = None
        if ri == rj and rope is None:
            return None
        embeds: list[torch.Tensor] = []
        deepstack: list[list[torch.Tensor]] = []
        row = ri
        while row < rj:
            k = images.image_of(row)
            features = self._features(owner, images, k)
            a = row - images.first_row[k]
            b = min(rj - images.first_row[k], images.images[k].num_tokens)
            embeds.append(features.embeds[a:b])
            for i, layer in enumerate(features.deepstack):
                if len(deepstack) <= i:
                    deepstack.append([])
                deepstack[i].append(layer[a:b])
            row = images.first_row[k] + b
        rows = [images.positions[r] - start for r in range(ri, rj)]
        return ChunkImages(
            rows=rows,
            embeds=torch.cat(embeds) if embeds else torch.empty(0),
            deepstack=tuple(torch.cat(parts) for parts in deepstack),
            rope_positions=None if rope is None else torch.tensor(rope, dtype=torch.int64),
        )

    def _features(self, owner: object, images: RequestImages, k: int) -> ImageFeatures:
        key = images.images[k].content_hash
        if k not in images.held:
            images.held.add(k)
            self.cache.hold(key, owner)
        features = self.cache.get(key)
        if features is None:
            import time

            t0 = time.perf_counter()
            with torch.inference_mode():
                tensors = {n: t.to(self.device) for n, t in images.images[k].tensors.items()}
                features = self.encoder(tensors)
            self.encode_s += time.perf_counter() - t0
            self.num_encoded += 1
            if features.embeds.shape[0] != images.images[k].num_tokens:
                raise ValueError(
                    f"images[{k}]: the encoder gave {features.embeds.shape[0]} feature rows for "
                    f"{images.images[k].num_tokens} placeholder tokens"
                )
            self.cache.put(key, features)
        return features

    def computed(self, owner: object, images: RequestImages, num_computed: int) -> None:
        """After a step: images whose placeholders are all computed are released."""
        done = [k for k in images.held if images.end_of(k) <= num_computed]
        for k in done:
            self._release(owner, images, k)

    def finish(self, owner: object, images: RequestImages) -> None:
        for k in list(images.held):
            self._release(owner, images, k)

    def _release(self, owner: object, images: RequestImages, k: int) -> None:
        images.held.discard(k)
        key = images.images[k].content_hash
        if not any(images.images[j].content_hash == key for j in images.held):
            self.cache.release(key, owner)
