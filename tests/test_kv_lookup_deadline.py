"""How long a request waits for KV pages from a tier: as long as fetching beats recomputing.

Against a real Redis behind a proxy that delays every reply by 300 ms (another zone, a loaded
instance): a 2k-token prefix is still restored (a fixed 100 ms deadline never restored it),
a short one is recomputed without waiting long, and while one request restores 4k tokens the
others keep producing tokens, with outputs equal to a run that computes everything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from engine.kv_connector import LOOKUP_FLOOR_S, lookup_plan
from engine.request import RequestHandle
from engine.sampling_params import SamplingParams
from engine.scheduling.prefill_rate import PrefillRate
from kvstore.transfer_estimate import TransferEstimate
from tests.delay_proxy import delay_proxy
from tests.redis_server import shared_redis
from tests.test_prefix import fingerprint_of, first_logits, page_bytes
from tests.tiny_models import TinyModel, build_tiny, one_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
DELAY_S = 0.3

# Heavy on compute, light on KV (one KV head): a 2k-token prefill takes about a second on one
# CPU thread while its pages are 1 MB, so restoring through a 300 ms link is worth waiting for.
MID = dict(
    hidden_size=384, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=1,
    max_position_embeddings=8192,
)  # fmt: skip


def test_wait_only_while_fetching_beats_recomputing() -> None:
    assert lookup_plan(fetch_s=0.3, recompute_s=2.0, cap_s=5.0) == (True, 2.0)  # as long as a recompute
    assert lookup_plan(fetch_s=0.3, recompute_s=0.4, cap_s=5.0) == (True, pytest.approx(0.45))  # slack
    assert lookup_plan(fetch_s=0.001, recompute_s=0.01, cap_s=5.0) == (True, LOOKUP_FLOOR_S)
    assert lookup_plan(fetch_s=4.0, recompute_s=60.0, cap_s=5.0) == (True, 5.0)  # capped
    assert lookup_plan(fetch_s=0.3, recompute_s=0.1, cap_s=5.0) == (False, LOOKUP_FLOOR_S)  # recompute instead
    assert lookup_plan(fetch_s=0.3, recompute_s=0.1, cap_s=0.05) == (False, 0.05)


def test_transfer_estimate_separates_round_trip_and_rate() -> None:
    link = TransferEstimate(rtt_s=0.001, bytes_per_s=1e9)
    link.observe(0, 0.3)  # a PING through a slow link
    assert link.rtt_s == pytest.approx(0.3)
    for _ in range(20):
        link.observe(100_000_000, 0.3 + 1.0)  # 100 MB in a second after the round trip
    assert link.rtt_s == pytest.approx(0.3) and link.bytes_per_s == pytest.approx(1e8, rel=0.01)
    assert link.seconds(50_000_000, round_trips=2) == pytest.approx(0.6 + 0.5, rel=0.01)


def test_prefill_rate_weights_steps_by_size() -> None:
    rate = PrefillRate(prior_tokens_per_s=1000.0)
    rate.observe(4, 0.01)  # 400 tokens/s, but a tiny step: mostly fixed overhead
    assert rate.tokens_per_s > 990 and not rate.measured
    rate.observe(64, 0.5)  # the first sizeable step (the warm-up) replaces the prior outright
    assert rate.measured and rate.tokens_per_s == pytest.approx(128)
    for _ in range(30):
        rate.observe(512, 0.1)
    assert rate.tokens_per_s == pytest.approx(5120, rel=0.01) and rate.seconds(5120) == pytest.approx(1.0, rel=0.01)


@pytest.fixture(scope="module")
def mid(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("lookup-deadline"), **MID)  # type: ignore[arg-type]
    return t, fingerprint_of(t.path)


@pytest.fixture
def kv_redis() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def _engine(mid: tuple[TinyModel, str], url: str | None, prefix: str, pages: int) -> Engine:
    t, fp = mid
    cfg = EngineConfig(kv_cache_bytes=pages * page_bytes(t.config), kv_redis_url=url, kv_redis_prefix=prefix)
    return Engine(t.model, None, cfg, fingerprint=fp)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_slow_redis_still_restores_a_long_prefix(mid: tuple[TinyModel, str], kv_redis: tuple[str, str]) -> None:
    url, prefix = kv_redis
    short, long, other = _prompt(100, 1), _prompt(2048, 2), _prompt(2048, 3)
    with delay_proxy(url, DELAY_S) as proxy:
        e = _engine(mid, proxy.url, prefix, pages=140)  # room for one 2k prompt at a time
        assert e.store is not None and e.store.redis is not None
        tier = e.store.redis
        t0 = time.monotonic()
        _, cached, computed = first_logits(e, short)
        _, cached, computed = first_logits(e, long)
        recompute_s = time.monotonic() - t0
        assert (cached, computed) == (0, 2048)
        first_logits(e, other)  # evicts the others' pages from device memory (there is no host tier)
        assert tier.flush(30) and tier.counters.written == 6 + 128 + 128
        assert tier.link.rtt_s > 0.2  # measured through the proxy
        assert tier.fetch_cost_s(127) < e.prefill_rate.seconds(127 * 16)  # waiting wins

        t0 = time.monotonic()
        _, cached, computed = first_logits(e, long)
        restore_s = time.monotonic() - t0
        # The wait lasted until the pages were in (within the deadline, or at it with every
        # page arrived: a loaded machine can stretch the last batch past it), not a recompute:
        assert (cached, computed) == (127 * 16, 16)  # only the last page is recomputed
        # Pages still in device memory are matched there; the rest come through the proxy.
        assert tier.counters.loaded >= 100
        print(f"2k prefix: recomputed in {recompute_s:.2f} s, restored through a 300 ms link in {restore_s:.2f} s")

        # A short prefix is cheaper to recompute than to fetch: Redis is not even asked.
        found = tier.counters.found + tier.counters.missing
        _, cached, computed = first_logits(e, short)
        assert (cached, computed) == (0, 100) and tier.counters.found + tier.counters.missing == found
        e.shutdown()


class _Recorder:
    """Consumes a handle on its own thread, stamping every output that carries tokens."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.tokens: list[int] = []
        self.stamps: list[float] = []
        self.cached = 0
        self.producing = threading.Event()  # set at its first token
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for out in self.handle:
            if out.token_ids:
                self.stamps.append(time.monotonic())
                self.tokens += out.token_ids
                self.producing.set()
            self.cached = out.cached_tokens


