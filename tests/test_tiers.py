"""Page codec, host tier and int8 KV storage (no Redis here: see test_redis_tier.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.attention.torch_paged import TorchPagedBackend
from engine.engine import Engine, EngineConfig
from engine.model_runner import Chunk, ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.codec import BadPage, PageCodec
from kvstore.kv_cache import KVCache
from kvstore.prefix import Namespace
from kvstore.spec import KVSpec
from kvstore.tiers import HostTier
from tests.test_prefix import first_logits, page_bytes
from tests.tiny_models import TinyModel, build_tiny

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=16, dtype="bfloat16")


def _pages(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def test_codec_round_trip_and_sizes() -> None:
    codec = PageCodec(SPEC, "bfloat16", "ns")
    pages = _pages(3)
    payloads = codec.payloads(pages)
    assert all(len(p) == SPEC.bytes_per_page == codec.payload_len for p in payloads)
    values = [codec.encode(bytes([i]) * 16, p) for i, p in enumerate(payloads)]
    back = codec.to_tensor([codec.decode(v, bytes([i]) * 16) for i, v in enumerate(values)])
    assert torch.equal(back, pages)
    assert len(values[0]) - len(payloads[0]) < 100  # a small header

    q = PageCodec(SPEC, "int8", "ns")
    qp = q.payloads(pages)
    assert len(qp[0]) == SPEC.bytes_per_page // 2 + 4 * 3 * 2 * 2  # int8 values + one float32 scale per head
    approx = q.to_tensor([q.decode(q.encode(b"h" * 16, p), b"h" * 16) for p in qp[:1]])
    err = float((approx.float() - pages[:1].float()).abs().max() / pages[:1].float().abs().max())
    assert 0 < err < 0.02


def test_page_images_copy_straight_in_and_out_of_the_cache() -> None:
    """A page's image (what the host tier keeps and Redis stores in the model dtype) is the
    codec's payload of `read_pages`; written back into other, scattered pages, the cache holds
    the same K/V there, and nothing else changes."""
    codec = PageCodec(SPEC, "bfloat16", "ns")
    kv = KVCache(SPEC, 12)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(1)).to(layer.dtype))
    src = [7, 2, 3, 10]
    images = kv.read_images(src)
    assert [bytes(i) for i in images] == codec.payloads(kv.read_pages(src))
    before = kv.read_pages(list(range(12)))
    dst = [0, 5, 6, 11]
    kv.write_images(dst, [bytes(images[0]), images[1], memoryview(bytes(images[2])), images[3]])
    assert torch.equal(kv.read_pages(dst), before[src])
    untouched = [p for p in range(12) if p not in dst]
    assert torch.equal(kv.read_pages(untouched), before[untouched])


def test_codec_rejects_damaged_truncated_and_foreign_pages() -> None:
    codec = PageCodec(SPEC, "bfloat16", "ns")
    h = b"h" * 16
    value = codec.encode(h, codec.payloads(_pages(1))[0])
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 0xFF
    foreign_model = PageCodec(SPEC, "bfloat16", "other-ns").encode(h, codec.payloads(_pages(1))[0])
    other_shape = KVSpec(3, 2, 8, 16, "float32")
    foreign_shape = PageCodec(other_shape, "float32", "ns").encode(h, b"\0" * other_shape.bytes_per_page)
    for bad, why in [
        (bytes(flipped), "checksum"),
        (value[:-10], "payload of"),
        (value[:3], "shorter"),
        (b"\xff\xff\x00\x00garbage", "header"),
        (foreign_model, "does not describe"),
        (foreign_shape, "does not describe"),
        (codec.encode(b"x" * 16, codec.payloads(_pages(1))[0]), "does not describe"),  # another page
    ]:
        with pytest.raises(BadPage, match=why):
            codec.decode(bad, h)


def test_host_tier_lru_budget() -> None:
    host = HostTier(budget_bytes=30)
    for i in range(4):
        host.put(bytes([i]), b"x" * 10)
    assert len(host) == 3 and host.counters.evicted == 1
    assert host.get_prefix([b"\x01", b"\x02", b"\x00", b"\x03"]) == [b"x" * 10] * 2  # stops at the evicted one
    host.put(b"\x04", b"y" * 10)  # evicts the least recently used: 3
    assert host.get_prefix([b"\x03"]) == [] and host.get_prefix([b"\x01", b"\x02", b"\x04"])[-1] == b"y" * 10


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("tiers-dense"))


def _two_prompts(dense: TinyModel, seed: int) -> tuple[list[int], list[int], int]:
    """A 70- and a 100-token prompt (5 and 7 of a pool of 8 pages), and the model's page bytes."""
    g = torch.Generator().manual_seed(seed)
    vocab = dense.config.vocab_size
    a = torch.randint(0, vocab, (70,), generator=g).tolist()
    b = torch.randint(0, vocab, (100,), generator=g).tolist()
    return a, b, page_bytes(dense.config)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_evicted_pages_come_back_from_host_tier(dense: TinyModel, kv_dtype: str) -> None:
    a, b, pb = _two_prompts(dense, 2)
    e = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb, kv_dtype=kv_dtype))
    fresh = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, enable_prefix_caching=False))
    first_logits(e, a)
    first_logits(e, b)  # takes 7 of 8 pages: a's pages 1..3 are evicted to the host tier
    assert e.store is not None and e.store.host.counters.stored >= 3
    ours, cached, computed = first_logits(e, a)
    ref, _, _ = first_logits(fresh, a)
    assert cached == 64 and computed == 6
    assert e.store.host.counters.hits == 3  # page 0 was still in device memory
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if kv_dtype == "auto" else 0.05), err
    assert e.pool.num_free == e.pool.num_pages


