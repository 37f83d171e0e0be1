"""Content-addressed page hashes: the key that makes a KV page reusable across turns,
processes and replicas. Plain Python, no tensors.

A full page's hash is blake2b-128 over (parent page's hash, the page's token ids as int32
little-endian, namespace digest). Chaining makes a hash name the whole prefix, not only the
page's own tokens; the namespace (model fingerprint + tenant salt) keeps pages of different
weights, dtypes, page sizes, shards or tenants apart. Python's `hash()` is salted per process
and 64-bit: it can never name a page stored for another process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

ROOT = b""  # the parent of a sequence's first page
# The layout and meaning of a stored page (K after RoPE, V, the page order of the payload).
# Raise it whenever the engine changes what a page holds or how it is stored: pages of older
# versions then miss (rather than being read and rejected). 2: page values checked by xxh3-64.
KV_FORMAT_VERSION = 2


@dataclass(frozen=True)
class Namespace:
    """What KV computed by this process depends on. Two processes share pages only when equal.

    Attributes:
        architecture: the model class (e.g. LlamaForCausalLM).
        weights: a digest of the weight bytes computed while they streamed in (xxh3-128 hex).
        dtype: the dtype the model computes in.
        kv_dtype: the dtype pages are stored in outside device memory ("int8" or the model dtype).
        page_size: tokens per page.
        tp_size, tp_rank: tensor-parallel shard (each rank stores its own heads).
        pp_size, pp_rank: pipeline stage (each stage stores its own layers); left out of the
            digest on one stage, so that a single stage's keys are what they always were.
        numerics: a digest of the configuration that changes what K and V hold besides the
            weights (RoPE type, theta and scaling, context length, windows, norm eps, head
            shapes), computed by the engine from its model config: K is stored after RoPE, so
            a replica with an edited `rope_scaling` must never take these pages.
        format_version: `KV_FORMAT_VERSION` of the code that computed the pages.
    """

    architecture: str
    weights: str
    dtype: str
    kv_dtype: str
    page_size: int
    tp_size: int = 1
    tp_rank: int = 0
    numerics: str = ""
    format_version: int = KV_FORMAT_VERSION
    pp_size: int = 1
    pp_rank: int = 0

    @property
    def digest(self) -> bytes:
        """16 bytes naming the model side of the namespace (used in Redis keys)."""
        fields = dict(self.__dict__)
        if self.pp_size == 1:
            del fields["pp_size"], fields["pp_rank"]
        return hashlib.blake2b(msgspec.msgpack.encode(fields), digest_size=16).digest()

    @property
    def key(self) -> str:
        return self.digest.hex()

    def salted(self, cache_salt: str) -> bytes:
        """The digest chained into page hashes: the model namespace and the tenant."""
        if not cache_salt:
            return self.digest
        return hashlib.blake2b(self.digest + cache_salt.encode(), digest_size=16).digest()


def hash_page(parent: bytes, token_ids: list[int], namespace: bytes, extra: bytes = b"") -> bytes:
    """blake2b-128(parent hash, token ids as int32 little-endian, namespace digest, extra).

    `extra`: what else the page's KV depends on (the content hashes of the images whose
    placeholder tokens it holds, M-RoPE positions); empty for a text page, whose hash is then
    unchanged."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(namespace)
    if extra:
        h.update(extra)
    return h.digest()


def extend_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    page_size: int,
    namespace: bytes,
    extra: Callable[[int], bytes] | None = None,
) -> list[bytes]:
    """Append the hashes of every full page of `token_ids` not yet in `hashes` (in place);
    `extra(page)`: what page `page` mixes in besides its tokens (`hash_page`)."""
    for i in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[i - 1] if i else ROOT
        more = extra(i) if extra is not None else b""
        hashes.append(hash_page(parent, token_ids[i * page_size : (i + 1) * page_size], namespace, more))
    return hashes


def page_hashes(
    token_ids: list[int], page_size: int, namespace: bytes, extra: Callable[[int], bytes] | None = None
) -> list[bytes]:
    """Hashes of the full pages of `token_ids`, first page first."""
    return extend_hashes([], token_ids, page_size, namespace, extra)


def max_cached_pages(num_tokens: int, page_size: int) -> int:
    """Pages a prompt may take from a cache: the last token is always computed (its logits
    are needed), so at most floor((num_tokens - 1) / page_size)."""
    return max(0, (num_tokens - 1) // page_size)


def find_tail(
    num_pages: int, first_needed: Callable[[int], int], present: Callable[[int], bool], beyond: int = 0
) -> int:
    """The furthest resume point k in (beyond, num_pages] whose window, pages
    `first_needed(k) .. k - 1`, are all `present`; `beyond` when there is none.

    For a model whose every layer has a sliding window, a prompt resumed after k pages needs only
    those pages (hashes name a page by the token ids before it, not by its KV), so a cache may
    hold a conversation's tail without its head. Walks runs of present pages back from
    `num_pages`: the probes are the pages after the resume point plus its window. `first_needed`
    must be non-decreasing with `first_needed(k) < k`.
    """
    b = num_pages
    while b > beyond:
        a = b
        while a > 0 and present(a - 1):
            a -= 1
        if a < b and (a == 0 or first_needed(b) >= a):
            return b
        b = a - 1  # page a - 1 is missing: the previous run ends before it
        while b > beyond and not present(b - 1):
            b -= 1
    return beyond
