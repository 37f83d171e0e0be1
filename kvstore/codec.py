"""One KV page as bytes: a msgspec header and the payload, verified before any use.

Value layout: `<u32 little-endian header length><msgpack header><payload>`. The payload holds
all layers' K and V of one page, `[num_layers, 2, page_size, num_kv_heads, head_dim]`, in the
storage dtype; for int8 it is followed by float32 scales `[num_layers, 2, num_kv_heads]`
(one per page, layer, K/V and head: absmax / 127). A value whose header names another
namespace, page, dtype or shape, whose length is wrong, or whose checksum does not match, is
rejected with `BadPage`: wrong KV is never used.

The checksum is xxh3-64 (format 2; format 1 used zlib's crc32): it catches the same damage
(a flipped, torn or truncated value; keys and headers already name the page) with 64 bits
instead of 32, at about 13 GB/s against crc32's 2.6-4.8 GB/s here, which made the check of a
restored 2k-token history (47 MB) cost 10-18 ms of its read. It guards against accidents, not
an adversary who can write to the KV Redis.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec
import torch
import xxhash

from kvstore.spec import KVSpec

FORMAT_VERSION = 2
_LEN = struct.Struct("<I")

# A page's payload as it is passed around: bytes, a buffer filled in place, or a view into
# the value read from Redis (no copy of its payload is made to strip the header).
Payload = bytes | bytearray | memoryview


class BadPage(ValueError):
    """A stored page that must not be used (damaged, truncated, foreign)."""


class PageHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    namespace: str  # Namespace.key of the model that computed the page
    page_hash: bytes
    dtype: str  # storage dtype of the payload
    shape: tuple[int, ...]  # [num_layers, 2, page_size, num_kv_heads, head_dim]
    payload_len: int
    checksum: int  # xxh3-64 of the payload


_decoder = msgspec.msgpack.Decoder(PageHeader)


def quantize_int8(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per page, layer, K/V and head.

    Args:
        pages: [N, L, 2, P, H, D] any float dtype.
    Returns:
        (int8 [N, L, 2, P, H, D], float32 scales [N, L, 2, H]).
    """
    x = pages.float()
    scales = x.abs().amax(dim=(3, 5)).clamp_min(1e-8) / 127.0  # [N, L, 2, H]
    q = torch.round(x / scales[:, :, :, None, :, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_int8`: [N, L, 2, P, H, D] in `dtype`."""
    return (q.float() * scales[:, :, :, None, :, None]).to(dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class PageCodec:
    """Encodes pages of one model (`spec`) for storage in `kv_dtype` under `namespace`.

    Args:
        spec: the device KV layout (its dtype is the model dtype).
        kv_dtype: storage dtype: spec.dtype or "int8".
        namespace: Namespace.key of this model.
    """

    def __init__(self, spec: KVSpec, kv_dtype: str, namespace: str):
        if kv_dtype not in (spec.dtype, "int8"):
            raise ValueError(f"kv_dtype must be the model dtype ({spec.dtype}) or int8, got {kv_dtype!r}")
        self.spec = spec
        self.kv_dtype = kv_dtype
        self.namespace = namespace
        self.shape = (spec.num_layers, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.model_dtype: torch.dtype = getattr(torch, spec.dtype)
        numel = spec.num_layers * 2 * spec.page_size * spec.num_kv_heads * spec.head_dim
        if kv_dtype == "int8":
            self.payload_len = numel + 4 * spec.num_layers * 2 * spec.num_kv_heads
        else:
            self.payload_len = numel * self.model_dtype.itemsize

    @property
    def as_image(self) -> bool:
        """Whether a payload is the page's image in device memory (`KVCache.read_images`):
        stored in the model dtype."""
        return self.kv_dtype != "int8"

    def payloads(self, pages: torch.Tensor) -> list[bytes]:
        """[N, L, 2, P, H, D] model dtype -> N payloads in the storage dtype."""
        if self.kv_dtype != "int8":
            return [_bytes(p) for p in pages]
        q, scales = quantize_int8(pages)
        return [_bytes(qi) + _bytes(si) for qi, si in zip(q, scales, strict=True)]

    def encode(self, page_hash: bytes, payload: Payload) -> bytes:
        digest = xxhash.xxh3_64_intdigest(payload)
        header = PageHeader(FORMAT_VERSION, self.namespace, page_hash, self.kv_dtype, self.shape, len(payload), digest)
        raw = msgspec.msgpack.encode(header)
        return b"".join((_LEN.pack(len(raw)), raw, payload))

    def decode(self, value: bytes, page_hash: bytes) -> memoryview:
        """The verified payload of a stored page (a view into `value`); raises BadPage."""
        if len(value) < _LEN.size:
            raise BadPage("value shorter than its header length")
        (n,) = _LEN.unpack_from(value)
        try:
            header = _decoder.decode(value[_LEN.size : _LEN.size + n])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadPage(f"unreadable header: {e}") from None
        expected = (FORMAT_VERSION, self.namespace, page_hash, self.kv_dtype, self.shape, self.payload_len)
        found = (header.version, header.namespace, header.page_hash, header.dtype, header.shape, header.payload_len)
        if found != expected:
            raise BadPage(f"header {found} does not describe this page {expected}")
        payload = memoryview(value)[_LEN.size + n :]
        if len(payload) != self.payload_len:
            raise BadPage(f"payload of {len(payload)} bytes, expected {self.payload_len}")
        if xxhash.xxh3_64_intdigest(payload) != header.checksum:
            raise BadPage("payload checksum mismatch")
        return payload

    def to_tensor(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Verified payloads -> [N, L, 2, P, H, D] in the model dtype."""
        buf = bytearray().join(payloads)  # one copy, writable (b"".join then bytearray() copied twice)
        n = len(payloads)
        if self.kv_dtype != "int8":
            return torch.frombuffer(buf, dtype=self.model_dtype).view(n, *self.shape)
        raw = torch.frombuffer(buf, dtype=torch.uint8).view(n, self.payload_len)
        numel = self.payload_len - 4 * self.shape[0] * 2 * self.shape[3]
        q = raw[:, :numel].contiguous().view(torch.int8).view(n, *self.shape)
        scales = raw[:, numel:].contiguous().view(torch.float32).view(n, self.shape[0], 2, self.shape[3])
        return dequantize_int8(q, scales, self.model_dtype)
