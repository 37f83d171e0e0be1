"""Image bytes of stored items, content-addressed: each distinct image once per slot tag.

An `input_image` part sent as a base64 data URL is stored as a reference: the item's Redis
value holds `{"type": "input_image", "image_url": "<head>,", "image_ref": "<sha256 hex>", ...}`
(`head` is the URL up to its comma, `data:image/png;base64`, so the media type and any
parameters stay as sent), and the bytes lie once in `P:{t}:img:<sha256>` (a hash: `data` the
raw bytes, `refs` how many stored parts point at it). `t` is the slot tag of the conversation or
response that holds the item, so a conversation, its responses and the `previous_response_id`
chains that continue them share their images, and every key a script touches lies in one slot.
A part sent as an http(s) URL, whose bytes its request fetched (`InputImage.fetched`), is stored
the same way with its URL whole: `{"image_url": "https://…", "image_ref": "<sha256 hex>", …}`,
the bytes under the same key and counted the same (the same picture sent as a data URL and as a
URL is one key).

Reading a stored item puts the URL back together: head + "," + base64(bytes) is the part as it
was sent, byte for byte, because only a payload that is the canonical base64 of its bytes is
stored by reference. An http(s) part reads back as its URL, the stored bytes kept on the part
(`InputImage.fetched`, never in the API's JSON) for rendering, so a later turn never fetches the
URL again (it may be gone, or show another picture, which would change the prompt and miss the
cached pages). Any other part (an http(s) URL never fetched, a `file_id`, a data URL whose base64
is not canonical or does not decode) stays inline as before, and items written before this layout
(every image inline) read as they always did.

Reference counting (`IMAGES_LUA` below, run inside the scripts of `sessions.scripts` that write
or delete items, so it is atomic with them): each holder of items, a
conversation's item hash or a response's input items, has an index hash `…:images` (sha256 ->
how many of its parts point at it). Writing items adds to the index and to the image's `refs`;
deleting an item, a conversation or a response takes its counts off and deletes an image whose
`refs` reach 0. An image's TTL is renewed with every write to a holder that points at it, so it
outlives each of them; a holder that expires (rather than being deleted) leaves its counts, and
the image then expires with the last holder that pointed at it. The image key is in the slot of
the holder that points at it: a response id from before hash tags (a migrated database), whose
slot is not its conversation's, keeps its own copy.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import msgspec

from sessions.items import InputImage, Item, Message, decode_item, encode_item

log = logging.getLogger("longctx.sessions")

IMAGES_LUA = """
-- Images (`sessions.image_store`): `P:{t}:img:<sha256>` hashes (data, refs) in the slot of the
-- holder's keys; each holder of items has an index hash (sha256 -> its references).
-- the image key prefix `P:{t}:img:` of the slot of `key` (its first {...}, as Redis reads it)
local function imgbase(key) return string.match(key, '^(.-{[^}]*})') .. ':img:' end
-- the images section at argv[at] (`image_args`): m, then (sha256, bytes) * m -> {sha256 = bytes}
local function image_table(argv, at)
  local data = {}
  for i = at + 1, at + 2 * tonumber(argv[at]), 2 do data[argv[i]] = argv[i + 1] end
  return data
end
-- count the image references of a stored item body into (by 1, its bytes from `data` stored if
-- new) or out of (by -1) index and images; an image left with no reference is deleted
local function ref(base, index, body, by, data)
  for sha in string.gmatch(body, '"image_ref":"(%x+)"') do
    if by > 0 and data[sha] then redis.call('HSETNX', base .. sha, 'data', data[sha]) end
    if redis.call('HINCRBY', index, sha, by) <= 0 then redis.call('HDEL', index, sha) end
    if redis.call('HINCRBY', base .. sha, 'refs', by) <= 0 then redis.call('DEL', base .. sha) end
  end
end
-- HSET h id body, with the references of body counted in and those of a body it replaces out
local function put_item(h, index, base, id, body, data)
  local old = redis.call('HGET', h, id)
  redis.call('HSET', h, id, body)
  ref(base, index, body, 1, data)
  if old then ref(base, index, old, -1, data) end
end
-- renew the TTL of every image a holder's index points at (the index itself is among its keys)
local function touch_images(base, index, ttl)
  for _, sha in ipairs(redis.call('HKEYS', index)) do redis.call('EXPIRE', base .. sha, ttl) end
end
-- take all of a holder's references off its images (deleting those left with none), drop the index
local function drop_images(base, index)
  local counts = redis.call('HGETALL', index)
  for i = 1, #counts, 2 do
    local img = base .. counts[i]
    if redis.call('HINCRBY', img, 'refs', -tonumber(counts[i + 1])) <= 0 then redis.call('DEL', img) end
  end
  redis.call('DEL', index)
