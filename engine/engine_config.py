"""The engine's settings: KV cache size, step budget, admission bounds, KV tiers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int = 1 << 30
    page_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    attention_backend: str = "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    threads: int = 0  # CPU threads for torch (0 = leave torch's default)
    enable_prefix_caching: bool = True
    host_cache_bytes: int = 0  # host tier for pages evicted from the device pool (0 = none)
    kv_redis_url: str | None = None  # Redis KV tier (None = none)
    kv_redis_ttl: int = 86_400  # seconds
    kv_redis_prefix: str = "kv"  # keys are {prefix}:{namespace}:{page hash}
    kv_dtype: str = "auto"  # storage dtype in the host and Redis tiers: auto (the model's) or int8
    kv_redis_max_pending_bytes: int = 256 << 20  # page copies waiting to be written to Redis; more are dropped
    # Host memory that pages of waiting requests are read into from Redis ahead of their
    # admission (0 = none; None = `kv_cache_bytes`, at most 1 GiB): `kvstore.tiers.TieredStore.prefetch`.
    kv_prefetch_bytes: int | None = None
    kv_lookup_timeout_s: float = 5.0  # the longest a request waits for host/Redis pages (less when recomputing wins)
    # The prefill rate a lookup's wait is weighed against (tokens/s): 0 = measured from the steps
    # (`engine/scheduling/prefill_rate.py`); a fixed rate pins that choice (a known device's rate).
    recompute_tokens_per_s: float = 0.0
    max_prefill_tokens_per_request: int | None = None  # a chunk's cap while others wait (None: budget/2)
    max_queued: int = 256  # requests added and not yet running; past it add_request raises EngineOverloaded
    compile: bool = False  # the compiled step (`engine/model/compiled.py`) for steps of <= 64 tokens
    # Its buckets (a subset of `engine.model.compiled.BUCKETS`, checked by `CompiledStep`); None = all.
    compile_buckets: tuple[int, ...] | None = None
    encoder_cache_bytes: int = 256 << 20  # encoded images kept for reuse (vision-language models)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_dtype not in ("auto", "int8", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_dtype must be auto, int8 or a float dtype, got {self.kv_dtype!r}")
        if self.max_prefill_tokens_per_request is not None and self.max_prefill_tokens_per_request < 1:
            raise ValueError(
                f"max_prefill_tokens_per_request must be >= 1 (or None), got {self.max_prefill_tokens_per_request}"
            )
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if self.host_cache_bytes < 0 or self.kv_redis_ttl < 1:
            raise ValueError("host_cache_bytes must be >= 0 and kv_redis_ttl >= 1")
        if self.recompute_tokens_per_s < 0:
            raise ValueError(f"recompute_tokens_per_s must be >= 0, got {self.recompute_tokens_per_s}")
        if self.kv_prefetch_bytes is not None and self.kv_prefetch_bytes < 0:
            raise ValueError(f"kv_prefetch_bytes must be >= 0 (or None), got {self.kv_prefetch_bytes}")
        if self.kv_redis_max_pending_bytes < 0 or self.kv_lookup_timeout_s < 0:
            raise ValueError("kv_redis_max_pending_bytes and kv_lookup_timeout_s must be >= 0")
