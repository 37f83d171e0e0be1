"""Prefix cache: chained content hashes, and prefix hits that compute only the rest of a prompt
with the same logits as a fresh prefill (dense, MoE and the demo model)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from engine.engine import Engine, EngineConfig
from engine.loading.weights import SafetensorsSource, load_model
from engine.sampling_params import SamplingParams
from kvstore.prefix import KV_FORMAT_VERSION, Namespace, hash_page, max_cached_pages, page_hashes
from tests.tiny_models import TinyModel, build_tiny

NS = Namespace("LlamaForCausalLM", "ab" * 16, "float32", "float32", 16)


def test_hash_is_blake2b_of_parent_tokens_namespace() -> None:
    ns = NS.digest
    h0 = hash_page(b"", list(range(16)), ns)
    want = hashlib.blake2b(struct.pack("<16i", *range(16)) + ns, digest_size=16).digest()
    assert h0 == want and len(h0) == 16
    h1 = hash_page(h0, [7] * 16, ns)
    assert h1 == hashlib.blake2b(h0 + struct.pack("<16i", *[7] * 16) + ns, digest_size=16).digest()


def test_chain_namespace_and_salt_separate_pages() -> None:
    tokens = list(range(50))
    hashes = page_hashes(tokens, 16, NS.digest)
    assert len(hashes) == 3  # only full pages
    changed = page_hashes([99, *tokens[1:]], 16, NS.digest)
    assert all(a != b for a, b in zip(hashes, changed, strict=True))  # a change propagates down the chain
    assert page_hashes(tokens[:32], 16, NS.digest) == hashes[:2]
    others = [
        Namespace("LlamaForCausalLM", "cd" * 16, "float32", "float32", 16),  # other weights
        Namespace("LlamaForCausalLM", "ab" * 16, "bfloat16", "float32", 16),
        Namespace("LlamaForCausalLM", "ab" * 16, "float32", "int8", 16),
        Namespace("LlamaForCausalLM", "ab" * 16, "float32", "float32", 16, tp_size=2, tp_rank=1),
    ]
    for other in others:
        assert page_hashes(tokens, 16, other.digest)[0] != hashes[0]
    assert page_hashes(tokens, 16, NS.salted("tenant-a"))[0] != page_hashes(tokens, 16, NS.salted("tenant-b"))[0]
    assert NS.salted("") == NS.digest
    assert [max_cached_pages(n, 16) for n in (1, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]


def numerics_variants(config: Any) -> dict[str, Any]:
    """Configs that differ from `config` only in what K/V depend on besides the weights."""
    from dataclasses import replace

    rope = config.rope
    return {
        "rope_theta": replace(config, rope=replace(rope, theta=rope.theta * 2)),
        "rope_scaling": replace(config, rope=replace(rope, type="linear", factor=2.0)),
        "rope_yarn_factor": replace(config, rope=replace(rope, type="yarn", factor=4.0)),
        "max_position_embeddings": replace(config, max_position_embeddings=config.max_position_embeddings * 2),
        "window": replace(config, sliding_windows=(None,) * (config.num_layers - 1) + (64,)),
        "norm_eps": replace(config, rms_norm_eps=config.rms_norm_eps * 10),
        "qk_norm": replace(config, qk_norm=not config.qk_norm),
    }


def test_namespace_covers_numerics_and_format_version(tmp_path: Path) -> None:
    from dataclasses import replace

    from engine.kv_tiers import numerics_digest
    from engine.model.config import ModelConfig

    config = ModelConfig.from_hf(
        {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 160}
    )  # fmt: skip
    base = numerics_digest(config)
    assert base == numerics_digest(replace(config, eos_token_ids=(7,), bos_token_id=1))  # ids name no K or V
    keys = {NS.key}
    for name, other in numerics_variants(config).items():
        digest = numerics_digest(other)
        assert digest != base, name
        keys.add(replace(NS, numerics=digest).key)
    keys.add(replace(NS, format_version=KV_FORMAT_VERSION + 1).key)
    assert len(keys) == len(numerics_variants(config)) + 2  # every change names other pages
    assert page_hashes(list(range(16)), 16, replace(NS, format_version=KV_FORMAT_VERSION + 1).digest) != page_hashes(
        list(range(16)), 16, NS.digest
    )


def fingerprint_of(path: Path) -> str:
    from engine.model.config import ModelConfig

    _, stats = load_model(ModelConfig.from_pretrained_dir(path), SafetensorsSource(path), torch.float32, progress=False)
    return stats.fingerprint


class LogitTap:
    """Records the logits of every forward pass of an engine's runner."""

    def __init__(self, engine: Engine):
        self.logits: list[torch.Tensor] = []
        run = engine.runner.run

        def tapped(chunks: Any, all_logits: bool = False) -> torch.Tensor:
            out = run(chunks, all_logits)
            self.logits.append(out.clone())
            return out

        engine.runner.run = tapped  # type: ignore[method-assign, assignment]


