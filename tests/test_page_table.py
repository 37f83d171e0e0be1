"""Per-request page tables (appended to, released at the front, never rebuilt) and the attention
metadata built from them: O(1) work per appended page, and released pages never read."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_paged import TorchPagedBackend
from engine.scheduling.page_table import MIN_CAPACITY, PageTable


def test_append_and_release_follow_a_list_and_stay_compact() -> None:
    table, model = PageTable(), []
    first = 0
    for step in range(5000):
        table.append([step])
        model.append(step)
        if step % 3 == 0:  # a window of ~20 pages
            released = table.release_front(max(0, len(model) - 20))
            assert released == model[first : max(first, len(model) - 20)]
            first = max(first, len(model) - 20)
        assert len(table) == len(model) and table.first == first
        assert table.live().tolist() == model[first:]
        assert table._buf.numel() <= 4 * table.num_live + MIN_CAPACITY  # memory follows the live pages
    assert table.entries_written == 5000  # one entry written per appended page: no rewrite of the table
    assert table[4999] == 4999
    with pytest.raises(IndexError, match="not live"):
        table[0]
    assert table.clear() == model[first:] and len(table) == 0 and not table


def test_full_table_grows_by_doubling() -> None:
    table = PageTable()
    for i in range(1000):
        table.append([i])
    assert table.live().tolist() == list(range(1000)) and table._buf.numel() <= 2048
    assert table.entries_written == 1000


def _tables(S: int) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    g = torch.Generator().manual_seed(0)
    kv_lens = [37, 50, 9, 64]
    q_lens = [1, 12, 9, 1]
    firsts = [5, 2, 0, 11]  # leading pages released (a window of <= 16 tokens allows this)
    pages = torch.randperm(200, generator=g)[1:].tolist()  # distinct pages, none is the padding page 0
    tables = []
    for kv in kv_lens:
        tables.append(pages[: -(-kv // S)])
        pages = pages[-(-kv // S) :]
    return tables, firsts, q_lens, kv_lens


def test_metadata_from_live_pages_equals_full_tables() -> None:
    S = 4
    tables, firsts, q_lens, kv_lens = _tables(S)
    full = AttentionMetadata.build(tables, q_lens, kv_lens, S)
    live = [torch.tensor(t[f:], dtype=torch.int32) for t, f in zip(tables, firsts, strict=True)]
    meta = AttentionMetadata.from_tables(live, firsts, q_lens, kv_lens, S)
    for name in ("qo_indptr", "kv_last_page_len", "positions", "slot_pages", "slot_offsets", "kv_slots"):
        assert torch.equal(getattr(meta, name), getattr(full, name)), name
    assert meta.kv_indices.tolist() == [p for t, f in zip(tables, firsts, strict=True) for p in t[f:]]
    assert meta.kv_indptr.tolist() == [0, 5, 16, 19, 24]
    assert meta.first_pages == firsts and full.first_pages == [0, 0, 0, 0]
    assert meta.positions.dtype == torch.int64


def test_windowed_attention_reads_only_live_pages() -> None:
    """The same attention with the released pages left out of the tables, and with them in (but
    overwritten with huge values, so reading one would show)."""
    S, H, KVH, D, window = 4, 4, 2, 8, 16
    tables, firsts, q_lens, kv_lens = _tables(S)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(200, 2, S, KVH, D, generator=g)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KVH, KVH))
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(AttentionMetadata.build(tables, q_lens, kv_lens, S))
    want = backend.forward(0, q, k, v, cache.clone(), window)
    poisoned = cache.clone()
    for t, f in zip(tables, firsts, strict=True):
        poisoned[t[:f]] = float("nan")
    live = [torch.tensor(t[f:], dtype=torch.int32) for t, f in zip(tables, firsts, strict=True)]
    backend.plan(AttentionMetadata.from_tables(live, firsts, q_lens, kv_lens, S))
    got = backend.forward(0, q, k, v, poisoned, window)
    assert torch.allclose(got, want, atol=1e-6)
    backend.plan(AttentionMetadata.from_tables(live, firsts, q_lens, kv_lens, S))
    with pytest.raises(RuntimeError, match="released"):  # a full-attention layer would need them
        backend.forward(0, q, k, v, poisoned, None)
