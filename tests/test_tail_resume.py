"""Resume at the tail, against a real Redis: a 64k-token conversation on a model whose every
layer has a sliding window is resumed by a fresh engine from the pages of its last window
alone, every earlier page deleted from Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from kvstore.prefix import page_hashes
from tests.redis_server import shared_redis
from tests.test_long_window import NEW, PAGE, PROMPT, WINDOW, random_ids, reference_greedy, windowed_mistral
from tests.test_prefix import SLOW_RECOMPUTE, fingerprint_of, page_bytes
from tests.tiny_models import TinyModel, one_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@pytest.fixture(scope="module")
def kv_redis() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    t = windowed_mistral(tmp_path_factory.mktemp("tail-resume"))
    return t, fingerprint_of(Path(t.path))


def _engine(windowed: tuple[TinyModel, str], url: str, prefix: str) -> Engine:
    t, fp = windowed
    cfg = EngineConfig(
        kv_cache_bytes=64 * page_bytes(t.config),
        page_size=PAGE,
        kv_redis_url=url,
        kv_redis_prefix=prefix,
        recompute_tokens_per_s=SLOW_RECOMPUTE,  # every lookup asks Redis (see SLOW_RECOMPUTE)
    )
    return Engine(t.model, None, cfg, fingerprint=fp)


def _greedy(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    h = engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    engine.run_until_idle()
    outs = list(h)
    return [i for o in outs for i in o.token_ids], outs[-1].cached_tokens


def test_next_turn_restores_only_the_last_window_from_redis(
    windowed: tuple[TinyModel, str], kv_redis: tuple[str, str]
) -> None:
    url, prefix = kv_redis
    t = windowed[0]
    first = random_ids(t.config.vocab_size, PROMPT, seed=7)
    writer = _engine(windowed, url, prefix)
    answer, _ = _greedy(writer, first, 4)
    assert writer.store is not None and writer.store.redis is not None
    assert writer.store.redis.flush(60)
    written = (PROMPT + 3) // PAGE  # every full page computed (the last sampled token is not)
    assert writer.store.redis.counters.written == written
    writer.shutdown()

    turn = first + answer + random_ids(t.config.vocab_size, 40, seed=8)
    resume = written  # pages: the furthest point whose window Redis holds
    keep_from = (resume * PAGE - WINDOW + 1) // PAGE  # the window of the token at the resume point
    reader = _engine(windowed, url, prefix)
    assert reader.store is not None and reader.store.redis is not None
    hashes = page_hashes(turn[: resume * PAGE], PAGE, reader.namespace.salted(""))
    client = redis.Redis.from_url(url)
    doomed = [reader.store.redis.key(h) for h in hashes[:keep_from]]
    for start in range(0, len(doomed), 500):
        assert client.delete(*doomed[start : start + 500]) == len(doomed[start : start + 500])
    assert len(list(client.scan_iter(match=f"{prefix}*", count=1000))) == resume - keep_from

    before = reader.runner.num_tokens_computed
    ids, cached = _greedy(reader, turn, NEW)
    stats = reader.kv_stats()
    reader.shutdown()
    assert stats["redis"]["loaded"] == resume - keep_from  # only the window was read
    assert stats["prefix"]["hit_tokens"] == (resume - keep_from) * PAGE
    assert stats["prefix"]["skipped_tokens"] == keep_from * PAGE  # neither read nor recomputed
    # cached_tokens: the prompt tokens not recomputed (the window restored, the rest not needed).
    assert cached == resume * PAGE
    assert reader.runner.num_tokens_computed - before == len(turn) - resume * PAGE + NEW - 1
    assert ids == reference_greedy(t, turn, NEW)


def test_tail_comes_back_from_host_memory_after_the_pool_is_reused(windowed: tuple[TinyModel, str]) -> None:
    """Host tier only (answers at once): the window's pages, evicted from a small pool by another
    conversation, are restored from host memory; the pages before it are not looked up."""
    t, fp = windowed
    cfg = EngineConfig(kv_cache_bytes=64 * page_bytes(t.config), page_size=PAGE, host_cache_bytes=8 << 20)
    engine = Engine(t.model, None, cfg, fingerprint=fp)
    first = random_ids(t.config.vocab_size, 4096, seed=11)
    answer, _ = _greedy(engine, first, 4)
    _greedy(engine, random_ids(t.config.vocab_size, 2048, seed=12), 1)  # reuses every device page
    assert engine.store is not None
    hits = engine.store.host.counters.hits
    turn = first + answer + random_ids(t.config.vocab_size, 20, seed=13)
    resume = (4096 + 3) // PAGE
    ids, cached = _greedy(engine, turn, NEW)
    window_pages = resume - (resume * PAGE - WINDOW + 1) // PAGE
    assert engine.store.host.counters.hits - hits == window_pages
    assert cached == resume * PAGE
    assert ids == reference_greedy(t, turn, NEW)
    engine.shutdown()
