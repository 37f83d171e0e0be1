"""The attention backend interface and the batch metadata it is planned with.

A step's batch is flat: T tokens from B sequences, sequence b owning tokens
`qo_indptr[b]:qo_indptr[b+1]`, each sequence prefilling a chunk or decoding one token.
Its KV pages are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, the last one filled to
`kv_last_page_len[b]` (new tokens included: they are written before attention runs).
This is FlashInfer's paged-KV description, so its wrappers can be planned from it as is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


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
        kv_slots: [T] int64, row of each new token's K in the cache viewed flat as
            `[num_pages * 2 * page_size, KVH, D]` (its V row is `page_size` further).
        q_lens, kv_lens: host copies (new tokens, and total tokens after this step) per sequence.
        page_size: tokens per page.
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

    @classmethod
    def build(
        cls,
        page_tables: list[list[int]],
        q_lens: list[int],
        kv_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Describe a batch from plain Python page tables.

        Args:
            page_tables: per sequence, its page ids (enough pages for `kv_lens[b]` tokens).
            q_lens: per sequence, tokens computed this step (the last `q_lens[b]` of its context).
            kv_lens: per sequence, context length after this step.
        """
        assert len(page_tables) == len(q_lens) == len(kv_lens)
        positions: list[int] = []
        slot_pages: list[int] = []
        slot_offsets: list[int] = []
        kv_indices: list[int] = []
        kv_indptr = [0]
        qo_indptr = [0]
        last_lens = []
        for table, q, kv in zip(page_tables, q_lens, kv_lens, strict=True):
            assert 0 < q <= kv, (q, kv)
            n_pages = -(-kv // page_size)
            assert len(table) >= n_pages, f"page table holds {len(table)} pages, {n_pages} needed"
            for pos in range(kv - q, kv):
                positions.append(pos)
                slot_pages.append(table[pos // page_size])
                slot_offsets.append(pos % page_size)
            kv_indices.extend(table[:n_pages])
            kv_indptr.append(len(kv_indices))
            qo_indptr.append(qo_indptr[-1] + q)
            last_lens.append(kv - (n_pages - 1) * page_size)

        def i32(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=device)

        def i64(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            qo_indptr=i32(qo_indptr),
            kv_indptr=i32(kv_indptr),
            kv_indices=i32(kv_indices),
            kv_last_page_len=i32(last_lens),
            positions=i64(positions),
            slot_pages=i64(slot_pages),
            slot_offsets=i64(slot_offsets),
            kv_slots=i64([p * 2 * page_size + o for p, o in zip(slot_pages, slot_offsets, strict=True)]),
            q_lens=list(q_lens),
            kv_lens=list(kv_lens),
            page_size=page_size,
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


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's new K/V at their slots. cache [P, 2, S, KVH, D]; k, v [T, KVH, D].

    Two `index_copy_` on the cache viewed flat, one index tensor (V rows are K rows + S)."""
    P, _, S, KVH, D = cache.shape
    flat = cache.view(P * 2 * S, KVH, D)
    flat.index_copy_(0, meta.kv_slots, k.to(cache.dtype))
    flat[S:].index_copy_(0, meta.kv_slots, v.to(cache.dtype))
