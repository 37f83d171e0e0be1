"""A rendered prompt with images to token ids: each image marker becomes that image's placeholder
run, as the checkpoint's processor writes it (`engine.loading.images.ImageProcessor`).

The chat template renders each image part as the model's marker (`<image>`, Qwen3-VL's
`<|vision_start|><|image_pad|><|vision_end|>`); the text between markers is tokenized alone and
each image's run spliced in between, as the processor does for one image. A marker count that
differs from the image count (a template that dropped a message, or a text that writes the
marker itself) is a 400.

KV reuse works as for text (`sessions.render.build_prompt`): the previous turn's prompt + output
ids P + O stand for a text whose image runs are expanded; when the new rendering, with its runs
expanded the same way, starts with that text, only what follows is tokenized (its new images
spliced in), so the earlier images' pages are found again. Otherwise the prompt is built whole.
Every image of the context is preprocessed again either way (the engine needs its inputs for
each run; the encoder cache and the prefix cache spare the encoding and the prefill).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.loading.tokenizer import Tokenizer
from sessions.errors import InvalidParam
from sessions.render import Prompt, decode_exact, encode

log = logging.getLogger("longctx.sessions")


def image_prompt(
    processor: Any,
    tokenizer: Tokenizer,
    text: str,
    pictures: Sequence[bytes],
    previous: Sequence[int] | None,
    param: str = "input",
) -> Prompt:
    """Prompt ids for rendered `text` holding one marker per picture (see the module docstring).

    Args:
        processor: the checkpoint's `ImageProcessor`.
        pictures: the images' bytes, in the order their markers appear.
        previous: the last turn's prompt + output ids, or None.
        param: the request field a marker mismatch names.
    Raises:
        InvalidParam: the rendering holds another number of markers than there are images.
    """
    marker = processor.marker
    pieces = text.split(marker)
    if len(pieces) != len(pictures) + 1:
        raise InvalidParam(
            param,
            f"the prompt renders {len(pieces) - 1} image markers ({marker}) for {len(pictures)} images: "
            "a text may not write the marker itself",
        )
    runs = [processor.image(p) for p in pictures]
    images = tuple(item for _, item in runs)
    if previous:
        reused = _continue(tokenizer, pieces, [ids for ids, _ in runs], previous)
        if reused is not None:
            return Prompt(reused, len(previous), text, images)
        log.info("prompt with images re-rendered whole: it does not continue the last turn's %d tokens", len(previous))
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        ids += encode(tokenizer, piece) if piece else []
        if k < len(runs):
            ids += runs[k][0]
    return Prompt(ids, 0, text, images)


def _continue(
    tokenizer: Tokenizer, pieces: list[str], runs: list[list[int]], previous: Sequence[int]
) -> list[int] | None:
    """`previous` + the ids of what the rendering adds after it, or None when it does not continue it."""
    head = decode_exact(tokenizer, previous)
    parts: list[tuple[str, list[int] | None]] = []  # (text, None) or (a run's text, its ids)
    for k, piece in enumerate(pieces):
        parts.append((piece, None))
        if k < len(runs):
            parts.append((decode_exact(tokenizer, runs[k]), runs[k]))
    expanded = "".join(s for s, _ in parts)
    if not expanded.startswith(head) or len(expanded) <= len(head):
        return None
    ids, pos, cut = list(previous), 0, len(head)
    for s, run in parts:
        end = pos + len(s)
        if end > cut:
            if run is None:
                ids += encode(tokenizer, s[max(0, cut - pos) :])
            elif pos < cut:  # the previous turn ended inside an image's run: it cannot have
                return None
            else:
                ids += run
        pos = end
    return ids
