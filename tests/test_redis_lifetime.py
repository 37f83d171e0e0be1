"""Redis KV pages over time, against a real Redis: TTLs refreshed while a conversation is in
use, pages lost from Redis written again, and the write queue and reads bounded in bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from kvstore.codec import PageCodec, Payload
from kvstore.prefix import page_hashes
from kvstore.redis_tier import BATCH_BYTES, RedisTier
from kvstore.spec import KVSpec
from tests.redis_server import private_redis, shared_redis
from tests.test_prefix import SLOW_RECOMPUTE, fingerprint_of, first_logits, page_bytes
from tests.tiny_models import TinyModel, build_tiny, one_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("redis-lifetime"))
    return t, fingerprint_of(t.path)


@pytest.fixture
def kv_redis() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def _engine(tiny: tuple[TinyModel, str], url: str, prefix: str, **kw: Any) -> Engine:
    t, fp = tiny
    kw.setdefault("recompute_tokens_per_s", SLOW_RECOMPUTE)  # every lookup asks Redis (see SLOW_RECOMPUTE)
    cfg = EngineConfig(kv_cache_bytes=64 * page_bytes(t.config), kv_redis_url=url, kv_redis_prefix=prefix, **kw)
    return Engine(t.model, None, cfg, fingerprint=fp)


def _prompt(tiny: tuple[TinyModel, str], n: int, seed: int) -> list[int]:
    return torch.randint(0, tiny[0].config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _keys(e: Engine, prompt: list[int]) -> list[str]:
    assert e.store is not None and e.store.redis is not None
    return [e.store.redis.key(h) for h in page_hashes(prompt, 16, e.namespace.salted(""))]


def test_pages_in_use_outlive_their_ttl_and_lost_pages_are_written_again(
    tiny: tuple[TinyModel, str], kv_redis: tuple[str, str]
) -> None:
    url, prefix = kv_redis
    r = redis.Redis.from_url(url)
    used, unused = _prompt(tiny, 100, seed=11), _prompt(tiny, 100, seed=12)
    e = _engine(tiny, url, prefix, kv_redis_ttl=3)
    assert e.store is not None and e.store.redis is not None
    tier = e.store.redis
    assert tier.writer.refresh_s == 1.0  # TTL / 3
    first_logits(e, used)
    first_logits(e, unused)
    assert tier.flush(10) and tier.counters.written == 12
    used_keys, unused_keys = _keys(e, used), _keys(e, unused)
    start = time.monotonic()
    while time.monotonic() - start < 4.5:  # turns of a conversation in use, for longer than the TTL
        time.sleep(0.6)
        _, cached, _ = first_logits(e, used)
        assert cached == 96  # matched in device memory: the pages are touched, not rewritten
    assert tier.flush(10)
    assert r.exists(*used_keys) == 6 and min(r.ttl(k) for k in used_keys) > 0
    assert r.exists(*unused_keys) == 0  # the same age, never used again: expired
    assert tier.counters.refreshed >= 6 and tier.counters.written == 12

    r.delete(used_keys[2])  # lost (an outage, a restart without persistence)
    time.sleep(1.1)  # past the refresh interval: the next use looks again
    first_logits(e, used)
    assert tier.flush(10)
    assert r.exists(used_keys[2]) == 1 and tier.counters.absent == 1 and tier.counters.rewritten == 1
    e.shutdown()

    fresh = _engine(tiny, url, prefix, kv_redis_ttl=3)
    _, cached, computed = first_logits(fresh, used)
    assert cached == 96 and computed == 4  # the written-again page is whole and valid
    fresh.shutdown()


def test_write_queue_is_bounded_in_bytes(tiny: tuple[TinyModel, str]) -> None:
    pb = page_bytes(tiny[0].config)
    with private_redis() as url:
        admin = redis.Redis.from_url(url)
        e = _engine(tiny, url, "kv", kv_redis_max_pending_bytes=3 * pb)
        assert e.store is not None and e.store.redis is not None
        tier = e.store.redis
        tier.flush(10)
        time.sleep(0.2)  # the writer's first PINGs are done before the pause
        admin.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        first_logits(e, _prompt(tiny, 50, seed=13))  # 3 pages: fit the bound, wait for the writer
        first_logits(e, _prompt(tiny, 200, seed=14))  # 12 more pages: past the bound, dropped
        assert tier.counters.dropped == 12
        admin.execute_command("CLIENT", "UNPAUSE")
        assert tier.flush(10)
        assert tier.counters.written == 3 and admin.dbsize() == 3
        e.shutdown()


def test_reads_are_batched_by_bytes() -> None:
    """Pages of 512 KiB: an MGET carries at most 8 MiB, so 40 pages take three."""
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="float32")
    assert spec.bytes_per_page == 512 << 10
    codec = PageCodec(spec, "float32", "f" * 32)
    pages = torch.randn(40, 4, 2, 16, 8, 128, generator=torch.Generator().manual_seed(0))
    hashes = [bytes([i]) * 16 for i in range(40)]
    with private_redis() as url:
        tier = RedisTier(url, codec, ttl_s=60)
        assert tier.pages_per_read == BATCH_BYTES // tier.value_bytes == 15
        tier.save(hashes, pages)
        assert tier.flush(10) and tier.counters.written == 40
        admin = redis.Redis.from_url(url)
        admin.config_resetstat()
        out: list[Payload] = []
        tier.get_prefix(hashes, out, threading.Event())
        assert codec.to_tensor(out).equal(pages)
        assert admin.info("commandstats")["cmdstat_mget"]["calls"] == 3
        tier.close()


def test_pages_restored_from_host_memory_are_written_again_when_redis_lost_them(
    tiny: tuple[TinyModel, str], kv_redis: tuple[str, str]
) -> None:
    url, prefix = kv_redis
    r = redis.Redis.from_url(url)
    a, b = _prompt(tiny, 70, seed=15), _prompt(tiny, 100, seed=16)
    pb = page_bytes(tiny[0].config)
    e = Engine(
        tiny[0].model, None,
        EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb, kv_redis_url=url, kv_redis_prefix=prefix,
                     kv_redis_ttl=3),
        fingerprint=tiny[1],
    )  # fmt: skip
    assert e.store is not None and e.store.redis is not None
    first_logits(e, a)
    assert e.store.redis.flush(10)
    keys = _keys(e, a)
    assert r.delete(*keys) == 4  # Redis lost the conversation (a restart without persistence)
    first_logits(e, b)  # takes 7 of 8 device pages: a's pages go to the host tier
    assert e.store.host.counters.stored >= 3
    time.sleep(1.1)  # past the refresh interval
    _, cached, _ = first_logits(e, a)
    assert cached == 64 and e.store.host.counters.hits >= 3
    assert e.store.redis.flush(10)
    assert r.exists(*keys) == 4 and e.store.redis.counters.rewritten == 4
    e.shutdown()
