"""What the layers above need from the engine: the queue bound, snapshots, the cached tokens a
request reports (device, host and Redis pages), priorities, and multi-turn prompts built from
token ids (tiny model)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from api.cli import build_parser
from engine.engine import Engine, EngineConfig
from engine.request import EngineOverloaded, FinishReason
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot
from tests.redis_server import shared_redis
from tests.test_prefix import SLOW_RECOMPUTE, fingerprint_of, page_bytes
from tests.tiny_models import TinyModel, build_tiny

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("admission"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(tiny: TinyModel, pages: int = 64, **kw: Any) -> Engine:
    return Engine(tiny.model, None, EngineConfig(kv_cache_bytes=pages * page_bytes(tiny.config), **kw))


def _prompt(tiny: TinyModel, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.config.vocab_size, (n,), generator=g).tolist()


def test_queue_bound_and_snapshot(tiny: TinyModel) -> None:
    e = _engine(tiny, max_queued=2, max_num_seqs=1)
    assert e.snapshot() == EngineSnapshot(free_pages=64, total_pages=64)
    a = e.add_request(_prompt(tiny, 20, 1), GREEDY)
    b = e.add_request(_prompt(tiny, 20, 2), GREEDY)
    with pytest.raises(EngineOverloaded) as info:
        e.add_request(_prompt(tiny, 20, 3), GREEDY)
    assert info.value.retry_after_s > 0 and info.value.limit == 2
    e.step()  # a runs (max_num_seqs=1), b still waits: one place is free again
    snap = e.snapshot()
    assert (snap.running, snap.waiting, snap.queued, snap.steps) == (1, 1, 1, 1)
    assert snap.free_pages == 64 - 2 and snap.prompt_tokens_computed == 20
    c = e.add_request(_prompt(tiny, 20, 3), GREEDY)
    with pytest.raises(EngineOverloaded):
        e.add_request(_prompt(tiny, 20, 4), GREEDY)
    c.abort()  # an aborted request leaves the queue too
    e.step()
    e.add_request(_prompt(tiny, 20, 5), GREEDY, request_id=a.id)  # a duplicate id is refused, and leaves it
    e.run_until_idle()
    assert [h.result()[2] for h in (a, b)] == [FinishReason.LENGTH] * 2
    snap = e.snapshot()
    assert (snap.running, snap.waiting, snap.queued, snap.finished, snap.generated_tokens) == (0, 0, 0, 3, 8)
    assert snap.free_pages == snap.total_pages == 64


def test_snapshot_from_another_thread_while_stepping(tiny: TinyModel) -> None:
    seen: list[EngineSnapshot] = []
    done = threading.Event()

    def watch(engine: Engine) -> None:
        while not done.is_set():
            seen.append(engine.snapshot())

    with _engine(tiny, pages=16, max_num_batched_tokens=32) as e:
        watcher = threading.Thread(target=watch, args=(e,))
        watcher.start()
        handles = [e.add_request(_prompt(tiny, 30 + i, i), GREEDY) for i in range(6)]
        results = [h.result() for h in handles]
        done.set()
        watcher.join(timeout=10)
        final = e.snapshot()  # published before the outputs: it counts every request whose result returned
    assert all(r[2] == FinishReason.LENGTH for r in results)
    assert all(0 <= s.free_pages <= s.total_pages == 16 and s.running <= 6 for s in seen)
    assert max(s.running for s in seen) > 1 and final.finished == 6


def test_config_and_cli_name_bad_values() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        EngineConfig(max_queued=0)
    with pytest.raises(ValueError, match="max_prefill_tokens_per_request"):
        EngineConfig(max_prefill_tokens_per_request=0)
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--max-queued", "3", "--max-prefill-tokens-per-request", "64"]
    )
    assert (args.max_queued, args.max_prefill_tokens_per_request) == (3, 64)


def test_priority_runs_first(tiny: TinyModel) -> None:
    e = _engine(tiny, max_num_seqs=1)
    order: list[str] = []
    bg = e.add_request(_prompt(tiny, 20, 1), SamplingParams(max_tokens=3, priority=1))
    fg = e.add_request(_prompt(tiny, 20, 2), SamplingParams(max_tokens=3))
    while e.has_unfinished():
        e.step()
        for h in (bg, fg):
            if h.id not in order and e.scheduler.running and e.scheduler.running[0].id == h.id:
                order.append(h.id)
    assert order == [fg.id, bg.id]


def _greedy_ids(e: Engine, prompt: list[int], max_tokens: int, salt: str = "") -> tuple[list[int], int]:
    """(output ids, cached_tokens) of one greedy request run to the end."""
    h = e.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), cache_salt=salt)
    e.run_until_idle()
    outs = list(h)
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


@pytest.mark.parametrize("prompt_len", [37, 40])
def test_turn_two_built_from_token_ids_hits_page_for_page(tiny: TinyModel, prompt_len: int) -> None:
    """Turn 2 = turn 1's prompt ids + its output ids + new tokens: every page whose KV turn 1
    computed is reused. The last output token's KV is never computed (it was sampled, not fed),
    so when prompt + output ends on a page boundary (40 + 8) that last page is computed again."""
    e = _engine(tiny)
    ps = e.kv_spec.page_size
    p1 = _prompt(tiny, prompt_len, 7)
    out1, _ = _greedy_ids(e, p1, 8)
    p2 = p1 + out1 + _prompt(tiny, 5, 8)
    done = len(p1) + len(out1)
    want = (done - 1) // ps * ps
    out2, cached = _greedy_ids(e, p2, 6)
    assert cached == want
    if done % ps:
        assert cached >= done // ps * ps  # turn 1's prompt + output, minus the last partial page
    assert out2 == _greedy_ids(_engine(tiny, enable_prefix_caching=False), p2, 6)[0]


def test_cached_tokens_count_device_and_host_pages(tiny: TinyModel) -> None:
    pb = page_bytes(tiny.config)
    e = Engine(tiny.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb))
    a, b = _prompt(tiny, 70, 1), _prompt(tiny, 100, 2)
    assert _greedy_ids(e, a, 1)[1] == 0
    assert _greedy_ids(e, a, 1)[1] == 64  # 4 full pages in device memory (the last token is always computed)
    assert _greedy_ids(e, a, 1, salt="other")[1] == 0
    _greedy_ids(e, b, 1)  # takes 7 of 8 pages: a's pages move to the host tier
    assert _greedy_ids(e, a, 1)[1] == 64
    assert _greedy_ids(e, a[:40] + b[:60], 1)[1] == 32
    with e:  # from another thread while the engine thread runs
        assert _greedy_ids_async(e, a) == 64


def _greedy_ids_async(e: Engine, prompt: list[int]) -> int:
    return list(e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0)))[-1].cached_tokens


def test_cached_tokens_count_redis_pages(tiny: TinyModel) -> None:
    fp = fingerprint_of(tiny.path)
    a = _prompt(tiny, 70, 3)
    with shared_redis() as (url, prefix):
        cfg = EngineConfig(
            kv_cache_bytes=64 * page_bytes(tiny.config), kv_redis_url=url, kv_redis_prefix=prefix,
            recompute_tokens_per_s=SLOW_RECOMPUTE,  # the salted request's prefill must not talk it out of Redis
        )  # fmt: skip
        first = Engine(tiny.model, None, cfg, fingerprint=fp)
        _greedy_ids(first, a, 1)
        assert first.store is not None and first.store.redis is not None and first.store.redis.flush()
        first.shutdown()
        second = Engine(tiny.model, None, cfg, fingerprint=fp)  # nothing in device memory
        try:
            assert _greedy_ids(second, a, 1, salt="other")[1] == 0
            assert _greedy_ids(second, a, 1)[1] == 64
        finally:
            second.shutdown()