def test_others_keep_generating_while_one_request_restores_4k_tokens(
    mid: tuple[TinyModel, str], kv_redis: tuple[str, str]
) -> None:
    """The reference run computes everything (its Redis starts empty: nothing is restored) and
    fills Redis; the second engine, behind the 300 ms proxy, restores the 4k prompt while eight
    others decode."""
    url, prefix = kv_redis
    shorts = [_prompt(20 + 3 * i, 10 + i) for i in range(8)]
    long = _prompt(4096, 20)
    others_params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    ref = _engine(mid, url, prefix, pages=600)
    handles = [ref.add_request(p, others_params) for p in shorts] + [ref.add_request(long, long_params)]
    ref.run_until_idle()
    want = [h.result()[0] for h in handles]
    assert ref.store is not None and ref.store.redis is not None and ref.store.redis.flush(30)
    assert ref.store.redis.counters.loaded == 0 and ref.store.redis.counters.written >= 256
    ref.shutdown()

    with delay_proxy(url, DELAY_S) as proxy:
        e = _engine(mid, proxy.url, prefix, pages=600).start()
        others = [_Recorder(e.add_request(p, others_params)) for p in shorts]
        assert all(r.producing.wait(60) for r in others)  # all eight are decoding
        added = time.monotonic()
        restoring = _Recorder(e.add_request(long, long_params))
        for r in [*others, restoring]:
            r.thread.join(timeout=120)
        e.shutdown()
    assert restoring.cached == 255 * 16  # restored from Redis, not recomputed
    first = restoring.stamps[0]
    assert first - added >= DELAY_S  # it waited for the slow link ...
    during = sum(added < s < first for r in others for s in r.stamps)
    assert during >= 8  # ... while the others kept producing tokens
    print(f"4k restore: first token {first - added:.2f} s after its arrival; the others made {during} tokens meanwhile")
    assert [r.tokens for r in others] + [restoring.tokens] == want
