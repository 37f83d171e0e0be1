"""`longctx doctor` on tiny random models (dense, MoE, sliding window) and on the demo model.

Every stage passes on healthy checkpoints; faults of our own, injected into the loaded model
(the files intact), fail the reference stage naming the layer and sub-module; bad files fail
against a baseline saved before the edit; NaN and zeroed tensors are caught while loading.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from api.cli import main
from api.doctor import DoctorOptions, run_doctor, run_stages
from api.doctor.reference_stage import load_transformers
from api.doctor.weights_stage import TensorStats, _sibling_outliers
from engine.loading.gguf_file import unpermute_qk
from engine.loading.loader import LoadedModel, load
from engine.model.rope import RotaryEmbedding
from tests.hf_demo import transformers_demo
from tests.tiny_models import build_tiny, one_thread

pytestmark = pytest.mark.slow
# The demo tokenizer's vocabulary, so that chat templates, schemas and tool calls work.
TINY = dict(vocab_size=49152, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3moe": (
        Qwen3MoeConfig, Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
    ),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 48}),
}  # fmt: skip
STAGES = ("config", "weights", "reference", "serving", "activations", "generation", "length", "parallel")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_thread()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, demo_float32: LoadedModel) -> dict[str, Path]:
    """Each architecture saved with the demo tokenizer."""
    out = {}
    for name, (config_cls, model_cls, kwargs) in ARCHS.items():
        path = tmp_path_factory.mktemp(name) / "model"
        build_tiny(config_cls, model_cls, path, **(TINY | kwargs))
        demo_float32.tokenizer.hf.save_pretrained(path)
        out[name] = path
    return out


def _statuses(report_file: Path) -> dict[str, tuple[str, list[str]]]:
    doc = json.loads(report_file.read_text())
    return {s["name"]: (s["status"], s["reasons"]) for s in doc["stages"]}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_stage_passes(arch: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The command as a user runs it; the dense model also runs the parallel stage (TP=2, PP=2 and
    PP=2 x TP=2 gloo ranks), rank 0 with the logits of each, every rank with the bytes it read."""
    report = tmp_path / "report.json"
    argv = ["doctor", "--model", str(tiny_dirs[arch]), "--max-length", "256", "--threads", "1", "--report", str(report)]
    if arch == "llama":  # TP=2, PP=2 and PP=2 x TP=2
        argv += ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    assert main(argv) == 0
    got = _statuses(report)
    for stage in STAGES:
        if stage == "parallel" and arch != "llama":
            assert got[stage][0] == "skip"
            continue
        if stage == "quantization":  # sensitivities are report only: a sensitive group warns
            assert got[stage][0] in ("pass", "warn"), (stage, got[stage][1])
            continue
        assert got[stage][0] == "pass", (stage, got[stage][1])
    stages = {s["name"]: s for s in json.loads(report.read_text())["stages"]}
    if arch == "llama":
        rows = stages["parallel"]["data"]["rows"]
        assert [(r[0], r[1]) for r in rows] == [("TP=2", 0), ("TP=2", 1), ("PP=2", 0), ("PP=2", 1)] + [
            ("PP=2 x TP=2", r) for r in range(4)
        ]
        assert all(isinstance(r[2], float) for r in rows if r[0] == "TP=2" or r[1] == 0), rows
    quant = json.loads(report.read_text())["stages"][-1]["data"]
    for group in ("attention", "MLP"):  # each group alone, and int4 rounds more than int8
        assert 0 < quant[f"{group}/int8"]["logit_error"] < quant[f"{group}/int4-g32"]["logit_error"], quant
    assert quant["LM head/int8"]["logit_error"] > 0 and "LM head/int4-g32" not in quant  # an int4 head stays int8


@pytest.fixture(scope="module")
def llama(tiny_dirs: dict[str, Path]) -> tuple[LoadedModel, Any]:
    lm = load(str(tiny_dirs["llama"]), "float32", progress=False)
    return lm, load_transformers(lm.source, torch.float32)


