"""Sparse MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, in both checkpoint layouts."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.loading.safetensors_file import CheckpointError
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model.moe import SparseMoE, router_loads
from engine.model_runner import Chunk
from kvstore.block_pool import BlockPool
from tests.tiny_models import (
    TinyModel,
    build_tiny,
    check_greedy_matches,
    check_logits_all_chunkings,
    check_mixed_step,
    make_runner,
    one_thread,
    reference_logits,
    rel_error,
    run_chunked,
)

ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # A shared expert, no renormalisation, and a dense middle layer (mlp_only_layers).
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
}
PROMPT_LENGTHS = (7, 23, 45)
THRESHOLD = 1e-4


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


def fuse_checkpoint(src: Path, dst: Path) -> None:
    """Rewrite a per-expert checkpoint in transformers 5's fused layout: per layer
    `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
    `mlp.experts.down_proj [E, H, I]`; Mixtral's `block_sparse_moe` becomes `mlp`."""
    tensors = load_file(src / "model.safetensors")
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        prefix, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        expert, proj, _ = rest.split(".")
        part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
        parts[prefix][part][int(expert)] = t
    for prefix, p in parts.items():
        E = len(p["gate_proj"])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([p["gate_proj"][e], p["up_proj"][e]]) for e in range(E)]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([p["down_proj"][e] for e in range(E)])
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    config_cls, model_cls, kwargs = ARCHS[request.param]
    return build_tiny(config_cls, model_cls, tmp_path_factory.mktemp(request.param), **kwargs)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def test_logits_match_transformers(tiny: TinyModel) -> None:
    check_logits_all_chunkings(tiny, _prompts(tiny.config.vocab_size), THRESHOLD, page_size=4)


def test_mixed_prefill_and_decode_step(tiny: TinyModel) -> None:
    check_mixed_step(tiny, _prompts(tiny.config.vocab_size), THRESHOLD, page_size=4)


def test_greedy_tokens_match_transformers(tiny: TinyModel) -> None:
    check_greedy_matches(tiny, _prompts(tiny.config.vocab_size))


def test_fused_layout_loads_identically(tiny: TinyModel, tmp_path: Path) -> None:
    """transformers 5's fused expert tensors fill the same parameters bit for bit (so every
    differential check above holds for them too), and the logits match."""
    fuse_checkpoint(tiny.path, tmp_path)
    assert any(n.endswith("experts.gate_up_proj") for n in load_file(tmp_path / "model.safetensors"))
    fused, _ = load_model(tiny.config, SafetensorsSource(tmp_path), torch.float32, progress=False)
    for (n1, p1), (n2, p2) in zip(tiny.model.named_parameters(), fused.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = _prompts(tiny.config.vocab_size)[2]
    runner = make_runner(tiny.config, fused, page_size=4)
    out = run_chunked(runner, BlockPool(runner.kv_cache.num_pages), ids, 16)
    assert rel_error(out, reference_logits(tiny.ref, ids)) < THRESHOLD


def _reference_routes(ref: Any, ids: list[int]) -> dict[int, torch.Tensor]:
    """transformers' chosen experts per MoE layer for a full-sequence forward: {layer: [T, k]}."""
    routes: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        if hasattr(layer.mlp, "experts"):
            hook = layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: routes.__setitem__(i, out[2]))
            hooks.append(hook)
    reference_logits(ref, ids)
    for h in hooks:
        h.remove()
    return routes


@pytest.mark.parametrize("arch", list(ARCHS))
def test_each_active_expert_runs_once_on_its_rows(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts the experts' actual work: one call per active expert and layer, on exactly the
    tokens transformers routes to it (tokens x top_k rows in all); idle experts never run."""
    config_cls, model_cls, kwargs = ARCHS[arch]
    t = build_tiny(config_cls, model_cls, tmp_path, **kwargs)
    assert t.config.moe is not None
    E, k = t.config.moe.num_experts, t.config.moe.top_k
    calls: list[tuple[SparseMoE, int, int]] = []
    original = SparseMoE.expert_forward

    def counting(self: SparseMoE, e: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append((self, e, rows.shape[0]))
        return original(self, e, rows)

    monkeypatch.setattr(SparseMoE, "expert_forward", counting)
    assert all(x.device.type == "cpu" and x.sum() == 0 for x in router_loads(t.model).values())
    ids = _prompts(t.config.vocab_size)[1]  # 23 tokens
    runner = make_runner(t.config, t.model)
    pool = BlockPool(runner.kv_cache.num_pages)
    pages = pool.allocate(2)
    runner.run([Chunk(ids, pages, len(ids))])
    routes = _reference_routes(t.ref, ids)
    loads = router_loads(t.model)
    assert sorted(loads) == sorted(routes) and loads, "router_loads must cover every MoE layer"
    for i, layer in enumerate(t.model.model.layers):
        moe = layer.mlp
        if not isinstance(moe, SparseMoE):
            assert i not in routes
            continue
        mine = [(e, n) for m, e, n in calls if m is moe]
        experts = [e for e, _ in mine]
        assert len(experts) == len(set(experts)), f"layer {i}: an expert ran twice"
        assert sum(n for _, n in mine) == len(ids) * k
        expected = torch.bincount(routes[i].reshape(-1), minlength=E)
        assert torch.equal(loads[i], expected), f"layer {i}: load {loads[i]} != transformers' {expected}"
        assert dict(mine) == {e: int(n) for e, n in enumerate(expected) if n > 0}
        assert moe.last_expert_calls == len(mine) == int((expected > 0).sum())
    assert sum(m.num_expert_calls for m in t.model.modules() if isinstance(m, SparseMoE)) == len(calls)
    # A decode step of one token runs exactly k experts per layer.
    calls.clear()
    runner.run([Chunk([ids[0]], pages, len(ids) + 1)])
    for moe in (m for m in t.model.modules() if isinstance(m, SparseMoE)):
        assert sorted(n for m, _, n in calls if m is moe) == [1] * k
        assert int(moe.last_load.sum()) == k and moe.last_load.dtype == torch.int64


def test_fused_layout_is_transformers_in_memory_layout(tmp_path: Path) -> None:
    """The rewritten layout is exactly transformers 5's own parameters, which it loads as is."""
    config_cls, model_cls, kwargs = ARCHS["mixtral"]
    t = build_tiny(config_cls, model_cls, tmp_path / "a", **kwargs)
    fuse_checkpoint(t.path, tmp_path / "b")
    fused = load_file(tmp_path / "b" / "model.safetensors")
    state = t.ref.state_dict()
    assert set(fused) == set(state)
    assert all(torch.equal(fused[n], state[n]) for n in fused)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    assert all(torch.equal(p, state[n]) for n, p in again.state_dict().items())


def test_checkpoint_name_map() -> None:
    raw = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 12,
    }
    moe = SparseMoE(ModelConfig.from_hf(raw))
    m = moe.checkpoint_name_map
    assert m("experts.3.gate_proj.weight") == ("w13", (3, "gate"))
    assert m("experts.0.up_proj.weight") == ("w13", (0, "up"))
    assert m("experts.2.down_proj.weight") == ("w2", (2, "down"))
    assert m("experts.1.w1.weight") == ("w13", (1, "gate"))
    assert m("experts.1.w3.weight") == ("w13", (1, "up"))
    assert m("experts.1.w2.weight") == ("w2", (1, "down"))
    assert m("experts.gate_up_proj") == ("w13", None)
    assert m("experts.down_proj") == ("w2", None)
    assert m("gate.weight") == ("gate.weight", None)
    assert m("shared_expert.up_proj.weight") == ("shared_expert.gate_up_proj.weight", "up")
    assert m("shared_expert_gate.weight") == ("shared_expert_gate.weight", None)
    assert m("experts.4.gate_proj.weight") is None  # no such expert
    assert m("experts.0.gate_proj.bias") is None
    # Every part of the stacked weights is declared, so the loader checks each is loaded once.
    specs = moe.__dict__["shard_specs"]
    assert len(specs["w13"]) == 8 and len(specs["w2"]) == 4
    w13 = torch.zeros(4, 16, 16)
    w13[specs["w13"][(2, "up")]] = 1
    assert w13[2, 8:].eq(1).all() and w13.sum() == 8 * 16


@pytest.fixture(scope="module")
def mixtral_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    config_cls, model_cls, kwargs = ARCHS["mixtral"]
    return build_tiny(config_cls, model_cls, tmp_path_factory.mktemp("mixtral-ckpt"), **kwargs)


def _write(tmp: Path, src: TinyModel, tensors: dict[str, torch.Tensor]) -> SafetensorsSource:
    tmp.mkdir()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src.path / "config.json", tmp / "config.json")
    return SafetensorsSource(tmp)


def test_missing_expert_is_reported(mixtral_ckpt: TinyModel, tmp_path: Path) -> None:
    tensors = load_file(mixtral_ckpt.path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.w13 \(part \(5, 'up'\)\)"):
        load_model(mixtral_ckpt.config, _write(tmp_path / "c", mixtral_ckpt, tensors), torch.float32, progress=False)


def test_fused_and_per_expert_tensors_overlap(mixtral_ckpt: TinyModel, tmp_path: Path) -> None:
    tensors = load_file(mixtral_ckpt.path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 96)
    with pytest.raises(CheckpointError, match="overlaps"):
        load_model(mixtral_ckpt.config, _write(tmp_path / "c", mixtral_ckpt, tensors), torch.float32, progress=False)


def test_wrong_expert_shape_is_reported(mixtral_ckpt: TinyModel, tmp_path: Path) -> None:
    tensors = load_file(mixtral_ckpt.path / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(64, 95)
    with pytest.raises(CheckpointError, match=r"experts\.2\.w2\.weight.*\[64, 95\].*\[64, 96\]"):
        load_model(mixtral_ckpt.config, _write(tmp_path / "c", mixtral_ckpt, tensors), torch.float32, progress=False)


def test_moe_config_parsing(tmp_path: Path) -> None:
    # Qwen3-MoE's config.json says `num_local_experts` (its attribute_map for `num_experts`).
    Qwen3MoeConfig(num_experts=5, hidden_size=16, num_attention_heads=2, num_key_value_heads=2).save_pretrained(
        tmp_path
    )
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in raw and raw["num_local_experts"] == 5
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained_dir(tmp_path)
    assert cfg.moe is not None and cfg.moe.num_experts == 5
    base = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 4}
    base |= {
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
    }
    cfg = ModelConfig.from_hf(base | {"decoder_sparse_step": 2, "mlp_only_layers": [3], "qkv_bias": False})
    assert cfg.moe is not None and cfg.moe.dense_layers == (0, 2, 3)
    assert not cfg.attention_bias and ModelConfig.from_hf(base).attention_bias


def test_qwen2_moe_without_qkv_bias_loads(tmp_path: Path) -> None:
    config_cls, model_cls, kwargs = ARCHS["qwen2_moe"]
    t = build_tiny(config_cls, model_cls, tmp_path, **(kwargs | {"qkv_bias": False}))
    ids = _prompts(t.config.vocab_size)[0]
    runner = make_runner(t.config, t.model)
    err = rel_error(run_chunked(runner, BlockPool(runner.kv_cache.num_pages), ids, 3), reference_logits(t.ref, ids))
    assert err < THRESHOLD


def test_bfloat16_moe_close_to_float32(mixtral_ckpt: TinyModel) -> None:
    model, _ = load_model(mixtral_ckpt.config, SafetensorsSource(mixtral_ckpt.path), torch.bfloat16, progress=False)
    ids = _prompts(mixtral_ckpt.config.vocab_size)[1]
    runner = make_runner(mixtral_ckpt.config, model)
    out = run_chunked(runner, BlockPool(runner.kv_cache.num_pages), ids, 8)
    assert rel_error(out, reference_logits(mixtral_ckpt.ref, ids)) < 3e-2
