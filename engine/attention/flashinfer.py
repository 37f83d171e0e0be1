"""FlashInfer attention over the paged KV cache (CUDA; flashinfer-python 0.5.3).

The cache is FlashInfer's own NHD layout (`[num_pages, 2, page_size, KVH, D]`) and the
batch description is its CSR page table, so `AttentionMetadata` is handed over as is.
A step whose sequences all decode one token runs `BatchDecodeWithPagedKVCacheWrapper`;
any other step (prefill chunks, alone or mixed with decodes) runs
`BatchPrefillWithPagedKVCacheWrapper` with a causal mask aligned to the end of each
context, which is also correct for the one-token rows.

FlashInfer bakes the sliding window into the plan (`run` asserts it matches), so there is
one wrapper per distinct window, all planned once per step and run once per layer; they
share one float workspace, as their runs never overlap. A query at position p sees keys
p - window_left .. p, so transformers' window w (keys p-w+1 .. p) is `window_left = w - 1`.

`flashinfer` is imported when the backend is built, never when this module is imported,
so the module loads (and fails clearly) where flashinfer is not installed.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer() -> Any:
    """The flashinfer module, or a RuntimeError that says how to install it."""
    try:
        import flashinfer
    except ImportError as e:  # also raised by flashinfer itself when its CUDA deps are missing
        raise RuntimeError(
            "the flashinfer attention backend needs flashinfer-python 0.5.3 "
            f"(pip install -e '.[cuda]'): {e}; use --attention-backend torch_paged instead"
        ) from e
    return flashinfer


class FlashInferBackend(AttentionBackend):
    """Args:
    num_heads, num_kv_heads, head_dim, scale: as `AttentionBackend`.
    device: where the workspace and the cache live (CUDA).
    dtype: the dtype of q (and `kv_dtype`, default `dtype`, of the cache); when omitted,
        learned from the first `forward`, which then plans that step's wrappers itself.
    """

    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        *,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._fi = import_flashinfer()
        self.device = torch.device(device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off in decode once several query heads share a KV head (as in vLLM).
        self.decode_tensor_cores = num_heads // num_kv_heads > 4
        self.dtypes: tuple[torch.dtype, torch.dtype] | None = (dtype, kv_dtype or dtype) if dtype else None
        self.windows: set[int | None] = {None}  # windows seen so far: planned eagerly each step
        self._prefill: dict[int, Any] = {}  # window_left -> wrapper
        self._decode: dict[int, Any] = {}
        self._planned: dict[int, Any] = {}  # this step's planned wrapper per window_left
        self.meta: AttentionMetadata | None = None
        self.decode_only = False
        self._host: dict[str, torch.Tensor] = {}

    def plan(self, meta: AttentionMetadata) -> None:
        """Describe the step to FlashInfer once; every layer's `forward` reuses the plans.

        FlashInfer's plan reads the indptr arrays on the host: they are rebuilt from the
        metadata's host lengths, so planning never waits for the device.
        """
        self.meta = meta
        self.decode_only = all(q == 1 for q in meta.q_lens)
        S = meta.page_size
        # A sequence whose window released its first pages lists the rest: FlashInfer counts its
        # keys from there, and causal and window masks depend only on relative offsets.
        pages = [-(-kv // S) - first for kv, first in zip(meta.kv_lens, meta.first_pages, strict=True)]
        qo_indptr, kv_indptr = [0], [0]
        for q, n in zip(meta.q_lens, pages, strict=True):
            qo_indptr.append(qo_indptr[-1] + q)
            kv_indptr.append(kv_indptr[-1] + n)
        self._host = {
            "qo_indptr": torch.tensor(qo_indptr, dtype=torch.int32),
            "kv_indptr": torch.tensor(kv_indptr, dtype=torch.int32),
            "last_page_len": torch.tensor([kv - (-(-kv // S) - 1) * S for kv in meta.kv_lens], dtype=torch.int32),
        }
        self._planned = {}
        if self.dtypes is not None:
            for window in self.windows:
                self._plan_window(window)

    def _plan_window(self, window: int | None) -> Any:
        assert self.meta is not None and self.dtypes is not None, "plan() before forward()"
        q_dtype, kv_dtype = self.dtypes
        meta, host = self.meta, self._host
        window_left = -1 if window is None else window - 1
        common = dict(window_left=window_left, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=self.scale)
        if self.decode_only:
            wrapper = self._decode.get(window_left)
            if wrapper is None:
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, kv_layout="NHD", use_tensor_cores=self.decode_tensor_cores
                )
                self._decode[window_left] = wrapper
            wrapper.plan(
                host["kv_indptr"],
                meta.kv_indices,
                host["last_page_len"],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.page_size,
                **common,
            )
        else:
            wrapper = self._prefill.get(window_left)
            if wrapper is None:
                wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
                self._prefill[window_left] = wrapper
            wrapper.plan(
                host["qo_indptr"],
                host["kv_indptr"],
                meta.kv_indices,
                host["last_page_len"],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.page_size,
                causal=True,
                **common,
            )
        self._planned[window_left] = wrapper
        return wrapper

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]; the new k/v are written into `cache` first."""
        assert self.meta is not None, "plan() before forward()"
        if q.dtype not in SUPPORTED_DTYPES or cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer backend runs float16/bfloat16, got q {q.dtype} and cache {cache.dtype}; "
                "use the torch_paged backend for float32"
            )
        if self.dtypes is None:
            self.dtypes = (q.dtype, cache.dtype)
        elif self.dtypes != (q.dtype, cache.dtype):
            raise ValueError(f"planned for {self.dtypes}, got q {q.dtype} and cache {cache.dtype}")
        write_kv(cache, k, v, self.meta)
        window_left = -1 if window is None else window - 1
        wrapper = self._planned.get(window_left)
        if wrapper is None:  # first step with this window (or dtype): plan it now
            self.windows.add(window)
            wrapper = self._plan_window(window)
        return wrapper.run(q.contiguous(), cache)
