"""Sliding-window attention against transformers: tiny windows, sequences several windows long."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.model.config import ModelConfig, UnsupportedModel
from engine.model.model import Attention
from kvstore.block_pool import BlockPool
from tests.tiny_models import (
    TinyModel,
    build_tiny,
    engine_greedy,
    make_runner,
    one_thread,
    reference_logits,
    rel_error,
    run_chunked,
    run_mixed_step,
)

CASES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 6}),
    # Layer 0 full, layer 1 windowed (max_window_layers=1): two windows in one model.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    # Qwen2-MoE's own default: the even layers below max_window_layers are windowed.
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 2,
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
}
EXPECTED_WINDOWS = {"mistral": (6, 6), "qwen2": (None, 5), "qwen2_moe": (4, None, None)}
PROMPT_LENGTHS = (7, 23, 45)
THRESHOLD = 1e-4


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, TinyModel]:
    config_cls, model_cls, kwargs = CASES[request.param]
    t = build_tiny(config_cls, model_cls, tmp_path_factory.mktemp(request.param), **kwargs)
    assert t.config.sliding_windows == EXPECTED_WINDOWS[request.param]
    return request.param, t


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(tiny: tuple[str, TinyModel], attn: str) -> None:
    _, t = tiny
    t.ref.config._attn_implementation = attn  # both of transformers' paths apply the window
    runner = make_runner(t.config, t.model, page_size=4)
    pool = BlockPool(runner.kv_cache.num_pages)
    for ids in _prompts(t.config.vocab_size):
        ref = reference_logits(t.ref, ids)
        for chunk in (len(ids), 5, 1):
            err = rel_error(run_chunked(runner, pool, ids, chunk), ref)
            assert err < THRESHOLD, f"{attn} chunk={chunk} len={len(ids)}: error {err:.2e}"


def test_window_off_by_one_is_detected(tiny: tuple[str, TinyModel]) -> None:
    """The test above can fail: one token more or less in the window changes the logits."""
    _, t = tiny
    runner = make_runner(t.config, t.model, page_size=4)
    pool = BlockPool(runner.kv_cache.num_pages)
    ids = _prompts(t.config.vocab_size)[2]
    ref = reference_logits(t.ref, ids)
    attns = [m for m in t.model.modules() if isinstance(m, Attention)]
    windows = [a.window for a in attns]
    try:
        for delta in (-1, 1, None):
            for a, w in zip(attns, windows, strict=True):
                a.window = None if delta is None or w is None else w + delta
            assert rel_error(run_chunked(runner, pool, ids, 5), ref) > 1e-3, f"window change {delta} went unnoticed"
    finally:
        for a, w in zip(attns, windows, strict=True):
            a.window = w


def test_mixed_prefill_and_decode_step(tiny: tuple[str, TinyModel]) -> None:
    _, t = tiny
    runner = make_runner(t.config, t.model, page_size=4)
    pool = BlockPool(runner.kv_cache.num_pages)
    p = _prompts(t.config.vocab_size)
    prompts = [p[2], p[0], p[1]]
    outs = run_mixed_step(runner, pool, prompts, 20)
    assert rel_error(outs[0], reference_logits(t.ref, prompts[0])[20:]) < THRESHOLD
    for prompt, out in zip(prompts[1:], outs[1:], strict=True):
        assert rel_error(out, reference_logits(t.ref, prompt)[-1:]) < THRESHOLD


def test_greedy_tokens_match_transformers(tiny: tuple[str, TinyModel]) -> None:
    """32 tokens past prompts longer than the window (transformers' cache drops old tokens)."""
    _, t = tiny
    prompts = _prompts(t.config.vocab_size)
    ours = engine_greedy(t.model, prompts, 32, page_size=4)
    t.ref.generation_config.eos_token_id = None
    t.ref.generation_config.pad_token_id = 0
    for ids, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = t.ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert out == ref[0, len(ids) :].tolist()


def _transformers_windows(hf: Any) -> tuple[int | None, ...]:
    """Per layer, the window transformers' attention uses for this config."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or None  # Qwen2-MoE says 0 for none
    if hf.model_type == "llama":
        return ()
    if hf.model_type in ("mistral", "mixtral", "qwen3_moe"):  # one window for every layer
        return (window,) * n if window else ()
    out = tuple(window if t == "sliding_attention" else None for t in hf.layer_types)
    return out if any(out) else ()


TINY = {"vocab_size": 8, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 6}


@pytest.mark.parametrize(
    ("config_cls", "arch", "kwargs"),
    [
        (MistralConfig, "MistralForCausalLM", {"sliding_window": 7}),
        (MistralConfig, "MistralForCausalLM", {"sliding_window": None}),
        (MixtralConfig, "MixtralForCausalLM", {"sliding_window": 9}),
        (LlamaConfig, "LlamaForCausalLM", {}),
        (Qwen2Config, "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}),
        (Qwen2Config, "Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 4}),
        (Qwen2Config, "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28}),
        (
            Qwen2Config,
            "Qwen2ForCausalLM",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 3,
            },
        ),
        (Qwen3Config, "Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
        (
            Qwen2MoeConfig,
            "Qwen2MoeForCausalLM",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 5},
        ),
        (Qwen2MoeConfig, "Qwen2MoeForCausalLM", {"use_sliding_window": False, "sliding_window": 8}),
        (Qwen3MoeConfig, "Qwen3MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8}),
        (Qwen3MoeConfig, "Qwen3MoeForCausalLM", {"use_sliding_window": False, "sliding_window": 8}),
    ],
)
def test_windows_follow_transformers_config_semantics(config_cls: type, arch: str, kwargs: dict[str, Any]) -> None:
    """Our per-layer windows, from the raw config dict and from transformers' normalised one."""
    hf = config_cls(**(TINY | kwargs))
    expected = _transformers_windows(hf)
    raw = TINY | kwargs | {"architectures": [arch], "num_experts": 4, "num_experts_per_tok": 2}
    raw |= {"moe_intermediate_size": 8, "num_local_experts": 4, "intermediate_size": 8}
    assert ModelConfig.from_hf(raw).sliding_windows == expected
    assert ModelConfig.from_hf(hf.to_dict() | {"architectures": [arch]}).sliding_windows == expected


def test_unknown_layer_type_is_rejected() -> None:
    raw = TINY | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4}
    raw |= {"intermediate_size": 8, "layer_types": ["chunked_attention"] * 6}
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        ModelConfig.from_hf(raw)
