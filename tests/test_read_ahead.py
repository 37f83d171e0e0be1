"""Reading a waiting request's pages ahead from Redis into host memory (`TieredStore.prefetch`),
on a real Redis: the read fills the staging buffer within its budget, skips pages host memory
holds, and a later lookup takes the staged pages at once (no Redis read), counted as Redis's;
a Redis-less store reads nothing ahead; and on a real model, queued turns generate the same
from pages read ahead."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from kvstore.codec import PageCodec
from kvstore.kv_cache import KVCache
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from kvstore.tiers import TieredStore
from tests.redis_server import shared_redis
from tests.test_prefix import SLOW_RECOMPUTE, fingerprint_of, page_bytes
from tests.tiny_models import TinyModel, build_tiny

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float32")
PAGE_BYTES = SPEC.bytes_per_page


def _filled(n: int, seed: int) -> KVCache:
    kv = KVCache(SPEC, n)
    g = torch.Generator().manual_seed(seed)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return kv


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_read_ahead_pages_are_taken_at_hand() -> None:
    hashes = [bytes([i + 1]) * 16 for i in range(6)]
    with shared_redis() as (url, prefix):
        codec = PageCodec(SPEC, "float32", "f" * 32)
        writer_kv = _filled(8, 0)
        writer = TieredStore(writer_kv, codec, 0, RedisTier(url, codec, ttl_s=60, prefix=prefix))
        try:
            writer.save(hashes, list(range(6)))  # another process (or an earlier turn) wrote them
            assert writer.redis is not None and writer.redis.flush(30)
        finally:
            writer.close()

        # A budget of 4 pages (as Redis stores them), one page (the first) already in host memory.
        kv = KVCache(SPEC, 8)
        tier = RedisTier(url, codec, ttl_s=60, prefix=prefix)
        store = TieredStore(kv, codec, 2 * PAGE_BYTES, tier, 4 * tier.value_bytes)
        try:
            assert store.prefetch_pages() == 4
            store.host.put(hashes[0], codec.payloads(writer_kv.read_pages([0]))[0])
            assert store.prefetch(hashes[:5])  # reads pages 1-4: the first is at hand already
            _wait(lambda: store.staged.counters.stored == 4)
            assert store.redis is not None and store.redis.counters.found == 4
            assert store.staged.num_bytes <= store.staged.budget_bytes
            assert not store.prefetch(hashes[:5])  # held now: nothing to read

            found = store.redis.counters.found
            fetch = store.fetch(hashes, remote=True)  # page 5 was not read ahead: Redis is asked for it
            assert fetch is not None
            _wait(fetch.ready)
            assert fetch.take(expired=False) == 6
            assert fetch.sources() == (1, 5)  # host memory: 1; Redis: 4 read ahead + 1 now
            assert store.redis.counters.found == found + 1
            fetch.load([2, 3, 4, 5, 6, 7])
            for layer, src in zip(kv.layers, writer_kv.layers, strict=True):
                assert torch.equal(layer[2:8], src[0:6])
            assert store.staged.counters.hits == 4 and store.staged.num_bytes == 0  # used once, then gone

            # Past the budget the oldest staged pages make room (LRU), never more than the budget.
            assert store.prefetch(hashes[1:6])
            _wait(lambda: store.staged.counters.stored == 9)
            assert store.staged.num_bytes == 4 * PAGE_BYTES and store.staged.counters.evicted == 1
        finally:
            store.close()


def test_nothing_is_read_ahead_without_redis_or_budget() -> None:
    codec = PageCodec(SPEC, "float32", "f" * 32)
    hashes = [bytes([i + 1]) * 16 for i in range(3)]
    host_only = TieredStore(KVCache(SPEC, 4), codec, 8 * PAGE_BYTES, None, 8 * PAGE_BYTES)
    assert host_only.prefetch_pages() == 0 and not host_only.prefetch(hashes)
    with shared_redis() as (url, prefix):
        store = TieredStore(KVCache(SPEC, 4), codec, 0, RedisTier(url, codec, ttl_s=60, prefix=prefix), 0)
        try:
            assert store.prefetch_pages() == 0 and not store.prefetch(hashes)
        finally:
            store.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("read-ahead"))
    return t, fingerprint_of(t.path)


def test_queued_turns_generate_the_same_from_pages_read_ahead(tiny: tuple[TinyModel, str]) -> None:
    """A tiny Llama (float32) with Redis the only tier and a pool for about two of six
    conversations: the later turns, queued behind the running ones, take pages read ahead while
    they waited, and generate token for token what the same turns generate with nothing read
    ahead (greedy); every reference comes back."""
    t, fp = tiny
    g = torch.Generator().manual_seed(5)
    firsts = [torch.randint(0, t.config.vocab_size, (100,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(prefix: str, url: str, read_ahead: int) -> tuple[list[list[int]], dict[str, int]]:
        cfg = EngineConfig(
            kv_cache_bytes=20 * page_bytes(t.config), kv_redis_url=url, kv_redis_prefix=prefix,
            kv_prefetch_bytes=read_ahead, recompute_tokens_per_s=SLOW_RECOMPUTE,
        )  # fmt: skip
        e = Engine(t.model, None, cfg, fingerprint=fp)
        try:
            prompts, outputs = [list(p) for p in firsts], []
            for turn in range(3):
                handles = [e.add_request(p, params) for p in prompts]
                e.run_until_idle()
                results = [h.result()[0] for h in handles]
                outputs += results
                assert e.store is not None and e.store.redis is not None and e.store.redis.flush(30)
                prompts = [
                    p + r + [(7 * turn + c) % t.config.vocab_size] * 9
                    for c, (p, r) in enumerate(zip(prompts, results, strict=True))
                ]
            assert e.pool.num_free == e.pool.num_pages and not any(e.pool.ref_counts)
            return outputs, e.kv_stats()["prefetch"]
        finally:
            e.shutdown()

    with shared_redis() as (url, prefix):
        plain, none = run(prefix + ":plain", url, 0)
        ahead, stats = run(prefix + ":ahead", url, 64 * page_bytes(t.config))
    assert none["stored"] == 0
    assert stats["stored"] > 0 and stats["hits"] > 0, stats
    assert ahead == plain
