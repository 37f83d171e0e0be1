"""The attention backend interface and the batch metadata it is planned with.

A step's batch is flat: T tokens from B sequences, sequence b owning tokens
`qo_indptr[b]:qo_indptr[b+1]`, each sequence prefilling a chunk or decoding one token.
Its KV pages are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, the last one filled to
`kv_last_page_len[b]` (new tokens included: they are written before attention runs). A
sequence whose sliding window has left its first pages behind lists only the pages from
`first_pages[b]` on: counted from there, its keys and queries keep their relative offsets, so
causal and window masks are unchanged.
This is FlashInfer's paged-KV description, so its wrappers can be planned from it as is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import cpu_kernel


@dataclass
class AttentionMetadata:
    """One step's batch description (all tensors on the model's device).

    Attributes:
        qo_indptr: [B+1] int32, token offsets of each sequence in the flat batch.
        kv_indptr: [B+1] int32, offsets of each sequence's pages in `kv_indices`.
        kv_indices: [P] int32, page ids.
        kv_last_page_len: [B] int32, tokens in each sequence's last page (1..page_size).
        positions: [T] int64, the position of each token in its sequence.
        slot_pages: [T] int64, page where each new token's K/V is written.
        slot_offsets: [T] int64, offset inside that page.
        kv_slots: [2T] int64, rows of the new tokens' K, then of their V, in the cache viewed
            flat as `[num_pages * 2 * page_size, KVH, D]` (a V row is `page_size` past its K's).
        q_lens, kv_lens: host copies (new tokens, and total tokens after this step) per sequence.
        page_size: tokens per page.
        first_pages: per sequence, leading logical pages left out of `kv_indices` (released by
            a sliding window); its pages in `kv_indices` start at logical page `first_pages[b]`.
            Positions stay absolute; a backend counts a sequence's keys from there.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    positions: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    kv_slots: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int
    first_pages: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.first_pages:
            self.first_pages = [0] * len(self.q_lens)

    @classmethod
    def build(
        cls,
        page_tables: list[list[int]],
        q_lens: list[int],
        kv_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Describe a batch from plain Python page tables (every page from the first).

        Args:
            page_tables: per sequence, its page ids (enough pages for `kv_lens[b]` tokens).
            q_lens: per sequence, tokens computed this step (the last `q_lens[b]` of its context).
            kv_lens: per sequence, context length after this step.
        """
        tables = [torch.tensor(t, dtype=torch.int32) for t in page_tables]
        return cls.from_tables(tables, [0] * len(tables), q_lens, kv_lens, page_size, device)

    @classmethod
    def from_tables(
        cls,
        tables: list[torch.Tensor],
        first_pages: list[int],
        q_lens: list[int],
        kv_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Describe a batch from each sequence's live pages, in O(sequences) Python work: the
        page ids and positions are sliced and computed by tensor operations, never walked.

        Args:
            tables: per sequence, int32 page ids of its logical pages `first_pages[b] ..` (at
                least up to the page of token `kv_lens[b] - 1`; more are ignored).
            first_pages: per sequence, leading logical pages not in its table (released by a
                sliding window: no query of this step may reach them).
            q_lens, kv_lens: as in `build`.
        """
        B = len(tables)
        assert len(first_pages) == len(q_lens) == len(kv_lens) == B
        S = page_size
        n_live = []
        for table, first, q, kv in zip(tables, first_pages, q_lens, kv_lens, strict=True):
            assert 0 < q <= kv, (q, kv)
            n = -(-kv // S) - first
            assert n >= 1 and table.numel() >= n, f"page table holds {table.numel()} live pages, {n} needed"
            n_live.append(n)
        kv_indices = (
            torch.cat([t[:n] for t, n in zip(tables, n_live, strict=True)]) if B > 1 else tables[0][: n_live[0]]
        )
        counts = torch.tensor([n_live, q_lens, kv_lens, first_pages], dtype=torch.int64)  # [4, B]
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(counts[0], 0, out=kv_indptr[1:])
        qo_indptr = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(counts[1], 0, out=qo_indptr[1:])
        q_t, kv_t = counts[1], counts[2]
        T = int(sum(q_lens))
        if T == B:  # every sequence computes one token
            positions = kv_t - 1
            seq_page0 = kv_indptr[:-1].to(torch.int64) - counts[3]
        else:
            seq = torch.repeat_interleave(torch.arange(B), q_t)  # [T] sequence of each token
            positions = torch.arange(T) - qo_indptr[:-1].to(torch.int64)[seq] + (kv_t - q_t)[seq]
            seq_page0 = (kv_indptr[:-1].to(torch.int64) - counts[3])[seq]
        slot_pages = kv_indices[seq_page0 + positions // S].to(torch.int64)
        slot_offsets = positions % S
        last_lens = kv_t - (-(-kv_t // S) - 1) * S
        k_rows = slot_pages * (2 * S) + slot_offsets
        return cls(
            qo_indptr=qo_indptr.to(device),
            kv_indptr=kv_indptr.to(device),
            kv_indices=kv_indices.to(device),
            kv_last_page_len=last_lens.to(torch.int32).to(device),
            positions=positions.to(device),
            slot_pages=slot_pages.to(device),
            slot_offsets=slot_offsets.to(device),
            kv_slots=torch.cat((k_rows, k_rows + S)).to(device),
            q_lens=list(q_lens),
            kv_lens=list(kv_lens),
            page_size=page_size,
            first_pages=list(first_pages),
        )

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)


class AttentionBackend(ABC):
    """Plan once per step, run once per layer.

    Args of `forward`: layer index; q [T, H, D], k and v [T, KVH, D] of the step's new tokens;
    the layer's cache `[num_pages, 2, page_size, KVH, D]`; the layer's sliding window (None =
    full attention). Returns [T, H, D]. The new k/v are written into the cache first.
    """

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def fast_decode(
        self, window: int | None, dtype: torch.dtype
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """`attend(q, k, v, cache)`: what `forward` computes for the planned step's layers of
        this window, with less work per call, where a backend has such a path; else None."""
        return None


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's new K/V at their slots. cache [P, 2, S, KVH, D]; k, v [T, KVH, D].

    On CPU with the kernels built (`cpu_kernel`), one row copy per token; else `index_copy_` on
    the cache viewed flat: one call when v directly follows k in memory (the compiled step's
    layout, `regions.pre_attention`), else one each."""
    P, _, S, KVH, D = cache.shape
    T = k.shape[0]
    store = cpu_kernel.store_kv()
    rows = k.stride(-1) == v.stride(-1) == 1 and k.stride(-2) == v.stride(-2) == D  # a token's K/V: one row
    if store is not None and cache.device.type == "cpu" and k.dtype == v.dtype == cache.dtype and rows:
        store(cache, k, v, meta.kv_slots)
        return
    flat = cache.view(P * 2 * S, KVH, D)
    if (
        k.dtype == v.dtype == cache.dtype
        and k.is_contiguous()
        and v.is_contiguous()
        and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and v.data_ptr() == k.data_ptr() + k.nbytes
    ):
        flat.index_copy_(0, meta.kv_slots, k.as_strided((2 * T, KVH, D), (KVH * D, D, 1)))
        return
    flat.index_copy_(0, meta.kv_slots[:T], k.to(cache.dtype))
    flat.index_copy_(0, meta.kv_slots[T:], v.to(cache.dtype))
