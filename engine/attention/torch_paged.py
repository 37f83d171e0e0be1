"""Paged attention in plain torch: the CPU path and the oracle every other backend is checked against.

Decoding sequences (one new token each) are batched into a single SDPA call over their
gathered pages, padded to the longest; prefilling sequences run one SDPA call each, with
a causal mask aligned to the end of their context (new tokens attend to the cached pages
plus themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _Prefill:
    seq: int
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [n] int64


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] int64, token rows of the decoding sequences
    pages: torch.Tensor  # [Bd, maxP] int64 (padded with page 0)
    kv_lens: torch.Tensor  # [Bd] int64
    max_kv: int


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        kv_indptr = meta.kv_indptr.tolist()
        indices = meta.kv_indices.to(torch.int64)
        device = indices.device
        qo = meta.qo_indptr.tolist()
        self.prefills: list[_Prefill] = []
        decode_rows, decode_pages, decode_lens = [], [], []
        for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
            pages = indices[kv_indptr[b] : kv_indptr[b + 1]]
            if q_len == 1:
                decode_rows.append(qo[b])
                decode_pages.append(pages)
                decode_lens.append(kv_len)
            else:
                self.prefills.append(_Prefill(b, qo[b], q_len, kv_len, pages))
        self.decode: _DecodeGroup | None = None
        if decode_rows:
            max_pages = max(p.numel() for p in decode_pages)
            padded = torch.zeros(len(decode_pages), max_pages, dtype=torch.int64, device=device)
            for i, p in enumerate(decode_pages):
                padded[i, : p.numel()] = p
            self.decode = _DecodeGroup(
                rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
                pages=padded,
                kv_lens=torch.tensor(decode_lens, dtype=torch.int64, device=device),
                max_kv=max_pages * meta.page_size,
            )
        self._masks: dict[int | None, tuple[torch.Tensor | None, list[torch.Tensor]]] = {}

    def _masks_for(self, window: int | None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Boolean masks (True = attend) for the decode group [Bd, 1, 1, L] and each prefill [q, kv]."""
        if window in self._masks:
            return self._masks[window]
        decode_mask = None
        if self.decode is not None:
            d = self.decode
            kv_pos = torch.arange(d.max_kv, device=d.kv_lens.device)[None, :]  # [1, L]
            q_pos = (d.kv_lens - 1)[:, None]  # [Bd, 1]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
            decode_mask = mask[:, None, None, :]
        prefill_masks = []
        for p in self.prefills:
            q_pos = torch.arange(p.kv_len - p.q_len, p.kv_len)[:, None]  # [q, 1]
            kv_pos = torch.arange(p.kv_len)[None, :]  # [1, kv]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
            prefill_masks.append(mask.to(p.pages.device))
        self._masks[window] = (decode_mask, prefill_masks)
        return self._masks[window]

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        meta = self.meta
        write_kv(cache, k, v, meta)
        out = torch.empty_like(q)  # [T, H, D]
        decode_mask, prefill_masks = self._masks_for(window)
        S, KVH, D = cache.shape[2], cache.shape[3], cache.shape[4]
        if self.decode is not None:
            d = self.decode
            kv = cache[d.pages]  # [Bd, maxP, 2, S, KVH, D]
            Bd, maxP = d.pages.shape
            keys = kv[:, :, 0].reshape(Bd, maxP * S, KVH, D).transpose(1, 2).to(q.dtype)  # [Bd, KVH, L, D]
            values = kv[:, :, 1].reshape(Bd, maxP * S, KVH, D).transpose(1, 2).to(q.dtype)
            queries = q[d.rows].unsqueeze(2)  # [Bd, H, 1, D]
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=decode_mask, scale=self.scale, enable_gqa=True
            )  # [Bd, H, 1, D]
            out[d.rows] = o.squeeze(2)
        for p, mask in zip(self.prefills, prefill_masks, strict=True):
            kv = cache[p.pages]  # [n, 2, S, KVH, D]
            n = p.pages.numel()
            keys = kv[:, 0].reshape(n * S, KVH, D)[: p.kv_len].transpose(0, 1).to(q.dtype)  # [KVH, kv, D]
            values = kv[:, 1].reshape(n * S, KVH, D)[: p.kv_len].transpose(0, 1).to(q.dtype)
            queries = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # [H, q, D]
            # 4-D inputs: with 3-D ones torch takes its slow math path on CPU (~9x slower here).
            # A whole prompt in one chunk is plain causal attention: the kernel then skips masked blocks.
            causal = p.q_len == p.kv_len and window is None
            o = F.scaled_dot_product_attention(
                queries[None],
                keys[None],
                values[None],
                attn_mask=None if causal else mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )[0]  # [H, q, D]
            out[p.q_start : p.q_start + p.q_len] = o.transpose(0, 1)
        return out