def first_logits(engine: Engine, prompt: list[int], salt: str = "") -> tuple[torch.Tensor, int, int]:
    """(logits of the prompt's last token, cached_tokens, tokens the runner computed)."""
    tap = LogitTap(engine)
    before = engine.runner.num_tokens_computed
    h = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), cache_salt=salt)
    engine.run_until_idle()
    outs = list(h)
    engine.runner.run = type(engine.runner).run.__get__(engine.runner)  # type: ignore[method-assign]
    return tap.logits[-1][-1], outs[-1].cached_tokens, engine.runner.num_tokens_computed - before


# `EngineConfig.recompute_tokens_per_s` for tests of what a Redis tier restores: recomputing
# counts as slow, so every lookup asks Redis and waits for it. With the measured rate a tiny
# model's prefill (thousands of tokens/s) can beat a loaded machine's loopback round trip, and a
# lookup then rightly skips Redis (tests/test_kv_lookup_deadline.py checks that choice).
SLOW_RECOMPUTE = 100.0


def page_bytes(config: Any, page_size: int = 16, itemsize: int = 4) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize * page_size


def check_prefix_hits(model: Any, config: Any, vocab: int, quick: bool = False, **engine_kw: Any) -> None:
    """`quick`: only the partial-match case (for the demo model, whose passes are slow on CPU)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, vocab, (70,), generator=g).tolist()
    b = a[:50] + torch.randint(0, vocab, (30,), generator=g).tolist()
    kw = {"kv_cache_bytes": 64 * page_bytes(config)} | engine_kw
    cached = Engine(model, None, EngineConfig(**kw))
    fresh = Engine(model, None, EngineConfig(**kw, enable_prefix_caching=False))
    _, c0, n0 = first_logits(cached, a)
    assert (c0, n0) == (0, 70)
    cases = [(b, 48)] if quick else [(b, 48), (a, 64), (a[:64], 48), (a[:10], 0)]
    for prompt, want_cached in cases:
        ours, c, n = first_logits(cached, prompt)
        ref, c_ref, _ = first_logits(fresh, prompt)
        assert c == want_cached and c_ref == 0
        assert n == len(prompt) - want_cached  # the runner computed only the rest
        err = float((ours - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, err
    assert cached.pool.num_free == cached.pool.num_pages and all(c == 0 for c in cached.pool.ref_counts)
    if quick:
        return
    # another tenant never sees these pages
    assert first_logits(cached, a, salt="other")[1] == 0
    counters = cached.pool.counters
    assert counters.queries == 6 and counters.hits == 3 and counters.hit_tokens == 48 + 64 + 48
    assert cached.pool.num_free == cached.pool.num_pages and all(c == 0 for c in cached.pool.ref_counts)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("prefix-dense"))


def test_prefix_hits_dense(dense: TinyModel) -> None:
    check_prefix_hits(dense.model, dense.config, dense.config.vocab_size, max_num_batched_tokens=32)


def test_prefix_hits_moe(tmp_path: Path) -> None:
    t = build_tiny(MixtralConfig, MixtralForCausalLM, tmp_path, num_local_experts=4, num_experts_per_tok=2)
    check_prefix_hits(t.model, t.config, t.config.vocab_size)


@pytest.mark.slow
def test_prefix_hits_demo_model(demo_float32: Any) -> None:
    check_prefix_hits(demo_float32.model, demo_float32.config, demo_float32.config.vocab_size, quick=True)


def test_shared_prefix_under_preemption_and_abort(dense: TinyModel) -> None:
    """Many requests sharing a prefix on a pool too small for all: outputs equal those of a
    cache-less engine, and every reference is returned."""
    g = torch.Generator().manual_seed(9)
    vocab = dense.config.vocab_size
    shared = torch.randint(0, vocab, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    def run(**kw: Any) -> list[list[int]]:
        e = Engine(dense.model, None, EngineConfig(kv_cache_bytes=7 * page_bytes(dense.config), **kw))
        handles = [e.add_request(p, params) for p in prompts]
        aborted = e.add_request(prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
        e.step()
        e.abort(aborted.id)
        e.run_until_idle()
        assert e.pool.num_free == e.pool.num_pages and all(c == 0 for c in e.pool.ref_counts)
        assert e.scheduler.num_preemptions > 0
        return [h.result()[0] for h in handles]

    assert run() == run(enable_prefix_caching=False)
