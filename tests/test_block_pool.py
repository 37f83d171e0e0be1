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
