"""Differential tests of the dense decoder against transformers, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvstore.block_pool import BlockPool
from tests.tiny_models import (
    build_tiny,
    check_greedy_matches,
    check_logits_all_chunkings,
    check_mixed_step,
    make_runner,
    reference_logits,
    rel_error,
    run_chunked,
)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CASES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama-default-untied": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-tied-mha": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama-linear": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": LLAMA3 | {"original_max_position_embeddings": 64}},
    ),
    "llama-yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None, "head_dim": 24}),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3-qknorm": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    "llama-attention-bias": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True}),
    "qwen3-yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
}
PROMPT_LENGTHS = (7, 23, 45)
THRESHOLD = 1e-4


def _pin_dynamic_rope(ref: Any) -> None:
    """Our `dynamic` is transformers' dynamic NTK evaluated once at max_position x factor;
    transformers recomputes it per call from the sequence length, so pin its table to that."""
    cfg = ref.config
    seq_len = int(cfg.max_position_embeddings * cfg.rope_parameters["factor"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, seq_len=seq_len)
    rotary = ref.model.rotary_emb
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config_cls, model_cls, kwargs = CASES[request.param]
    t = build_tiny(config_cls, model_cls, tmp_path_factory.mktemp(request.param), **kwargs)
    if request.param == "llama-dynamic":
        _pin_dynamic_rope(t.ref)
    return t


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def test_logits_match_transformers(tiny: Any) -> None:
    check_logits_all_chunkings(tiny, _prompts(tiny.config.vocab_size), THRESHOLD)


def test_mixed_prefill_and_decode_step(tiny: Any) -> None:
    check_mixed_step(tiny, _prompts(tiny.config.vocab_size), THRESHOLD)


def test_greedy_tokens_match_transformers(tiny: Any) -> None:
    check_greedy_matches(tiny, _prompts(tiny.config.vocab_size))


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    whole = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "whole", vocab_size=4000)
    sharded = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "sharded", vocab_size=4000, max_shard_size="300KB")
    assert (sharded.path / "model.safetensors.index.json").exists()
    for (n1, p1), (n2, p2) in zip(whole.model.named_parameters(), sharded.model.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


# float16 keeps 3 more mantissa bits than bfloat16: its error (~1e-3 here) is ~6x smaller, and so
# is its bound; one shared bound would let a float16 bug through unseen.
@pytest.mark.parametrize(("dtype", "threshold"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_dtype_conversion(tmp_path: Path, dtype: torch.dtype, threshold: float) -> None:
    from engine.loading.weights import SafetensorsSource, load_model

    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path)
    model, _ = load_model(t.config, SafetensorsSource(t.path), dtype, progress=False)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = _prompts(t.config.vocab_size)[1]
    runner = make_runner(t.config, model)
    err = rel_error(run_chunked(runner, BlockPool(runner.kv_cache.num_pages), ids, 8), reference_logits(t.ref, ids))
    assert err < threshold
