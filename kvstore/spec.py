"""The KV layout, described without reference to the engine that fills it."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class KVSpec:
    """Shape of the paged KV cache.

    Per layer one tensor `[num_pages, 2, page_size, num_kv_heads, head_dim]` (FlashInfer's
    NHD layout: index 0 of dim 1 is K, 1 is V). `num_kv_heads` is this rank's share.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; supported: {', '.join(DTYPE_BYTES)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_in_budget(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_page
