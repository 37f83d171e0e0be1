"""The torch_paged backend's read paths against plain attention on random inputs: a lone
decoding sequence (sliced, no mask), a decode-only batch (no row gather), mixed batches, whole
prompts (causal without a mask), chunks after a cached prefix, with and without a sliding
window; the decode and prefill kernels on random batches; and a window layer reads only the
pages its window reaches."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import cpu_kernel, long_prefill, torch_paged
from engine.attention.base import AttentionMetadata, write_kv
from engine.attention.torch_paged import TorchPagedBackend

H, KVH, D, S = 4, 2, 16, 4  # heads, KV heads, head dim, page size


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_len: int, window: int | None
) -> torch.Tensor:
    """q [n, H, D] for the last n positions of a kv_len context; keys/values [kv_len, KVH, D]."""
    n, heads, dim = q.shape
    k = keys.repeat_interleave(heads // keys.shape[1], dim=1)  # [L, H, D]
    v = values.repeat_interleave(heads // keys.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
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
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa"])
def test_matches_plain_attention(batch: list[tuple[int, int]], window: int | None, kernel: bool) -> None:
    torch.manual_seed(0)
    num_pages = 40
    cache = torch.randn(num_pages, 2, S, KVH, D)
    free = torch.randperm(num_pages).tolist()
    tables = [[free.pop() for _ in range(-(-kv // S))] for _, kv in batch]
    meta = AttentionMetadata.build(tables, [q for q, _ in batch], [kv for _, kv in batch], S)
    T = sum(q for q, _ in batch)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    backend = _backend(kernel)
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


def _backend(kernel: bool) -> TorchPagedBackend:
    """The backend with the decode kernel (built for the session by conftest) or SDPA."""
    backend = TorchPagedBackend(H, KVH, D)
    assert backend.kernel is not None  # a C++ compiler is part of `make test`'s set-up
    if not kernel:
        backend.kernel = None
    return backend


def _pages_read(read: object) -> int:
    return read.pages.shape[1] if isinstance(read, torch_paged._KernelRead) else read.n_pages  # type: ignore[attr-defined]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa"])
def test_window_reads_only_the_pages_it_reaches(kernel: bool) -> None:
    window, kv_len = 10, 200
    pages = list(range(-(-kv_len // S)))
    meta = AttentionMetadata.build([pages, pages[:10]], [1, 1], [kv_len, 37], S)
    backend = _backend(kernel)
    backend.plan(meta)
    decode = backend._decode_for(window)
    assert decode is not None and _pages_read(decode) <= math.ceil(window / S) + 1
    full = backend._decode_for(None)
    assert full is not None and _pages_read(full) == len(pages)
    meta = AttentionMetadata.build([pages], [8], [kv_len], S)
    backend.plan(meta)
    (prefill,) = backend._prefills_for(window)
    assert prefill.n_pages <= math.ceil((window + 7) / S) + 1
    (kernel_read,) = backend._prefill_kernel_reads(window)
    assert kernel_read.pages.numel() <= math.ceil((window + 7) / S) + 1


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


@pytest.mark.parametrize("kernel", [True, False], ids=["store_kv", "index_copy"])
def test_kv_written_in_one_call(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    """The step's K/V go to their slots in one call: the kernels' row copy, or without it one
    `index_copy_` when K and V are halves of one buffer (the compiled step's layout); the same
    cache as writing separate tensors."""
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "store_kv", lambda: None)
    torch.manual_seed(0)
    tables, q_lens, kv_lens = [[3, 7], [1]], [3, 2], [7, 2]
    meta = AttentionMetadata.build(tables, q_lens, kv_lens, S)
    kv = torch.randn(2, 5, KVH, D)
    one, two = torch.zeros(9, 2, S, KVH, D), torch.zeros(9, 2, S, KVH, D)
    with torch.profiler.profile() as prof:
        write_kv(one, kv[0], kv[1], meta)
    calls = [e.name for e in prof.events() if e.name in ("aten::index_copy_", "longctx::store_kv")]
    assert calls == ["longctx::store_kv" if kernel else "aten::index_copy_"]
    write_kv(two, kv[0].clone(), kv[1].clone(), meta)
    assert torch.equal(one, two)
    for t, (page, offset) in enumerate([(7, 0), (7, 1), (7, 2), (1, 0), (1, 1)]):  # positions 4-6, 0-1
        assert torch.equal(one[page, 0, offset], kv[0, t]) and torch.equal(one[page, 1, offset], kv[1, t])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(H, KVH, D), (9, 3, 64), (8, 1, 128)], ids=["d16", "d64", "d128"])
def test_decode_kernel_over_random_batches(
    monkeypatch: pytest.MonkeyPatch, seed: int, dtype: torch.dtype, heads: tuple[int, int, int]
) -> None:
    """The decode kernel on random decode batches: shuffled pages, pages released before a
    sliding window, lengths up to 700 keys cut into chunks of 16 to 64 (merged by log-sum-exp),
    against float64 attention; head dims 64 and 128 take the vector code (any other the plain
    loops), and larger batches the thread pool (small ones run on the calling thread)."""
    H, KVH, D = heads
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(torch_paged, "MIN_CHUNK", int(torch.randint(16, 65, (1,), generator=g)))
    monkeypatch.setattr(torch_paged, "TASKS_PER_THREAD", 64)
    B = int(torch.randint(1, 6, (1,), generator=g))
    window = None if seed % 2 else int(torch.randint(5, 200, (1,), generator=g))
    kv_lens = torch.randint(1, 701, (B,), generator=g).tolist()
    free = torch.randperm(1000, generator=g).tolist()
    tables, firsts = [], []
    for kv in kv_lens:
        first = 0 if window is None else max(0, kv - window) // S  # pages before it released
        tables.append(torch.tensor([free.pop() for _ in range(-(-kv // S) - first)], dtype=torch.int32))
        firsts.append(first)
    meta = AttentionMetadata.from_tables(tables, firsts, [1] * B, kv_lens, S)
    cache = torch.randn(1000, 2, S, KVH, D, generator=g).to(dtype)
    q, k, v = (torch.randn(B, h, D, generator=g).to(dtype) for h in (H, KVH, KVH))
    backend = TorchPagedBackend(H, KVH, D)
    assert backend.kernel is not None
    backend.plan(meta)
    out = backend.forward(0, q, k, v, cache, window)
    for b, (kv, first) in enumerate(zip(kv_lens, firsts, strict=True)):
        pages = cache[tables[b].long()].double()  # logical pages first.. of this sequence
        keys = torch.cat([torch.zeros(first * S, KVH, D, dtype=torch.float64), pages[:, 0].reshape(-1, KVH, D)])[:kv]
        values = torch.cat([torch.zeros(first * S, KVH, D, dtype=torch.float64), pages[:, 1].reshape(-1, KVH, D)])[:kv]
        want = reference(q[b : b + 1].double(), keys, values, kv, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b : b + 1].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("dtype", "route"),
    [(torch.float32, "kernel"), (torch.bfloat16, "kernel"), (torch.bfloat16, "gathered")],
    ids=["float32", "bfloat16", "bfloat16-gathered"],
)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (4, 4, 64)], ids=["d64", "d128", "mha"])
def test_prefill_kernel_over_random_chunks(
    monkeypatch: pytest.MonkeyPatch, seed: int, dtype: torch.dtype, route: str, heads: tuple[int, int, int]
) -> None:
    """Prefill chunks through `paged_prefill.cpp`, or (`gathered`, what CPUs with AMX pick for
    large bf16 chunks, forced here for every chunk) one masked SDPA over each chunk's gathered
    keys: random chunk lengths (tiles of 32 tokens and blocks of 64 keys cut anywhere) after
    random cached prefixes, shuffled pages, a sliding window on even seeds (the pages before it
    released), beside decoding sequences in the same step, against float64 attention; the route
    named computed them."""
    H, KVH, D = heads
    if cpu_kernel.prefill(dtype, D) is None:
        pytest.skip(f"no {dtype} prefill kernel on this CPU (needs AVX-512): SDPA")
    gathered = route == "gathered"
    monkeypatch.setattr(torch_paged, "GATHER_FROM", 1 if gathered else None)
    monkeypatch.setattr(torch_paged, "GATHER_MIN_QUERIES", 1)
    g = torch.Generator().manual_seed(seed)
    window = None if seed % 2 else int(torch.randint(1, 120, (1,), generator=g))
    B = int(torch.randint(1, 4, (1,), generator=g))
    q_lens = [int(torch.randint(2, 90, (1,), generator=g)) if i == 0 or seed % 3 else 1 for i in range(B)]
    kv_lens = [n + int(torch.randint(0, 300, (1,), generator=g)) for n in q_lens]
    free = torch.randperm(600, generator=g).tolist()
    tables, firsts = [], []
    for n, kv in zip(q_lens, kv_lens, strict=True):
        first = 0 if window is None else max(0, kv - n - window + 1) // S  # pages before it released
        tables.append(torch.tensor([free.pop() for _ in range(-(-kv // S) - first)], dtype=torch.int32))
        firsts.append(first)
    meta = AttentionMetadata.from_tables(tables, firsts, q_lens, kv_lens, S)
    cache = torch.randn(600, 2, S, KVH, D, generator=g).to(dtype)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, KVH, KVH))
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(meta)
    with torch.profiler.profile() as prof:
        out = backend.forward(0, q, k, v, cache, window)
    assert any(e.name == "longctx::paged_prefill" for e in prof.events()) != gathered
    start = 0
    for b, (n, kv, first) in enumerate(zip(q_lens, kv_lens, firsts, strict=True)):
        pages = cache[tables[b].long()].double()
        keys = torch.cat([torch.zeros(first * S, KVH, D, dtype=torch.float64), pages[:, 0].reshape(-1, KVH, D)])[:kv]
        values = torch.cat([torch.zeros(first * S, KVH, D, dtype=torch.float64), pages[:, 1].reshape(-1, KVH, D)])[:kv]
        want = reference(q[start : start + n].double(), keys, values, kv, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=tol, atol=tol)
        start += n


@pytest.mark.parametrize(
    ("q_len", "kv_len", "window", "dtype", "gathers"),
    [
        (32, 2080, None, torch.bfloat16, True),  # a turn's new tokens over a 2k history
        (512, 8192, None, torch.bfloat16, True),
        (15, 8192, None, torch.bfloat16, False),  # below 16 queries the kernel is ahead
        (64, 200, None, torch.bfloat16, False),  # under 16,384 query x key pairs
        (32, 2080, None, torch.float32, False),  # bf16 only
        (32, 2080, 100, torch.bfloat16, False),  # the window leaves 131 keys: 4,192 pairs
        (2048, 20000, None, torch.bfloat16, False),  # past 2^25 pairs (the mask's bytes)
    ],
)
def test_which_prefill_chunks_gather(
    monkeypatch: pytest.MonkeyPatch, q_len: int, kv_len: int, window: int | None, dtype: torch.dtype, gathers: bool
) -> None:
    """The dispatcher's choice on a CPU with AMX (`GATHER_FROM` as such a CPU sets it): the keys a
    chunk reads (after its window) times its queries decide, within the bounds measured in
    `bench/prefill_attention.py`."""
    monkeypatch.setattr(torch_paged, "GATHER_FROM", 16384)
    monkeypatch.setattr(torch_paged, "GATHER_MIN_QUERIES", 16)
    pages = torch.arange(-(-kv_len // S), dtype=torch.int32)
    meta = AttentionMetadata.from_tables([pages], [0], [q_len], [kv_len], S)
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(meta)
    (seq,) = backend.prefills
    assert backend._gathers(seq, dtype, window) == gathers
