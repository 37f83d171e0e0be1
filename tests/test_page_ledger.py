"""The writer's ledger (`kvstore.page_ledger`) and the lookup path around it, on a private Redis
(writes paused where it matters): a lookup reads pages still queued for writing, a preempted
request's pages are handed to the writer only where Redis lacks them (`TieredStore.swap_out`),
and a fetch copies pages into the pool as they arrive."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import torch

from kvstore.codec import PageCodec, Payload
from kvstore.kv_cache import KVCache
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from kvstore.tiers import TieredStore
from tests.redis_server import private_redis

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float32")
PAGE_BYTES = SPEC.bytes_per_page


@contextmanager
def _writes_paused(url: str) -> Iterator[None]:
    admin = redis.Redis.from_url(url)
    admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
    try:
        yield
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def _filled(n: int) -> KVCache:
    kv = KVCache(SPEC, n)
    g = torch.Generator().manual_seed(0)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return kv


def test_lookup_reads_pages_still_queued() -> None:
    codec = PageCodec(SPEC, "float32", "e" * 32)
    hashes = [bytes([i]) * 16 for i in range(6)]
    pages = torch.randn(6, *codec.shape, generator=torch.Generator().manual_seed(1))
    with private_redis() as url:
        tier = RedisTier(url, codec, ttl_s=60)
        try:
            with _writes_paused(url):
                assert tier.save(hashes, pages)
                out: list[Payload] = []
                tier.get_prefix([*hashes, b"\xee" * 16], out, threading.Event())
                assert codec.to_tensor(out).equal(pages)  # from the queue: Redis has none of them yet
                assert tier.counters.queue_hits == 6 and tier.counters.found == 0
                assert tier.exists([*hashes[:2], b"\xee" * 16]) == [True, True, False]
                assert tier.writer.ledger.num_queued == 6
            assert tier.flush(30)
            assert tier.writer.ledger.num_queued == 0 and all(tier.writer.ledger.holds(h) for h in hashes)
            out = []
            tier.get_prefix(hashes, out, threading.Event())
            assert codec.to_tensor(out).equal(pages) and tier.counters.found == 6 and tier.counters.queue_hits == 6
        finally:
            tier.close()


def test_swap_out_hands_over_only_the_pages_redis_lacks() -> None:
    codec = PageCodec(SPEC, "float32", "e" * 32)
    kv = _filled(8)
    hashes = [bytes([i]) * 16 for i in range(4)]
    with private_redis() as url:
        tier = RedisTier(url, codec, ttl_s=60, max_pending_bytes=3 * PAGE_BYTES)
        store = TieredStore(kv, codec, 0, tier)
        try:
            with _writes_paused(url):
                store.save(hashes[:2], [0, 1])  # queued (the writer waits on the paused server)
                store.save(hashes[2:], [2, 3])  # past the queue's bound: dropped
                assert tier.counters.dropped == 2
            assert tier.flush(30) and tier.counters.written == 2
            assert store.swap_out(hashes, [0, 1, 2, 3]) == 2  # only the two dropped ones
            assert store.swap_out(hashes, [0, 1, 2, 3]) == 0  # queued or stored now
            assert tier.counters.swapped_out == 2
            assert tier.flush(30)
            out: list[Payload] = []
            tier.get_prefix(hashes, out, threading.Event())
            assert codec.to_tensor(out).equal(kv.read_pages([0, 1, 2, 3]))
        finally:
            store.close()
        with_host = TieredStore(kv, codec, 8 * PAGE_BYTES, RedisTier(url, codec, ttl_s=60, prefix="other"))
        try:  # a host tier copies them when their memory is reused (`evict`): nothing to hand over
            assert with_host.swap_out([b"\x01" * 16], [5]) == 0
        finally:
            with_host.close()


def test_fetch_copies_pages_into_the_pool_as_they_arrive() -> None:
    """A fetch given its device pages (`copy_into`) copies each batch from Redis into them on the
    lookup thread: they hold the pages before `load`, which then copies nothing again."""
    codec = PageCodec(SPEC, "float32", "e" * 32)
    src = _filled(4)
    hashes = [bytes([i]) * 16 for i in range(4)]
    with private_redis() as url:
        store = TieredStore(src, codec, 0, RedisTier(url, codec, ttl_s=60))
        try:
            store.save(hashes, [0, 1, 2, 3])
            assert store.redis is not None and store.redis.flush(30)
            dest = TieredStore(KVCache(SPEC, 8), codec, 0, RedisTier(url, codec, ttl_s=60))
            try:
                fetch = dest.fetch(hashes)
                assert fetch is not None and fetch.remote is not None
                fetch.copy_into([4, 5, 6, 7])
                fetch.remote.result(timeout=30)
                assert dest.kv_cache.read_pages([4, 5, 6, 7]).equal(src.read_pages([0, 1, 2, 3]))  # before load
                assert fetch.take(expired=False) == 4
                for layer in dest.kv_cache.layers:  # `load` must not copy these pages again
                    layer[4:8].zero_()
                fetch.load([4, 5, 6, 7])
                assert not dest.kv_cache.read_pages([4, 5, 6, 7]).any()
            finally:
                dest.close()
        finally:
            store.close()
