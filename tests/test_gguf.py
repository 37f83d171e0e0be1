"""GGUF loading: tiny files written like llama.cpp's converter must give transformers' logits,
the demo model must generate what transformers generates, and damaged files must fail by name."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.attention.torch_paged import TorchPagedBackend
from engine.loading.gguf_file import GGUFSource
from engine.loading.loader import LoadedModel
from engine.loading.safetensors_file import CheckpointError
from engine.loading.weights import load_model
from engine.model.config import ModelConfig, UnsupportedModel
from engine.model_runner import Chunk, ModelRunner
from kvstore.block_pool import BlockPool
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec
from tests.hf_demo import transformers_demo
from tests.tiny_models import engine_greedy

TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # sharper attention than the default 0.02, so that RoPE differences show
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)

# name -> (GGUF architecture, transformers model class, its config)
CASES: dict[str, tuple[str, type[PreTrainedModel], Any]] = {
    "llama-tied-llama3": (
        "llama",
        LlamaForCausalLM,
        LlamaConfig(
            **(TINY | dict(max_position_embeddings=16384)), tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
        ),
    ),
    "llama-bias-linear": (
        "llama",
        LlamaForCausalLM,
        LlamaConfig(
            **TINY,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.0),
        ),
    ),
    "qwen2": ("qwen2", Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=False)),
    "qwen3-yarn-headdim": (
        "qwen3",
        Qwen3ForCausalLM,
        Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False, rope_parameters=YARN_ROPE),
    ),
}


# --- writing GGUF files the way llama.cpp's convert_hf_to_gguf.py does ------------------------


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (rotate-half rows to interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's `generate_extra_tensors` for Llama 3 RoPE scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, arch: str, model: PreTrainedModel) -> None:
    """Metadata and float32 tensors as llama.cpp's converter writes them (names from gguf-py's own map)."""
    cfg = model.config
    rope = dict(cfg.rope_parameters)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llamacpp_rope_freqs(rope, head_dim))
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = tensor.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            value = llamacpp_permute(value, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            value = llamacpp_permute(value, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_gguf(tmp_path: Path, case: str) -> tuple[Path, PreTrainedModel]:
    arch, cls, cfg = CASES[case]
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    with torch.no_grad():  # random norms, so that a swapped or missing norm shows in the logits
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, ref)
    return path, ref


def runner_for(model: Any, config: ModelConfig, num_pages: int = 64) -> tuple[ModelRunner, BlockPool]:
    spec = KVSpec(config.num_layers, config.num_kv_heads, config.head_dim, 16, "float32")
    backend = TorchPagedBackend(config.num_heads, config.num_kv_heads, config.head_dim)
    return ModelRunner(model, KVCache(spec, num_pages), backend), BlockPool(num_pages)


# --- tiny models: same logits as transformers ------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    path, ref = tiny_gguf(tmp_path, case)
    source = GGUFSource(path)
    arch = type(ref).__name__
    expected = ModelConfig.from_hf(ref.config.to_dict() | {"architectures": [arch]})
    got = source.config
    # The whole config as transformers' config.json would give it; GGUF stores eps as float32.
    assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(got, rms_norm_eps=expected.rms_norm_eps) == expected
    assert (got.bos_token_id, got.eos_token_ids) == (1, (2,))

    model, stats = load_model(got, source, torch.float32, progress=False)
    assert stats.num_tensors == len(list(source.tensors()))
    runner, pool = runner_for(model, got)
    ids = torch.randint(0, got.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    out = runner.run([Chunk(ids, pool.allocate(19), len(ids))], all_logits=True)
    err = ((out - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"{case}: relative logits error {err:.2e}"


def test_llama_qk_unpermute_matters(tmp_path: Path) -> None:
    """Guard against a test that would pass without un-permuting: the permuted rows differ."""
    path, ref = tiny_gguf(tmp_path, "llama-bias-linear")
    src = GGUFSource(path)
    q = next(t for t in src.tensors() if t.name == "model.layers.0.self_attn.q_proj.weight")
    raw = next(t for t in src.reader.tensors if t.name == "blk.0.attn_q.weight")
    hf = ref.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q.read(), hf)
    assert not torch.equal(torch.from_numpy(np.array(raw.data)), hf)


# --- damaged and unsupported files -----------------------------------------------------------


def test_truncated_gguf_is_checkpoint_error(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "qwen2")
    data = path.read_bytes()
    src = GGUFSource(path)
    data_start = min(t.data_offset for t in src.reader.tensors)
    # In the magic, the counts, the metadata, the tensor index, and the tensor data.
    cuts = [0, 3, 10, 30, 100, data_start // 2, data_start - 1, data_start + 5, (data_start + len(data)) // 2]
    cuts += [len(data) - 1]
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=str(bad)):
            GGUFSource(bad)


def test_garbage_gguf_is_checkpoint_error(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match=str(bad)):
        GGUFSource(bad)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModel, match=r"'gpt2'.*llama, qwen2, qwen3"):
        GGUFSource(path)


# --- the demo model: same greedy tokens as transformers --------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Explain in detail how a bicycle works.",
    "Tell me a long story about a dragon who learns to bake bread.",
]


@pytest.fixture(scope="module")
def demo_hf(demo_gguf: Path) -> Any:
    """transformers' own GGUF load of the demo model, once per module (kept: `tests/hf_demo.py`)."""
    return transformers_demo(demo_gguf)


@pytest.mark.slow
def test_demo_greedy_matches_transformers(demo_float32: LoadedModel, demo_hf: Any) -> None:
    """48 greedy tokens for three chat prompts, ours batched against transformers one by one.
    (Our tokenizer is transformers' GGUF tokenizer, so both sides get the same prompt ids.)"""
    lm = demo_float32
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = engine_greedy(lm.model, prompts, 48, tokenizer=lm.tokenizer)
    runner, pool = runner_for(lm.model, lm.config)

    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = demo_hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=48,
            )
        want = out[0, len(ids) :].tolist()
        if want and want[-1] in lm.tokenizer.eos_token_ids:
            want = want[:-1]
        assert got == want, f"ours: {lm.tokenizer.decode(got)!r}\ntransformers: {lm.tokenizer.decode(want)!r}"
    assert "Paris" in lm.tokenizer.decode(ours[0])
    assert max(len(o) for o in ours) == 48  # at least one answer runs the whole budget

    # The prompt's logits, position by position, to the same tolerance as the tiny models.
    ids = prompts[1]
    with torch.no_grad():
        want_logits = demo_hf(torch.tensor([ids])).logits[0].float()
    got_logits = runner.run([Chunk(ids, pool.allocate(-(-len(ids) // 16)), len(ids))], all_logits=True)
    err = ((got_logits - want_logits).abs().max() / want_logits.abs().max()).item()
    assert err < 1e-4, f"relative logits error {err:.2e}"
