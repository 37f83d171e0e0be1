"""Image parts of requests to image bytes, checked: Responses' `input_image` and Chat's `image_url`.

An image arrives as a data URL (`data:image/png;base64,...`), or, with `--allow-image-urls`, an
http(s) URL fetched by `sessions.image_fetch`; a `file_id` is refused (no Files API here). Its
bytes must be a PNG, JPEG, WebP or GIF (its first frame) that Pillow reads, of at most
`--max-image-bytes` bytes and `--max-image-pixels` pixels, and a request's input may hold at most
`--max-images` of them. `detail` is accepted and left to the checkpoint's own processor (its
resolution is the model's). Every refusal is an `InvalidParam` naming the part
(`input[0].content[1].image_url`, `messages[2].content[0].image_url`); on a model without a vision
encoder any image part is a 400 naming the model.

An http(s) part is fetched once, when its request is checked: the bytes stay on the part
(`InputImage.fetched`), its turn's prompt is rendered from them, and the store keeps them by
reference (`sessions.image_store`), so a later turn (after a restart, on another replica) renders
the bytes first fetched, never the URL's content of the day. Data URLs' bytes are kept by URL in a
bounded LRU, so a conversation's images are not decoded and checked again on every turn.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from msgspec import UNSET

from sessions.config import ImageConfig
from sessions.errors import InvalidParam
from sessions.image_fetch import FetchError, fetch_async
from sessions.items import InputImage, Item, images_of

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
CACHE_BYTES = 64 << 20


class ImageParts:
    """Args:
    config: the limits and URL policy.
    marker: the model's image marker (`engine.loading.images.ImageProcessor.marker`); None for a
        model that takes no image input.
    model: the served model's name, which a refusal on a text-only model names.
    """

    def __init__(self, config: ImageConfig, marker: str | None, model: str):
        self.config, self.marker, self.model = config, marker, model
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0

    def refuse_all(self, param: str, kind: str) -> InvalidParam:
        return InvalidParam(
            f"{param}.type", f"content part type {kind!r} is not supported: the model {self.model} takes no image input"
        )

    async def check_items(self, items: Sequence[Item], where: str = "input") -> None:
        """Every image part of a request's input items, read and checked (an http(s) part keeps
        the bytes fetched: `InputImage.fetched`; see the module docstring)."""
        found = images_of(list(items))
        for n, (i, j, part) in enumerate(found):
            param = f"{where}[{i}].content[{j}]"
            if self.marker is None:
                raise self.refuse_all(param, "input_image")
            if n == self.config.max_images:
                raise InvalidParam(param, f"at most {self.config.max_images} images per request (--max-images)")
            await self.read(part, param)

    async def read(self, part: InputImage, param: str) -> bytes:
        """The bytes of one `input_image` part; InvalidParam naming what is wrong with it."""
        if isinstance(part.file_id, str) and not isinstance(part.image_url, str):
            raise InvalidParam(f"{param}.file_id", "file_id is not supported; send the image as image_url")
        if not isinstance(part.image_url, str):
            raise InvalidParam(f"{param}.image_url", "an input_image needs an image_url")
        if part.fetched is not None:
            return part.fetched
        data = await self.url_bytes(part.image_url, f"{param}.image_url")
        if not part.image_url.startswith("data:"):
            part.keep_fetched(data)
        return data

    async def url_bytes(self, url: str, param: str) -> bytes:
        """The checked bytes of a data URL or (when allowed) an http(s) URL, fetched now."""
        key = hashlib.sha256(url.encode()).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        c = self.config
        if url.startswith("data:"):
            data = self._data_url(url, param)
        elif url.startswith(("http://", "https://")):
            if not c.allow_urls:
                raise InvalidParam(param, "http(s) image URLs are off here (--allow-image-urls); send a data URL")
            try:
                data = await fetch_async(
                    url, max_bytes=c.max_bytes, timeout_s=c.fetch_timeout_s, allow_private=c.allow_private_urls
                )
            except FetchError as e:
                raise InvalidParam(param, f"cannot fetch the image: {e}") from None
        else:
            raise InvalidParam(param, "expected a data URL (data:image/...;base64,...) or an http(s) URL")
        check_image(data, param, c)
        if url.startswith("data:"):  # a URL's content may change: each request fetches its own
            self._keep(key, data)
        return data

    def _data_url(self, url: str, param: str) -> bytes:
        head, comma, payload = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise InvalidParam(param, "a data URL must be base64: data:image/png;base64,...")
        if len(payload) * 3 // 4 > self.config.max_bytes + 2:
            raise InvalidParam(param, f"the image is over {self.config.max_bytes} bytes (--max-image-bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParam(param, "the data URL's payload is not valid base64") from None
        if len(data) > self.config.max_bytes:
            raise InvalidParam(param, f"the image is {len(data)} bytes; at most {self.config.max_bytes}")
        return data

    def _keep(self, key: bytes, data: bytes) -> None:
        self._cache[key] = data
        self._cached += len(data)
        while self._cached > CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)

    async def pictures(self, items: Sequence[Item], where: str = "input") -> list[bytes]:
        """The bytes of every image part of `items` (a whole context), in order."""
        return [await self.read(part, f"{where}[{i}].content[{j}]") for i, j, part in images_of(list(items))]

    async def chat_messages(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
        """Chat `messages` with each `image_url` part (and a Responses-style `input_image` part)
        replaced by a text part holding the model's marker, and the images' bytes in order."""
        out: list[dict[str, Any]] = []
        pictures: list[bytes] = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, list) or not any(_is_image(p) for p in content):
                out.append(m)
                continue
            parts: list[Any] = []
            for j, p in enumerate(content):
                if not _is_image(p):
                    parts.append(p)
                    continue
                param = f"messages[{i}].content[{j}]"
                if self.marker is None:
                    raise self.refuse_all(param, str(p["type"]))
                if len(pictures) == self.config.max_images:
                    raise InvalidParam(param, f"at most {self.config.max_images} images per request (--max-images)")
                pictures.append(await self._chat_part(p, param))
                parts.append({"type": "text", "text": self.marker})
            out.append({**m, "content": parts})
        return out, pictures

    async def _chat_part(self, part: dict[str, Any], param: str) -> bytes:
        if part["type"] == "input_image":
            url, file_id = part.get("image_url"), part.get("file_id")
            image = InputImage(
                image_url=url if isinstance(url, str) else UNSET, file_id=file_id if isinstance(file_id, str) else UNSET
            )
            return await self.read(image, param)
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise InvalidParam(f"{param}.image_url.url", "expected the image's URL (a data URL or an http(s) URL)")
        return await self.url_bytes(url, f"{param}.image_url.url")


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "input_image")


def check_image(data: bytes, param: str, config: ImageConfig) -> None:
    """InvalidParam naming `param` unless `data` is a whole PNG, JPEG, WebP or GIF within the limits."""
    from PIL import Image

    from engine.loading.images import BadImage, open_image

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, (w, h) = image.format, image.size
    except Exception as e:  # unreadable headers, or Pillow's own decompression-bomb limit
        raise InvalidParam(param, f"not a readable image ({type(e).__name__}: {e})") from None
    if fmt not in FORMATS:
        raise InvalidParam(param, f"image format {fmt} is not supported; send PNG, JPEG, WebP or GIF")
    if w * h > config.max_pixels:
        raise InvalidParam(param, f"the image is {w}x{h} pixels; at most {config.max_pixels} (--max-image-pixels)")
    try:
        open_image(data)
    except BadImage as e:
        raise InvalidParam(param, str(e)) from None