def test_pages_cycling_through_the_pool_are_copied_to_the_host_tier_once(dense: TinyModel) -> None:
    """Two prompts that each need most of the pool take turns: each turn restores one from the
    host tier and evicts the other. A page the host tier holds already (restored from it, or
    evicted before) is not copied again: every page the host tier holds was copied once, each
    later eviction of it only `kept`, and the logits stay those of a fresh engine."""
    a, b, pb = _two_prompts(dense, 3)
    e = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb))
    fresh = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, enable_prefix_caching=False))
    refs = {0: first_logits(fresh, a)[0], 1: first_logits(fresh, b)[0]}
    assert e.store is not None
    host = e.store.host
    for turn in range(6):
        which = turn % 2
        ours, cached, _ = first_logits(e, (a, b)[which])
        if turn >= 2:
            assert cached == (64 if which == 0 else 96), (turn, cached)  # its full pages, from either place
        assert float((ours - refs[which]).abs().max() / refs[which].abs().max()) < 1e-5
    c = host.counters
    assert c.evicted == 0 and c.hits > 0 and c.kept > 0, c
    assert c.stored == len(host), c  # each page copied once, however often it was evicted
    assert c.stored + c.kept == e.pool.counters.evicted, (c, e.pool.counters)


def test_idle_engine_copies_free_pages_ahead_so_their_eviction_copies_nothing(dense: TinyModel) -> None:
    """While idle, the free pages next in line for reuse are copied into the host tier, batch by
    batch until none is left (`EngineCore.copy_ahead`); their eviction then copies nothing (each
    only `kept`), they come back from the host tier with the logits of a fresh engine, and the copy
    never drops a page the host tier held: with room for two pages it copies two."""
    a, b, pb = _two_prompts(dense, 4)
    e = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb))
    fresh = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, enable_prefix_caching=False))
    assert e.store is not None
    c = e.store.host.counters
    first_logits(e, a)
    assert c.stored == 0
    batches = 0
    while e.copy_ahead():
        batches += 1
        assert batches < 10
    assert c.copied_ahead == c.stored == 4 and len(e.store.host) == 4  # a's four full pages
    assert not e.copy_ahead()  # nothing left: no copy again
    first_logits(e, b)  # takes 7 of 8 pages: a's pages 1..3 are evicted, already held
    assert c.stored == 4 and c.kept == 3, c
    ours, cached, _ = first_logits(e, a)
    ref, _, _ = first_logits(fresh, a)
    assert cached == 64 and float((ours - ref).abs().max() / ref.abs().max()) < 1e-5

    small = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=2 * pb))
    assert small.store is not None
    first_logits(small, a)
    while small.copy_ahead():
        pass
    host = small.store.host.counters
    assert host.copied_ahead == 2 and host.evicted == 0, host

    started = Engine(dense.model, None, EngineConfig(kv_cache_bytes=8 * pb, host_cache_bytes=64 * pb)).start()
    try:  # the engine's own loop does it between requests
        started.add_request(a, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)).result()
        assert started.store is not None
        deadline = time.monotonic() + 10
        while started.store.host.counters.copied_ahead < 4:
            assert time.monotonic() < deadline, started.store.host.counters
            time.sleep(0.01)
    finally:
        started.shutdown()


