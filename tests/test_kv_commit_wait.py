"""The KV writer's commit wait (`RedisWriter.commit_wait`) and pending pages, on a private Redis:
pages queued before a commit are in Redis when the wait returns; past the bound they are marked
pending, and a lookup that meets a pending page waits for it (until it lands or the caller's
deadline) instead of giving up at once."""

from __future__ import annotations

import threading
import time

import redis
import torch

from kvstore.codec import PageCodec, Payload
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from tests.redis_server import private_redis

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="float32")  # 512 KiB pages


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, 2, 16, 8, 128, generator=torch.Generator().manual_seed(seed))


def test_commit_wait_lands_pages_or_marks_them_pending() -> None:
    codec = PageCodec(SPEC, "float32", "f" * 32)
    with private_redis() as url:
        tier = RedisTier(url, codec, ttl_s=60)
        admin = redis.Redis.from_url(url)
        hashes = [bytes([i]) * 16 for i in range(24)]
        tier.save(hashes, _pages(24))
        assert tier.commit_wait(10)
        assert admin.exists(*[tier.key(h) for h in hashes]) == 24 and tier.counters.commit_waits <= 1
        assert tier.commit_wait(0)  # nothing queued: no wait

        late = [bytes([100 + i]) * 16 for i in range(4)]
        admin.execute_command("CLIENT", "PAUSE", "800", "WRITE")
        tier.save(late, _pages(4, 1))
        assert not tier.commit_wait(0.05)
        assert tier.counters.commit_wait_timeouts == 1 and tier.counters.pending_marked == 4
        assert tier.flush(10)
        assert admin.exists(*[tier.key(h) + ":pending" for h in late]) == 4
        tier.close()


def test_lookup_waits_for_a_pending_page() -> None:
    codec = PageCodec(SPEC, "float32", "f" * 32)
    with private_redis() as url:
        tier = RedisTier(url, codec, ttl_s=60)
        admin = redis.Redis.from_url(url)
        hashes = [bytes([i]) * 16 for i in range(3)]
        pages = _pages(3)
        tier.save(hashes[:1], pages[:1])
        assert tier.flush(10)
        admin.set(tier.key(hashes[1]) + ":pending", b"1", px=30_000)
        out: list[Payload] = []
        lookup = threading.Thread(target=tier.get_prefix, args=(hashes, out, threading.Event()))
        lookup.start()
        deadline = time.monotonic() + 10
        while len(out) < 1 and time.monotonic() < deadline:  # page 0 read: the lookup reached page 1
            lookup.join(0.01)
        assert lookup.is_alive() and len(out) == 1  # waiting on page 1
        tier.save(hashes[1:], pages[1:])
        lookup.join(10)
        assert not lookup.is_alive() and codec.to_tensor(out).equal(pages)
        assert tier.counters.pending_waited == 1

        # the caller's deadline ends a wait for a page that never comes
        admin.set(tier.key(b"\xee" * 16) + ":pending", b"1", px=30_000)
        cancel, out = threading.Event(), []
        timer = threading.Timer(0.2, cancel.set)
        timer.start()
        t0 = time.monotonic()
        tier.get_prefix([hashes[0], b"\xee" * 16], out, cancel)
        assert len(out) == 1 and time.monotonic() - t0 < 15  # the deadline, not the pending mark's 30 s
        tier.close()
