"""Wiring of the content-addressed KV store for an engine: the namespace its pages are hashed
under, the host and Redis tiers behind the device pool, and their counters."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from engine.distributed.parallel import ParallelContext
from engine.model.model import CausalLM
from kvstore.block_pool import BlockPool
from kvstore.codec import PageCodec
from kvstore.kv_cache import KVCache
from kvstore.prefix import Namespace
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from kvstore.tiers import TieredStore

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def kv_namespace(
    model: CausalLM, spec: KVSpec, kv_dtype: str, fingerprint: str, parallel: ParallelContext
) -> Namespace:
    """What this process's pages depend on: pages are shared only under an equal namespace.

    Args:
        kv_dtype: `auto` (pages leave the device in the model's dtype) or a storage dtype.
    """
    stored = spec.dtype if kv_dtype == "auto" else kv_dtype
    return Namespace(
        model.config.architecture, fingerprint, spec.dtype, stored, spec.page_size, parallel.world_size, parallel.rank
    )


def build_tiers(
    kv_cache: KVCache,
    namespace: Namespace,
    host_cache_bytes: int,
    redis_url: str | None,
    redis_ttl: int,
    redis_prefix: str,
) -> TieredStore:
    """The host tier (`host_cache_bytes`, 0 = none) and the Redis tier (`redis_url`) behind the pool."""
    if redis_url and not namespace.weights:
        raise ValueError("the Redis KV tier needs the model's fingerprint (LoadStats.fingerprint)")
    codec = PageCodec(kv_cache.spec, namespace.kv_dtype, namespace.key)
    redis = RedisTier(redis_url, codec, redis_ttl, redis_prefix) if redis_url else None
    return TieredStore(kv_cache, codec, host_cache_bytes, redis)


def kv_stats(pool: BlockPool, scheduler: Scheduler, store: TieredStore | None) -> dict[str, dict[str, int]]:
    """Counters of the prefix cache (`prefix`) and, when present, the `host` and `redis` tiers."""
    out = {"prefix": asdict(pool.counters)}
    out["prefix"]["lookup_timeouts"] = scheduler.num_lookup_timeouts
    if store is not None:
        out["host"] = asdict(store.host.counters)
        if store.redis is not None:
            out["redis"] = asdict(store.redis.counters)
    return out