end
-- sha256, bytes, ... of the images the bodies point at, each once (a missing one's bytes: nil)
local function images_of(base, bodies)
  local out, seen = {}, {}
  for _, body in ipairs(bodies) do
    if body then
      for sha in string.gmatch(body, '"image_ref":"(%x+)"') do
        if not seen[sha] then
          seen[sha] = true
          out[#out + 1] = sha
          out[#out + 1] = redis.call('HGET', base .. sha, 'data')
        end
      end
    end
  end
  return out
end
"""
REF = b'"image_ref"'  # in a stored item's JSON only when one of its parts is a reference


class Stored(NamedTuple):
    """Items as the store writes them: `pairs` the script arguments `id, JSON, id, JSON, …`
    (image parts by reference), `images` sha256 hex -> bytes of every image they point at."""

    pairs: list[Any]
    images: dict[str, bytes]


def data_url_bytes(url: str) -> tuple[str, bytes] | None:
    """(head, bytes) of a base64 data URL whose payload is the canonical base64 of its bytes
    (so head + "," + base64(bytes) gives the URL back), else None."""
    head, comma, payload = url.partition(",")
    if not comma or not url.startswith("data:") or not head.endswith(";base64") or not payload:
        return None
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
    if base64.b64encode(data).decode() != payload:
        return None
    return head, data


def store_items(items: Iterable[Item]) -> Stored:
    """The stored form of `items`: each data-URL image part, and each fetched http(s) one, by
    reference (module docstring)."""
    pairs: list[Any] = []
    images: dict[str, bytes] = {}
    for item in items:
        pairs += [item.id, _stored_json(item, images)]
    return Stored(pairs, images)


def _stored_json(item: Item, images: dict[str, bytes]) -> bytes:
    raw = encode_item(item)
    if not isinstance(item, Message) or not any(isinstance(p, InputImage) for p in item.content):
        return raw
    wire = msgspec.json.decode(raw)
    for j, part in enumerate(item.content):
        if not isinstance(part, InputImage) or not isinstance(part.image_url, str):
            continue
        if part.fetched is not None and part.image_url.startswith(("http://", "https://")):
            head, data = part.image_url, part.fetched  # the URL stays whole beside its bytes
        elif (split := data_url_bytes(part.image_url)) is not None:
            head, data = split[0] + ",", split[1]
        else:
            continue
        sha = hashlib.sha256(data).hexdigest()
        images[sha] = data
        wire["content"][j]["image_url"] = head
        wire["content"][j]["image_ref"] = sha
    return msgspec.json.encode(wire)


def image_args(*stored: Stored) -> list[Any]:
    """The images section of a writing script's arguments (`image_table` in `IMAGES_LUA`): how
    many images, then (sha256, bytes) for each image the stored items point at."""
    images: dict[str, bytes] = {}
    for s in stored:
        images.update(s.images)
    return [len(images), *(x for pair in images.items() for x in pair)]


def image_map(flat: Sequence[bytes | None]) -> dict[str, bytes]:
    """sha256 hex -> bytes from a script's `sha256, bytes, …` reply (a missing image, whose
    bytes are nil, is left out)."""
    out: dict[str, bytes] = {}
    for sha, data in zip(flat[::2], flat[1::2], strict=True):
        if sha is not None and data is not None:
            out[sha.decode()] = data
    return out


def load_items(bodies: Sequence[bytes | None], flat_images: Sequence[bytes | None]) -> list[Item]:
    """Items from a script's HMGET reply (ids no longer there, None, are skipped) and its
    `sha256, bytes, …` reply, each image part given back as it was sent."""
    images = image_map(flat_images)
    return [load_item(b, images) for b in bodies if b is not None]


def load_item(body: bytes, images: dict[str, bytes]) -> Item:
    """One stored item with its referenced images put back into their data URLs, or (an http(s)
    URL) kept on their parts as `InputImage.fetched`."""
    if REF not in body:
        return decode_item(body)
    wire = msgspec.json.decode(body)
    fetched: dict[int, bytes] = {}  # part index -> the bytes of an http(s) part
    for j, part in enumerate(wire.get("content") or ()):
        sha = part.pop("image_ref", None) if isinstance(part, dict) else None
        if sha is None:
            continue
        data = images.get(sha)
        if data is None:  # cannot happen while the counts hold; the part then reads as unreadable
            log.warning("stored image %s of item %s is missing", sha, wire.get("id"))
            continue
        if part["image_url"].startswith("data:"):
            part["image_url"] += base64.b64encode(data).decode()
        else:
            fetched[j] = data
    item = decode_item(msgspec.json.encode(wire))
    for j, data in fetched.items():
        assert isinstance(item, Message)
        part = item.content[j]
        assert isinstance(part, InputImage)
        part.keep_fetched(data)
    return item