def _permute_qk(lm: LoadedModel) -> None:
    """Layer 1's q and k rows reordered as a GGUF un-permutation applied to the wrong layout would."""
    attn: Any = lm.model.model.layers[1].self_attn
    q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    w = attn.qkv_proj.weight.data
    w[:q] = unpermute_qk(w[:q].clone(), attn.num_heads)
    w[q : q + kv] = unpermute_qk(w[q : q + kv].clone(), attn.num_kv_heads)


def _transpose_o_proj(lm: LoadedModel) -> None:
    layer: Any = lm.model.model.layers[1]
    w = layer.self_attn.o_proj.weight.data
    assert w.shape[0] == w.shape[1]
    w.copy_(w.t().clone())


def _other_rope_theta(lm: LoadedModel) -> None:
    rope = dataclasses.replace(lm.config.rope, theta=lm.config.rope.theta * 50)
    lm.model.rope = RotaryEmbedding(dataclasses.replace(lm.config, rope=rope))


@pytest.mark.parametrize(
    ("fault", "where"),
    [
        (_permute_qk, "layer 1 attention"),
        (_transpose_o_proj, "layer 1 attention"),
        (_other_rope_theta, "layer 0 attention"),
    ],
)
def test_our_faults_fail_the_reference_stage_by_layer(
    fault: Any, where: str, llama: tuple[LoadedModel, Any], tiny_dirs: dict[str, Path]
) -> None:
    _, hf = llama
    lm = load(str(tiny_dirs["llama"]), "float32", progress=False)  # a copy of our own to damage
    options = DoctorOptions(stages=("reference",), greedy_tokens=0)
    assert run_stages(lm, options, reference_model=hf).stage("reference").status == "pass"
    fault(lm)
    st = run_stages(lm, options, reference_model=hf).stage("reference")
    assert st.status == "fail"
    assert (st.first("fail") or "").startswith(where + ":"), st.reasons


def _edit(path: Path, fn: Any) -> None:
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _swap(t: dict[str, torch.Tensor]) -> None:
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    t[a], t[b] = t[b], t[a]


