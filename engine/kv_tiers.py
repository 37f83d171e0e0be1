"""Wiring of the content-addressed KV store for an engine: the namespace its pages are hashed
under, the host and Redis tiers behind the device pool, and their counters."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from engine.distributed.parallel import ParallelContext
from engine.engine_config import EngineConfig
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from kvstore.block_pool import BlockPool
from kvstore.codec import PageCodec
from kvstore.kv_cache import KVCache
from kvstore.prefix import Namespace
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from kvstore.tiers import TieredStore

if TYPE_CHECKING:
    from engine.scheduling.scheduler import Scheduler


PREFETCH_CAP_BYTES = 1 << 30  # the default read-ahead buffer: the device pool's size, at most this

# ModelConfig fields that change no K or V value: token ids only name where generation stops,
# and the checkpoint's dtype is covered by the weights digest and the compute dtype.
_NOT_NUMERICS = {"bos_token_id": None, "eos_token_ids": (), "dtype": ""}


def numerics_digest(config: ModelConfig) -> str:
    """A digest of every config field that can change a page's K or V besides the weights:
    RoPE type, theta and scaling factors, `max_position_embeddings` (dynamic and yarn scale by
    it), per-layer windows, norm eps, head counts and dims, qk_norm, biases, MoE routing.
    Taken over the whole config minus the fields listed as harmless, so a field added later
    is covered by default."""
    fields = asdict(replace(config, **_NOT_NUMERICS))  # type: ignore[arg-type]
    raw = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def kv_namespace(
    model: CausalLM, spec: KVSpec, kv_dtype: str, fingerprint: str, parallel: ParallelContext
) -> Namespace:
    """What this process's pages depend on: pages are shared only under an equal namespace.

    Args:
        kv_dtype: `auto` (pages leave the device in the model's dtype) or a storage dtype.
    """
    stored = spec.dtype if kv_dtype == "auto" else kv_dtype
    config = model.config
    return Namespace(
        config.architecture,
        fingerprint,
        spec.dtype,
        stored,
        spec.page_size,
        parallel.world_size,
        parallel.rank,
        numerics=numerics_digest(config),
        pp_size=parallel.pp_size,
        pp_rank=parallel.pp_rank,
    )


def reclaim_window(config: ModelConfig) -> int | None:
    """The window pages are reclaimed behind: the largest one when every layer has a window;
    None (keep every page) when any layer attends to the whole context."""
    windows = config.sliding_windows
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def build_tiers(kv_cache: KVCache, namespace: Namespace, config: EngineConfig) -> TieredStore:
    """The host tier (`host_cache_bytes`, 0 = none) and the Redis tier (`kv_redis_url`, at most
    `kv_redis_max_pending_bytes` of pages queued for writing) behind the pool, with waiting
    requests' pages read ahead from Redis into `kv_prefetch_bytes` of host memory."""
    if config.kv_redis_url and not namespace.weights:
        raise ValueError("the Redis KV tier needs the model's fingerprint (LoadStats.fingerprint)")
    codec = PageCodec(kv_cache.spec, namespace.kv_dtype, namespace.key)
    redis = None
    if config.kv_redis_url:
        redis = RedisTier(
            config.kv_redis_url,
            codec,
            config.kv_redis_ttl,
            config.kv_redis_prefix,
            config.kv_redis_max_pending_bytes,
        )
    prefetch = config.kv_prefetch_bytes
    if prefetch is None:  # enough for the pool's next admissions to find every page at hand, up to 1 GiB
        prefetch = min(config.kv_cache_bytes, PREFETCH_CAP_BYTES)
    return TieredStore(kv_cache, codec, config.host_cache_bytes, redis, prefetch)


def kv_stats(pool: BlockPool, scheduler: Scheduler, store: TieredStore | None) -> dict[str, dict[str, int]]:
    """Counters of the prefix cache (`prefix`: with `reclaimed_pages`, released behind a sliding
    window) and, when present, the `host` and `redis` tiers."""
    out = {"prefix": asdict(pool.counters)}
    out["prefix"]["lookup_timeouts"] = scheduler.num_lookup_timeouts
    out["prefix"]["reclaimed_pages"] = scheduler.num_reclaimed_pages
    out["prefix"]["unpinned"] = scheduler.num_unpinned
    out["restored_unused"] = dict(scheduler.unused_pages)  # by reason: a labelled family on /metrics
    if store is not None:
        out["host"] = asdict(store.host.counters)
        if store.redis is not None:
            out["redis"] = asdict(store.redis.counters)
            out["prefetch"] = asdict(store.staged.counters)  # stored: read ahead; hits: used
    return out
