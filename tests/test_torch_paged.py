"""The torch_paged backend's read paths against plain attention on random inputs: a lone
decoding sequence (sliced, no mask), a decode-only batch (no row gather), mixed batches, whole
prompts (causal without a mask), chunks after a cached prefix, with and without a sliding
window; and a window layer reads only the pages its window reaches."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import long_prefill, torch_paged
from engine.attention.base import AttentionMetadata, write_kv
from engine.attention.torch_paged import TorchPagedBackend

H, KVH, D, S = 4, 2, 16, 4  # heads, KV heads, head dim, page size


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_len: int, window: int | None
) -> torch.Tensor:
    """q [n, H, D] for the last n positions of a kv_len context; keys/values [kv_len, KVH, D]."""
    n = q.shape[0]
    k = keys.repeat_interleave(H // KVH, dim=1)  # [L, H, D]
    v = values.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    kv_pos = torch.arange(kv_len)[None, :]
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed &= kv_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    "batch",
    [
        [(1, 13)],  # one decoding sequence
        [(1, 13), (1, 5), (1, 22)],  # decode only
        [(9, 9)],  # a whole prompt
        [(5, 17)],  # a chunk after a cached prefix
        [(1, 13), (7, 19), (1, 3), (4, 4)],  # mixed
    ],
)
def test_matches_plain_attention(batch: list[tuple[int, int]], window: int | None) -> None:
    torch.manual_seed(0)
    num_pages = 40
    cache = torch.randn(num_pages, 2, S, KVH, D)
    free = torch.randperm(num_pages).tolist()
    tables = [[free.pop() for _ in range(-(-kv // S))] for _, kv in batch]
    meta = AttentionMetadata.build(tables, [q for q, _ in batch], [kv for _, kv in batch], S)
    T = sum(q for q, _ in batch)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(meta)
    out = backend.forward(0, q, k, v, cache, window)
    start = 0
    for (n, kv_len), table in zip(batch, tables, strict=True):
        pages = cache[torch.tensor(table)]  # [p, 2, S, KVH, D], new K/V written in by forward
        keys = pages[:, 0].reshape(-1, KVH, D)[:kv_len]
        values = pages[:, 1].reshape(-1, KVH, D)[:kv_len]
        assert torch.equal(keys[kv_len - n :], k[start : start + n])  # written where they belong
        assert torch.equal(values[kv_len - n :], v[start : start + n])
        want = reference(q[start : start + n], keys, values, kv_len, window)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n


def test_window_reads_only_the_pages_it_reaches() -> None:
    window, kv_len = 10, 200
    pages = list(range(-(-kv_len // S)))
    meta = AttentionMetadata.build([pages, pages[:10]], [1, 1], [kv_len, 37], S)
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(meta)
    decode, _ = backend._reads_for(window)
    assert decode is not None and decode.n_pages <= math.ceil(window / S) + 1
    full, _ = backend._reads_for(None)
    assert full is not None and full.n_pages == len(pages)
    meta = AttentionMetadata.build([pages], [8], [kv_len], S)
    backend.plan(meta)
    _, (prefill,) = backend._reads_for(window)
    assert prefill.n_pages <= math.ceil((window + 7) / S) + 1


@pytest.mark.parametrize("window", [None, 6, 40])
@pytest.mark.parametrize("lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_after_long_prefix_in_bounded_blocks(
    monkeypatch: pytest.MonkeyPatch, window: int | None, lse: bool, dtype: torch.dtype
) -> None:
    """A 23-token chunk after 150 cached tokens: split at the prefix (full attention, where the
    log-sum-exp op exists) or masked in query blocks of a few rows (a 64-element mask budget)."""
    monkeypatch.setattr(long_prefill, "MASK_BUDGET", 64)
    if not lse:
        monkeypatch.setattr(torch_paged, "has_lse_attention", lambda device: False)
    torch.manual_seed(1)
    n, kv_len = 23, 173
    table = torch.randperm(60)[: -(-kv_len // S)].tolist()
    cache = torch.randn(60, 2, S, KVH, D).to(dtype)
    q, k, v = (torch.randn(n, h, D).to(dtype) for h in (H, KVH, KVH))
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(AttentionMetadata.build([table], [n], [kv_len], S))
    out = backend.forward(0, q, k, v, cache, window)
    pages = cache[torch.tensor(table)].double()
    keys, values = pages[:, 0].reshape(-1, KVH, D)[:kv_len], pages[:, 1].reshape(-1, KVH, D)[:kv_len]
    want = reference(q.double(), keys, values, kv_len, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_kv_written_in_one_call_when_v_follows_k() -> None:
    """K and V halves of one buffer (the compiled step's layout) are written with one
    `index_copy_`, to the same slots as separate tensors are."""
    torch.manual_seed(0)
    tables, q_lens, kv_lens = [[3, 7], [1]], [3, 2], [7, 2]
    meta = AttentionMetadata.build(tables, q_lens, kv_lens, S)
    kv = torch.randn(2, 5, KVH, D)
    one, two = torch.zeros(9, 2, S, KVH, D), torch.zeros(9, 2, S, KVH, D)
    with torch.profiler.profile() as prof:
        write_kv(one, kv[0], kv[1], meta)
    assert sum(e.name == "aten::index_copy_" for e in prof.events()) == 1
    write_kv(two, kv[0].clone(), kv[1].clone(), meta)
    assert torch.equal(one, two)
    for t, (page, offset) in enumerate([(7, 0), (7, 1), (7, 2), (1, 0), (1, 1)]):  # positions 4-6, 0-1
        assert torch.equal(one[page, 0, offset], kv[0, t]) and torch.equal(one[page, 1, offset], kv[1, t])
