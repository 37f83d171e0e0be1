"""Checkpoint loading: clear errors on bad files, streaming memory, statistics."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.loading.model_source import ModelNotFound, resolve_model
from engine.loading.safetensors_file import CheckpointError
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig, UnsupportedModel
from tests.server import ROOT
from tests.tiny_models import build_tiny


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path)
    return tmp_path


def _load(path: Path) -> None:
    load_model(ModelConfig.from_pretrained_dir(path), SafetensorsSource(path), torch.float32, progress=False)


def _rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        _load(ckpt)


def test_missing_part_of_packed_parameter_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*qkv_proj\.weight \(part k\)"):
        _load(ckpt)


def test_wrong_shape_names_file_tensor_and_shapes(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    with pytest.raises(CheckpointError) as e:
        _load(ckpt)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "[95, 64]" in msg and "[96, 64]" in msg


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        _load(ckpt)


def test_truncated_file(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)


def test_corrupt_header(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe\x00}"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        _load(ckpt)


def test_unsupported_architecture_lists_supported(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=r"GPT2LMHeadModel.*supported:.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained_dir(ckpt)


def test_unsupported_rope_type(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=r"longrope.*supported: default, linear, dynamic, llama3, yarn"):
        ModelConfig.from_pretrained_dir(ckpt)


def test_hub_id_offline_names_repo() -> None:
    with pytest.raises(ModelNotFound, match="no-such-org/no-such-model"):
        resolve_model("no-such-org/no-such-model")


def test_cli_reports_errors_cleanly(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "generate", "--model", "no-such-org/no-such-model", "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"LONGCTX_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2
    assert "no-such-org/no-such-model" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_load_stats_and_fingerprint(tmp_path: Path) -> None:
    a = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "a", seed=0)
    _, stats = load_model(a.config, SafetensorsSource(a.path), torch.float32, progress=False)
    _, again = load_model(a.config, SafetensorsSource(a.path), torch.float32, progress=False)
    b = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "b", seed=1)
    _, other = load_model(b.config, SafetensorsSource(b.path), torch.float32, progress=False)
    assert stats.bytes_read == sum(p.stat().st_size for p in a.path.glob("*.safetensors")) - _header_bytes(a.path)
    assert stats.num_tensors == len(load_file(a.path / "model.safetensors"))
    assert {"build", "read", "copy"} <= set(stats.phases) and stats.gb_per_s > 0
    assert stats.fingerprint == again.fingerprint != other.fingerprint


def test_mapped_load_equals_read_load_without_copies(tmp_path: Path) -> None:
    """A mapped source (the conversion cache) gives the same model; whole tensors in the model's
    dtype become the parameters as mapped (no copy), and writing one never reaches the file."""
    a = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "a", seed=0)
    read, stats = load_model(a.config, SafetensorsSource(a.path), torch.float32, progress=False)
    mapped, mstats = load_model(a.config, SafetensorsSource(a.path, mapped=True), torch.float32, progress=False)
    assert mstats.fingerprint == stats.fingerprint
    for (name, p), (_, q) in zip(read.state_dict().items(), mapped.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    embed = mapped.model.embed_tokens.weight
    before = (a.path / "model.safetensors").read_bytes()
    assert not embed.data.untyped_storage().resizable()  # a file mapping, not an allocation
    with torch.no_grad():
        embed.add_(1.0)
    assert (a.path / "model.safetensors").read_bytes() == before


def test_kv_pool_starts_zeroed() -> None:
    from kvstore.kv_cache import KVCache
    from kvstore.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")
    cache = KVCache(spec, 3)
    assert all(layer.shape == (3, 2, 4, 1, 8) and not layer.any() for layer in cache.layers)
    cache.write_pages([1], torch.ones(1, 2, 2, 4, 1, 8, dtype=torch.bfloat16))
    assert cache.read_pages([1]).eq(1).all() and not cache.read_pages([0, 2]).any()


def _header_bytes(path: Path) -> int:
    raw = (path / "model.safetensors").read_bytes()
    return 8 + int.from_bytes(raw[:8], "little")


STREAM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import psutil, torch
    from engine.model.config import ModelConfig
    from engine.loading.weights import SafetensorsSource, load_model
    path = Path(sys.argv[1])
    config = ModelConfig.from_pretrained_dir(path)
    source = SafetensorsSource(path)
    base = psutil.Process().memory_info().rss
    model, stats = load_model(config, source, torch.float32, progress=False)
    # VmHWM, not ru_maxrss: the latter carries over the parent's peak across fork and exec
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({"base": base, "peak": peak, "bytes": stats.bytes_read}))
    """
)


@pytest.mark.slow
def test_streaming_load_peak_memory(tmp_path: Path) -> None:
    """A ~300 MB sharded checkpoint loads with peak RSS under baseline + 1.3x its bytes."""
    cfg = LlamaConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=8192, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(cfg).named_parameters()}
    weight_map, shard, size, index = {}, {}, 0, 0
    g = torch.Generator().manual_seed(0)
    for i, (name, shape) in enumerate(shapes.items()):
        shard[name] = torch.randn(shape, generator=g) * 0.02
        size += shard[name].numel() * 4
        if sum(t.numel() for t in shard.values()) * 4 > 80e6 or i == len(shapes) - 1:
            fname = f"model-{index:05d}.safetensors"
            save_file(shard, tmp_path / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard, index = {}, index + 1
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert size > 250e6 and index >= 3
    out = subprocess.run(
        [sys.executable, "-c", STREAM_SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["bytes"] == size
    assert r["peak"] - r["base"] < 1.3 * size, r
