"""The Redis KV tier against a real Redis: resume in a fresh process, damaged pages, write-behind
under a paused server, and a Redis that is down or stalled."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from kvstore.codec import PageCodec
from kvstore.prefix import page_hashes
from tests.redis_server import private_redis, shared_redis
from tests.server import ROOT
from tests.test_prefix import SLOW_RECOMPUTE, fingerprint_of, first_logits, page_bytes
from tests.tiny_models import TinyModel, build_tiny


@pytest.fixture(scope="module")
def kv_redis() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("redis-tier"), max_position_embeddings=4608)
    return t, fingerprint_of(t.path)


def _engine(tiny: tuple[TinyModel, str], url: str | None, prefix: str, pages: int = 64, **kw: Any) -> Engine:
    t, fp = tiny
    kw.setdefault("recompute_tokens_per_s", SLOW_RECOMPUTE)
    cfg = EngineConfig(kv_cache_bytes=pages * page_bytes(t.config), kv_redis_url=url, kv_redis_prefix=prefix, **kw)
    return Engine(t.model, None, cfg, fingerprint=fp)


def _fresh_logits(tiny: tuple[TinyModel, str], prompt: list[int], pages: int = 64) -> torch.Tensor:
    e = _engine(tiny, None, "", pages, enable_prefix_caching=False)
    return first_logits(e, prompt)[0]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _prompt(tiny: tuple[TinyModel, str], n: int, seed: int) -> list[int]:
    return torch.randint(0, tiny[0].config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


RESUME = """
import json, sys, torch
from pathlib import Path
from engine.model.config import ModelConfig
from engine.engine import Engine, EngineConfig
from engine.loading.weights import SafetensorsSource, load_model
from tests.test_prefix import first_logits
path, url, prefix, kv_bytes, out = sys.argv[1:6]
path = Path(path)
prompt = json.load(open(out + ".prompt.json"))
config = ModelConfig.from_pretrained_dir(path)
model, stats = load_model(config, SafetensorsSource(path), torch.float32, progress=False)
cfg = EngineConfig(kv_cache_bytes=int(kv_bytes), kv_redis_url=url, kv_redis_prefix=prefix)
engine = Engine(model, None, cfg, fingerprint=stats.fingerprint)
logits, cached, computed = first_logits(engine, prompt)
torch.save(logits, out + ".logits.pt")
json.dump({"cached": cached, "computed": computed, "kv": engine.kv_stats()}, open(out + ".json", "w"))
engine.shutdown()
"""


def test_fresh_process_resumes_4k_prompt_from_redis(
    tiny: tuple[TinyModel, str], kv_redis: tuple[str, str], tmp_path: Path
) -> None:
    url, prefix = kv_redis
    prompt = _prompt(tiny, 4096, seed=1)
    pages = 260
    writer = _engine(tiny, url, prefix, pages)
    ref, cached, _ = first_logits(writer, prompt)
    assert cached == 0  # a full prefill: the reference
    assert writer.store is not None and writer.store.redis is not None
    assert writer.store.redis.flush(30)
    assert writer.store.redis.counters.written == 256  # every full page, the last one included
    writer.shutdown()

    out = str(tmp_path / "resume")
    Path(out + ".prompt.json").write_text(json.dumps(prompt))
    kv_bytes = pages * page_bytes(tiny[0].config)
    args = [sys.executable, "-c", RESUME, str(tiny[0].path), url, prefix, str(kv_bytes), out]
    subprocess.run(args, check=True, cwd=ROOT, timeout=300)
    report = json.loads(Path(out + ".json").read_text())
    full_pages = 4096 // 16
    assert report["kv"]["redis"]["loaded"] >= 0.95 * full_pages
    assert report["cached"] == 255 * 16 and report["computed"] == 16  # the last page is recomputed for its logits
    assert _err(torch.load(out + ".logits.pt"), ref) < 1e-5


def test_a_lookups_end_wakes_the_engine(tiny: tuple[TinyModel, str], kv_redis: tuple[str, str]) -> None:
    """A Redis lookup ends on the lookup thread and wakes the engine's loop through the store's
    `on_fetched` (the engine process's loop through `FetchWake`), which then admits its request
    instead of at its next poll: once per looked-up prompt, whatever the lookup found."""
    url, prefix = kv_redis
    e = _engine(tiny, url, prefix)
    assert e.store is not None and e.store.on_fetched == e._wake.set
    calls: list[int] = []

    def fetched() -> None:
        calls.append(1)
        e._wake.set()

    e.store.on_fetched = fetched
    for seed in range(3):  # two full pages each, in neither the pool nor Redis: looked up, missed
        _, cached, _ = first_logits(e, _prompt(tiny, 40, seed=300 + seed))
        assert cached == 0
    assert len(calls) == 3
    e.shutdown()


def _damage(kind: str, value: bytes, codec: PageCodec, page_hash: bytes) -> bytes:
    if kind == "flipped":
        b = bytearray(value)
        for i in range(len(b) - 50, len(b) - 40):
            b[i] ^= 0x5A
        return bytes(b)
    if kind == "truncated":
        return value[: len(value) // 2]
    other = PageCodec(codec.spec, codec.kv_dtype, "f" * 32)  # a page of another model
    return other.encode(page_hash, codec.decode(value, page_hash))


@pytest.mark.parametrize("kind", ["flipped", "truncated", "foreign"])
def test_damaged_page_is_dropped_and_recomputed(
    tiny: tuple[TinyModel, str], kv_redis: tuple[str, str], kind: str
) -> None:
    url, _ = kv_redis
    prefix = f"{kv_redis[1]}-{kind}"
    prompt = _prompt(tiny, 100, seed=2)
    writer = _engine(tiny, url, prefix)
    first_logits(writer, prompt)
    store = writer.store
    assert store is not None and store.redis is not None and store.redis.flush(10)
    page_hash = page_hashes(prompt, 16, writer.namespace.salted(""))[2]
    r = redis.Redis.from_url(url)
    key = store.redis.key(page_hash)
    r.set(key, _damage(kind, cast(bytes, r.get(key) or b""), store.codec, page_hash))
    writer.shutdown()

    reader = _engine(tiny, url, prefix)
    logits, cached, computed = first_logits(reader, prompt)
    assert reader.store is not None and reader.store.redis is not None
    assert reader.store.redis.counters.bad_pages == 1
    assert cached == 32 and computed == 100 - 32  # pages 0 and 1 restored; 2 and later recomputed
    assert _err(logits, _fresh_logits(tiny, prompt)) < 1e-5
    assert reader.store.redis.flush(10)  # the recomputed page overwrote the bad value
    reader.shutdown()
    again = _engine(tiny, url, prefix)
    assert first_logits(again, prompt)[1] == 96
    again.shutdown()


def _still_paused(url: str) -> bool:
    """Whether the server still holds writes (a `CLIENT PAUSE ... WRITE` or `ALL`): a write to
    another database does not answer within 0.2 s. It lands once the pause ends (not in DB 0)."""
    probe = redis.Redis.from_url(url, db=1, socket_timeout=0.2)
    try:
        probe.set("probe", 1)
        return False
    except redis.TimeoutError:
        return True
    finally:
        probe.close()


def _pause_ended(url: str) -> None:
    """Returns once the server takes writes again (a write that waits out the pause)."""
    probe = redis.Redis.from_url(url, db=1, socket_timeout=60)
    try:
        probe.set("probe", 2)
    finally:
        probe.close()


def test_write_behind_does_not_wait_for_a_paused_redis(tiny: tuple[TinyModel, str]) -> None:
    prompt = _prompt(tiny, 90, seed=3)
    with private_redis() as url:
        admin = redis.Redis.from_url(url)
        e = _engine(tiny, url, "kv")
        assert e.store is not None and e.store.redis is not None
        t0 = time.monotonic()
        first_logits(e, _prompt(tiny, 90, seed=30))  # the same work with Redis answering
        free_s = time.monotonic() - t0
        assert e.store.redis.flush(10) and admin.dbsize() == 5
        admin.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        t0 = time.monotonic()
        logits, _, _ = first_logits(e, prompt)
        paused_s = time.monotonic() - t0
        assert _still_paused(url)  # the step ended while its pages could not be written
        assert paused_s < 5 * free_s, (paused_s, free_s)  # ... and took as long as with Redis answering
        assert admin.dbsize() == 5 and e.store.redis.counters.written == 5  # nothing landed yet
        assert e.store.redis.counters.write_failures == 0  # nor was given up on
        admin.execute_command("CLIENT", "UNPAUSE")
        assert e.store.redis.flush(10)
        assert admin.dbsize() == 10 and e.store.redis.counters.written == 10
        assert e.store.redis.counters.write_failures == 0
        assert _err(logits, _fresh_logits(tiny, prompt)) < 1e-5
        e.shutdown()


def test_write_behind_lands_every_page_after_a_pause_longer_than_its_timeout(tiny: tuple[TinyModel, str]) -> None:
    prompt = _prompt(tiny, 90, seed=6)
    with private_redis() as url:
        admin = redis.Redis.from_url(url)
        e = _engine(tiny, url, "kv")
        assert e.store is not None and e.store.redis is not None
        timeout = float(e.store.redis.writer.client.get_connection_kwargs()["socket_timeout"])
        pause = timeout + 2  # the writer's pipeline must outlive its socket timeout
        admin.execute_command("CLIENT", "PAUSE", str(int(pause * 1000)), "WRITE")
        logits, _, _ = first_logits(e, prompt)
        assert _still_paused(url)  # the step never waited for the paused server
        assert admin.dbsize() == 0
        _pause_ended(url)  # the pause ends by itself
        assert e.store.redis.flush(3 * timeout)
        assert admin.dbsize() == 5 and e.store.redis.counters.dropped == 0
        assert _err(logits, _fresh_logits(tiny, prompt)) < 1e-5
        e.shutdown()


def test_unreachable_or_stalled_redis_degrades_to_no_tier(tiny: tuple[TinyModel, str], tmp_path: Path) -> None:
    prompt = _prompt(tiny, 60, seed=4)
    ref = _fresh_logits(tiny, prompt)
    down = _engine(tiny, f"unix://{tmp_path}/nothing.sock", "kv")
    logits, cached, _ = first_logits(down, prompt)
    assert cached == 0 and _err(logits, ref) < 1e-5
    assert down.store is not None and down.store.redis is not None
    assert down.store.redis.flush(10)  # reads and writes fail each on their own
    c = down.store.redis.counters
    assert c.read_failures == 1 and c.write_failures == 1
    down.shutdown()

    with private_redis() as url:
        e = _engine(tiny, url, "kv")
        redis.Redis.from_url(url).execute_command("CLIENT", "PAUSE", "4000", "ALL")  # UNPAUSE would wait too
        logits, cached, _ = first_logits(e, prompt)
        assert _still_paused(url)  # the lookup gave up after its deadline, not after the pause
        assert cached == 0 and _err(logits, ref) < 1e-5
        assert e.scheduler.num_lookup_timeouts == 1
        _pause_ended(url)
        e.shutdown()


def test_out_of_memory_under_noeviction_stops_writes_not_lookups(tiny: tuple[TinyModel, str]) -> None:
    """State and KV in one Redis: `noeviction`, so a full server refuses KV writes; the request
    still completes, the failure is counted, and pages already stored are still restored."""
    stored, refused = _prompt(tiny, 200, seed=5), _prompt(tiny, 200, seed=6)
    with private_redis("--maxmemory-policy", "noeviction") as url:
        admin = redis.Redis.from_url(url)
        first = _engine(tiny, url, "kv")
        first_logits(first, stored)
        assert first.store is not None and first.store.redis is not None and first.store.redis.flush(10)
        assert first.store.redis.counters.written == 12
        first.shutdown()
        admin.set("state:conversation", b"x" * 100_000)
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used - 1)  # the state fills the server
        e = _engine(tiny, url, "kv")
        logits, _, _ = first_logits(e, refused)
        assert e.store is not None and e.store.redis is not None and e.store.redis.flush(10)
        c = e.store.redis.counters
        assert c.write_failures >= 1 and c.dropped >= 1 and c.written + c.dropped == 12
        assert not e.store.redis.writable() and e.store.redis.readable()
        assert _err(logits, _fresh_logits(tiny, refused)) < 1e-5
        logits, cached, computed = first_logits(e, stored)  # lookups go on while writes are off
        assert cached == 12 * 16 and computed == 200 - 12 * 16 and c.loaded == 12 and c.read_failures == 0
        assert _err(logits, _fresh_logits(tiny, stored)) < 1e-5
        assert admin.get("state:conversation") is not None  # never evicted for KV
        e.shutdown()


@pytest.mark.parametrize("change", ["rope_theta", "rope_scaling", "window", "max_position_embeddings"])
def test_pages_of_other_numerics_miss(tiny: tuple[TinyModel, str], kv_redis: tuple[str, str], change: str) -> None:
    """Same weights, an edited config: K is stored after RoPE, so the pages must not be taken."""
    from engine.loading.weights import SafetensorsSource, load_model
    from tests.test_prefix import numerics_variants

    url, prefix = kv_redis[0], f"{kv_redis[1]}-ns-{change}"
    prompt = _prompt(tiny, 100, seed=7)
    writer = _engine(tiny, url, prefix)
    first_logits(writer, prompt)
    assert writer.store is not None and writer.store.redis is not None and writer.store.redis.flush(10)
    writer.shutdown()
    same = _engine(tiny, url, prefix)
    assert first_logits(same, prompt)[1] == 96  # the control: an equal config hits
    same.shutdown()

    t, fp = tiny
    config = numerics_variants(t.config)[change]
    model, stats = load_model(config, SafetensorsSource(t.path), torch.float32, progress=False)
    assert stats.fingerprint == fp  # the weights are the same
    cfg = EngineConfig(
        kv_cache_bytes=64 * page_bytes(config), kv_redis_url=url, kv_redis_prefix=prefix,
        recompute_tokens_per_s=SLOW_RECOMPUTE,
    )  # fmt: skip
    other = Engine(model, None, cfg, fingerprint=fp)
    assert other.namespace.key != writer.namespace.key
    _, cached, _ = first_logits(other, prompt)
    assert other.store is not None and other.store.redis is not None
    assert cached == 0 and other.store.redis.counters.found == 0 and other.store.redis.counters.missing == 1
    other.shutdown()