def _scale(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.1.self_attn.o_proj.weight"] *= 1.5


def test_bad_files_fail_against_a_baseline(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A baseline saved from the intact files; the same files in bf16 pass it; a swap of two
    layers' tensors and a scaled tensor each fail it at the first layer and sub-module they change."""
    baseline = tmp_path / "baseline.json"
    save = DoctorOptions(stages=("reference",), reference="none", save_baseline=baseline)
    assert not run_doctor(str(tiny_dirs["llama"]), save, echo=False).failed
    check = DoctorOptions(stages=("reference",), reference="none", baseline=baseline)
    bf16 = run_doctor(str(tiny_dirs["llama"]), dataclasses.replace(check, dtype="bfloat16"), echo=False)
    assert bf16.stage("reference").status == "pass", bf16.stage("reference").reasons
    for edit, where in ((_swap, "layer 0 MLP"), (_scale, "layer 1 attention")):
        bad = tmp_path / edit.__name__
        shutil.copytree(tiny_dirs["llama"], bad)
        _edit(bad, edit)
        st = run_doctor(str(bad), check, echo=False).stage("reference")
        assert st.status == "fail"
        assert f"{where} diverges first" in (st.first("fail") or ""), st.reasons


def test_nan_fails_and_zeros_warn_in_the_weights_stage(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    nan, zero = tmp_path / "nan", tmp_path / "zero"
    for d in (nan, zero):
        shutil.copytree(tiny_dirs["llama"], d)
    _edit(nan, lambda t: t["model.layers.1.mlp.up_proj.weight"].view(-1).__setitem__(7, float("nan")))
    _edit(zero, lambda t: t["model.layers.0.self_attn.k_proj.weight"].zero_())
    report = tmp_path / "nan.json"
    argv = ["doctor", "--model", str(nan), "--stages", "config,weights", "--report", str(report)]
    assert main(argv) == 1
    status, reasons = _statuses(report)["weights"]
    assert status == "fail" and "'model.layers.1.mlp.up_proj.weight'" in reasons[-1] and "1 NaN" in reasons[-1]
    st = run_doctor(str(zero), DoctorOptions(stages=("weights",)), echo=False).stage("weights")
    assert st.status == "warn" and st.first("warn") == "tensor 'model.layers.0.self_attn.k_proj.weight' is all zeros"


def test_a_nan_weight_fails_the_reference_and_activations_stages(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """One NaN in a weight: NaN against NaN is no agreement, so the reference stage fails naming
    the first layer it reaches; the activations stage reports where non-finite values first
    appear instead of raising on a tensor with no finite value."""
    nan = tmp_path / "nan"
    shutil.copytree(tiny_dirs["llama"], nan)
    _edit(nan, lambda t: t["model.layers.1.mlp.gate_proj.weight"].view(-1).__setitem__(3, float("nan")))
    report = run_doctor(str(nan), DoctorOptions(stages=("reference", "activations"), greedy_tokens=0), echo=False)
    ref, act = report.stage("reference"), report.stage("activations")
    assert ref.status == "fail" and "layer 1 MLP" in (ref.first("fail") or ""), ref.reasons
    assert act.status == "fail" and not any("Error" in r for r in act.reasons), act.reasons
    assert "layer 1 MLP" in (act.first("fail") or ""), act.reasons


def test_serving_stage_names_the_layer_and_bucket_of_a_served_only_fault(llama: tuple[LoadedModel, Any]) -> None:
    """The served configuration (bf16, compiled) with one layer's o_proj scaled after loading: the
    eager float32 model is intact, so only the serving stage can see it, and it names layer 1's
    attention output at the first bucket, with the compiled regions themselves agreeing."""
    lm, _ = llama
    served = load(str(lm.source.path), "bfloat16", progress=False)
    with torch.no_grad():
        layer: Any = served.model.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(1.5)
    options = DoctorOptions(stages=("serving",), serve_dtype="bfloat16", compile=True)
    st = run_stages(lm, options, served=served).stage("serving")
    assert st.status == "fail", st.reasons
    assert (st.first("fail") or "").startswith("bucket 1, layer 1 attention"), st.reasons
    assert "post_attention" in (st.first("fail") or "") or "pre_attention" in (st.first("fail") or ""), st.reasons
    ok = run_stages(lm, options).stage("serving")
    assert ok.status == "pass" and ok.data["path"] == "bfloat16/compiled/none/native/kernel", ok.reasons
    assert ok.data["buckets"] == [1, 4, 16] and ok.data["agreement"]["decided"] >= 0.95, ok.data["agreement"]


def test_a_base_model_runs_the_generation_stage(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint without a chat template: the generation stage renders with the built-in ChatML
    (as `serve` does, with its warning) and says so, instead of failing in the template."""
    base = tmp_path / "base"
    shutil.copytree(tiny_dirs["llama"], base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    st = run_doctor(str(base), DoctorOptions(stages=("generation",)), echo=False).stage("generation")
    assert st.status == "warn" and st.first("warn") == "the tokenizer has no chat template; prompts are raw text"
    assert any("built-in ChatML" in r for r in st.reasons), st.reasons


def test_one_layer_far_off_its_siblings_warns() -> None:
    def stats(layer: int, std: float) -> TensorStats:
        return TensorStats(f"model.layers.{layer}.self_attn.q_proj.weight", (4, 4), "float32", "f", 64, 0, std, 1, 0, 0)

    out = _sibling_outliers([stats(0, 0.02), stats(1, 0.021), stats(2, 3.0), stats(3, 0.019)])
    assert [(s.name, round(r)) for s, r in out] == [("model.layers.2.self_attn.q_proj.weight", 143)]


def test_demo_model(demo_float32: LoadedModel, demo_gguf: Path) -> None:
    """The demo model against transformers' own GGUF loading, through the serving path, and at length."""
    hf = transformers_demo(demo_gguf)  # transformers' own load of the GGUF, kept (`tests/hf_demo.py`)
    options = DoctorOptions(stages=("reference", "activations", "generation", "length"), max_length=256)
    report = run_stages(demo_float32, options, reference_model=hf)
    for st in report.stages:
        assert st.status == "pass", (st.name, st.reasons)
    assert "Paris" in report.stage("generation").data["answer"]
    assert report.stage("reference").data["greedy"]["ours"] == report.stage("reference").data["greedy"]["transformers"]
