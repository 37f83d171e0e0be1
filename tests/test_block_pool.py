"""Page accounting: no leaks, reference counts back to zero, LRU order of the free list."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_pool import BlockPool, OutOfPages
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

# Each op: ("alloc", n) | ("free", i) | ("share", i) over a list of live page lists.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("share"), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_no_leaks_after_any_sequence(seq: list[tuple[str, int]]) -> None:
    pool = BlockPool(16)
    live: list[list[int]] = []
    for op, arg in seq:
        if op == "alloc":
            if arg > pool.num_free:
                with pytest.raises(OutOfPages):
                    pool.allocate(arg)
                continue
            pages = pool.allocate(arg)
            assert len(set(pages)) == len(pages)
            live.append(pages)
        elif op == "free" and live:
            pool.free(live.pop(arg % len(live)))
        elif op == "share" and live:
            pages = live[arg % len(live)]
            for p in pages:
                pool.share(p)
            live.append(list(pages))
        # invariant: a page's count equals the number of live lists holding it
        for page in range(pool.num_pages):
            held = sum(lst.count(page) for lst in live)
            assert pool.ref_counts[page] == held
            assert pool.is_free(page) == (held == 0)
    for pages in live:
        pool.free(pages)
    assert pool.num_free == pool.num_pages
    assert all(c == 0 for c in pool.ref_counts)


def test_free_list_is_lru_and_revivable() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free([a[2]])
    pool.free([a[0]])
    pool.share(a[2])  # revived out of the free list, from its middle
    assert pool.allocate(1) == [a[0]]
    with pytest.raises(OutOfPages):
        pool.allocate(1)


def test_allocation_is_ascending_after_churn() -> None:
    """The least recently freed pages, handed out in ascending order (however they were freed)."""
    pool = BlockPool(8)
    a = pool.allocate(8)
    assert a == list(range(8))
    pool.free([a[5], a[1], a[6]])  # freed in reverse: 6, 1, 5
    pool.free([a[3]])
    assert pool.allocate(3) == [1, 5, 6]
    assert pool.allocate(1) == [3]


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(AssertionError):
        pool.free(pages)


def test_kv_cache_capacity_from_budget() -> None:
    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="bfloat16")
    assert spec.bytes_per_token == 23_040  # the demo model's KV per token in bf16
    cache = KVCache.from_budget(spec, 10 * spec.bytes_per_page + 5, "cpu")
    assert cache.num_pages == 10 and len(cache.layers) == 30
    assert tuple(cache.layers[0].shape) == (10, 2, 16, 3, 64)
    with pytest.raises(ValueError, match="holds no page"):
        KVCache.from_budget(spec, spec.bytes_per_page - 1)


def test_kv_cache_is_zeroed_private_memory() -> None:
    """The pool starts as zeros in private anonymous memory (faults on first write cost ~35% less
    than in shared memory, mmap's default) and layers do not alias one another."""
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=64, page_size=16, dtype="bfloat16")
    cache = KVCache(spec, 64)
    a, b = cache.layers
    assert not a.any() and not b.any()
    a[5].fill_(1.5)
    assert float(a[5].sum()) == 1.5 * a[5].numel() and not b.any() and not a[4].any()
    ptr = a.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                assert line.split()[1] == "rw-p", line
                break
        else:
            raise AssertionError("the pool's memory is not mapped")


# Hashed pages: ("alloc", n) | ("free", i) | ("register", i) | ("match", i) over live lists; a
# list registered under key i gets hashes b"i:0", b"i:1", ...
hashed_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("register"), st.integers(0, 50)),
        st.tuples(st.just("match"), st.integers(0, 8)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(hashed_ops)
def test_hashed_pages_stay_consistent(seq: list[tuple[str, int]]) -> None:
    evicted: list[tuple[int, bytes]] = []
    pool = BlockPool(12, on_evict=evicted.extend)
    live: list[list[int]] = []
    for op, arg in seq:
        if op == "alloc" and arg <= pool.num_free:
            before = dict(pool.cached)
            pages = pool.allocate(arg)
            for page in pages:  # a reused page loses its hash, and the evict hook is told first
                assert pool.page_hash[page] is None
                if page in before.values():
                    assert any(p == page for p, _ in evicted)
            live.append(pages)
        elif op == "free" and live:
            pool.free(live.pop(arg % len(live)))
        elif op == "register" and live:
            pages = live[arg % len(live)]
            for j, page in enumerate(pages):
                pool.register(page, f"{arg}:{j}".encode())
        elif op == "match":
            hashes = [f"{arg}:{j}".encode() for j in range(4)]
            pages = pool.match(hashes)
            assert [pool.page_hash[p] for p in pages] == hashes[: len(pages)]
            live.append(pages)
        for h, page in pool.cached.items():
            assert pool.page_hash[page] == h
        assert sum(h is not None for h in pool.page_hash) == len(pool.cached)
        for page in range(pool.num_pages):
            held = sum(lst.count(page) for lst in live)
            assert pool.ref_counts[page] == held
            assert pool.is_free(page) == (held == 0)
    for pages in live:
        pool.free(pages)
    assert pool.num_free == pool.num_pages
    assert all(c == 0 for c in pool.ref_counts)


def test_freed_hashed_page_is_revived_until_reused() -> None:
    evicted: list[tuple[int, bytes]] = []
    pool = BlockPool(3, on_evict=evicted.extend)
    a = pool.allocate(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    assert not pool.register(a[1], b"other")  # one hash per page
    pool.free(a)
    assert pool.match([b"h0", b"h1", b"h2"]) == a  # revived from the free list
    pool.free(a)
    pool.allocate(2)  # the never-hashed page first, then the least recently freed: a[1]
    assert evicted == [(a[1], b"h1")] and pool.match([b"h0", b"h1"]) == [a[0]]