TEXT = (
    "The history of the printing press begins in the middle of the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from Mainz, combined several existing technologies into a single practical "
    "system. Movable type made of a durable metal alloy, an oil-based ink that adhered to metal, and a "
    "screw press adapted from those used to make wine allowed pages to be printed quickly and in large "
    "numbers. Before this, books in Europe were copied by hand, usually by monks working in monasteries, "
    "and a single copy of a long work could take months or even years to finish. The new method spread "
    "rapidly: within fifty years, printing shops had opened in more than two hundred cities across the "
    "continent, and millions of books had been produced. Prices fell, literacy rose, and ideas travelled "
    "faster than ever before. Scholars could compare identical copies of a text, which encouraged careful "
    "editing and the standardisation of spelling and grammar. Religious reformers used pamphlets to reach "
    "ordinary people, scientists shared their observations with colleagues in distant countries, and "
    "merchants printed price lists and maps. Many historians argue that the press was one of the most "
    "important inventions of the second millennium, because it changed not only how information was "
    "stored but also who could take part in public debate. Newspapers appeared in the seventeenth century, "
    "and by the nineteenth century steam-powered presses could print thousands of sheets every hour."
)


@pytest.mark.slow
def test_int8_kv_agrees_with_model_dtype_on_demo_model(demo_float32: Any, record_property: Any) -> None:
    """Teacher-forced over 256 tokens, 32 at a time; after each chunk the pages it filled are
    replaced by their int8 round trip, so every later token attends to int8 KV of the past
    (as when a prefix is restored from an int8 tier). The reference is one full prefill."""
    lm = demo_float32
    ids = lm.tokenizer.encode(TEXT)[:256]
    assert len(ids) == 256
    c = lm.config
    spec = KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, 16, "float32")
    codec = PageCodec(spec, "int8", Namespace(c.architecture, "", "float32", "int8", 16).key)

    def run(chunk: int) -> torch.Tensor:
        runner = ModelRunner(lm.model, KVCache(spec, 17), TorchPagedBackend(c.num_heads, c.num_kv_heads, c.head_dim))
        pages = list(range(16))
        outs = []
        for start in range(0, 256, chunk):
            outs.append(runner.run([Chunk(ids[start : start + chunk], pages, start + chunk)], all_logits=True))
            if chunk < 256:
                done = pages[start // 16 : (start + chunk) // 16]
                runner.kv_cache.write_pages(done, codec.to_tensor(codec.payloads(runner.kv_cache.read_pages(done))))
        return torch.cat(outs)  # [256, V]

    ref, q = run(256), run(32)
    agreement = float((ref.argmax(-1) == q.argmax(-1)).float().mean())
    max_diff = float((ref - q).abs().max())
    record_property("int8_top1_agreement", agreement)
    record_property("int8_max_logit_diff", max_diff)
    print(f"int8 KV: top-1 agreement {agreement:.4f}, largest logit difference {max_diff:.4f}")
    assert agreement >= 0.95
