"""Tensor and expert parallelism on 2 CPU ranks (gloo) against the single-process engine.

Each case launches two real processes (`tests/parallel_ranks.py`) the way torchrun would, and
compares with the same checkpoint run in this process: the logits of a mixed prefill/decode
step, greedy tokens through the engine (rank 0 schedules, rank 1 replays its plans), and the
bytes each rank read from the checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from engine.distributed.parallel import ParallelContext, split_range
from engine.engine import Engine
from engine.loading.safetensors_file import read_header, read_tensor, read_tensor_part
from engine.model.tp import SourceSlice, split_heads
from kvstore.block_pool import BlockPool
from tests import parallel_ranks as ranks
from tests.rank_forks import run_ranks
from tests.server import ROOT
from tests.tiny_models import TinyModel, build_tiny, rel_error, run_mixed_step, tiny_moe_with_demo_tokenizer

pytestmark = pytest.mark.slow
QWEN2_MOE: dict[str, Any] = {
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": False,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
}
# Modes: tp = tensor parallel everywhere; ep = attention tensor parallel, whole experts per rank.
CASES: dict[str, tuple[type, type, dict[str, Any], tuple[str, ...]]] = {
    # One KV head for two ranks (replicated), q/k/v biases, tied embeddings, an odd vocabulary.
    "qwen2-kv1-tied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"num_key_value_heads": 1, "vocab_size": 161, "tie_word_embeddings": True},
        ("tp",),
    ),
    # Also a dense middle layer, a shared expert, and two KV heads split over the ranks.
    "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, QWEN2_MOE, ("tp", "ep")),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 8, "num_experts_per_tok": 2}, ("ep",)),
}
THRESHOLD = 1e-5


def launch_ranks(
    model: Path, out: Path, modes: tuple[str, ...], world_size: int = 2
) -> dict[str, list[dict[str, Any]]]:
    """The ranks as separate processes with torchrun's environment (forked from a process that has
    imported torch: `tests/rank_forks.py`); their results per mode."""
    env = {"LONGCTX_THREADS": "1", "OMP_NUM_THREADS": "1"}
    argv = ["logits", str(model), str(out), "--modes", ",".join(modes)]
    logs = [out / f"rank{r}.log" for r in range(world_size)]  # files, not pipes: a full pipe would block a rank
    run_ranks("tests.parallel_ranks", argv, logs, env, timeout_s=600)  # both ranks compiling cold passed 120 s
    return {m: [torch.load(out / f"rank{r}-{m}.pt") for r in range(world_size)] for m in modes}


def single_process_results(t: TinyModel) -> tuple[list[torch.Tensor], list[list[int]]]:
    runner = ranks.sharded_runner(t.model)
    mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), ranks.prompts(t.config.vocab_size), 20)
    engine = Engine(t.model, None, ranks.engine_config())
    return mixed, ranks.greedy_with_engine(engine, t.config.vocab_size)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, Any]:
    config_cls, model_cls, kwargs, modes = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    torch.set_num_threads(1)
    t = build_tiny(config_cls, model_cls, tmp / "model", **kwargs)
    (tmp / "out").mkdir()
    return t, launch_ranks(t.path, tmp / "out", modes)


def test_logits_and_greedy_tokens_match_single_process(case: tuple[TinyModel, Any]) -> None:
    t, by_mode = case
    mixed, greedy = single_process_results(t)
    assert all(len(g) == ranks.GREEDY_TOKENS for g in greedy)
    for mode, results in by_mode.items():
        for r, res in enumerate(results):
            for ours, ref in zip(res["mixed"], mixed, strict=True):
                err = rel_error(ours, ref)
                assert err < THRESHOLD, f"{mode} rank {r}: error {err:.2e}"
            assert res["comm"] > 0  # the step really communicated
        assert results[0]["greedy"] == greedy, mode
        assert results[1]["steps"] > 0  # rank 1 replayed rank 0's plans


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_quantized_sharded_matches_single_process_quantized(tmp_path: Path, layout: str) -> None:
    """Column-parallel linears quantize row by row as the whole model does; row-parallel int8
    scales come from the whole rows (the ranks exchange their row maxima); int4 groups never
    straddle the split. So the sharded quantized model computes what the single one does; two
    pipeline stages (each quantizing its own layers' whole tensors) too. int8 and int4 in one
    launch of the ranks."""
    from engine.loading.weights import SafetensorsSource, load_model
    from engine.model.quant import QuantConfig

    torch.set_num_threads(1)
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "model", intermediate_size=128, tie_word_embeddings=True)
    (tmp_path / "out").mkdir()
    quants = ("int8", "int4")
    launched = launch_ranks(t.path, tmp_path / "out", tuple(f"{layout}-{q}" for q in quants))
    for quant in quants:
        model, _ = load_model(
            t.config, SafetensorsSource(t.path), torch.float32, progress=False, quantization=QuantConfig(quant)
        )
        runner = ranks.sharded_runner(model)
        mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), ranks.prompts(t.config.vocab_size), 20)
        results = launched[f"{layout}-{quant}"]
        with_logits = results if layout == "tp" else results[:1]  # pipeline logits reach rank 0 only
        for r, res in enumerate(with_logits):
            for ours, ref in zip(res["mixed"], mixed, strict=True):
                assert rel_error(ours, ref) < 1e-4, f"{layout} {quant} rank {r}: {rel_error(ours, ref):.2e}"


@pytest.mark.parametrize("mode", ["compiled", "ppcompiled"], ids=["tp2", "pp2"])
def test_compiled_step_on_sharded_ranks_matches_single_process(tmp_path: Path, mode: str) -> None:
    """The compiled step on 2 ranks, tensor parallel (the all-reduces eager between the graphs)
    or two pipeline stages (each its own layers; the second starts from hidden states): its
    self-check passes on every rank, and the mixed step's float32 logits match one eager process
    (pipeline logits reach rank 0 only)."""
    from engine.model.compile_setup import compile_available

    if compile_available() is not None:
        pytest.skip(str(compile_available()))
    torch.set_num_threads(1)
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "model")
    (tmp_path / "out").mkdir()
    results = launch_ranks(t.path, tmp_path / "out", (mode,))[mode]
    runner = ranks.sharded_runner(t.model)
    mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), ranks.prompts(t.config.vocab_size), 20)
    for r, res in enumerate(results):
        assert all(err < THRESHOLD for err in res["checks"]), (r, res["checks"])
        assert res["buckets"], r  # steps really ran compiled
        if mode == "ppcompiled" and r > 0:
            assert res["mixed"] == [], r
            # the second stage checked its bucket on what the first stage computed from the check's token ids
            assert rel_error(res["check_input"], _first_stage_output(t, 8)) < THRESHOLD
            continue
        assert res["check_input"] is None
        for ours, ref in zip(res["mixed"], mixed, strict=True):
            assert rel_error(ours, ref) < THRESHOLD, f"rank {r}"


def _first_stage_output(t: TinyModel, bucket: int) -> torch.Tensor:
    """The hidden states the first of two stages computes, eager, from the self-check's token ids."""
    from engine.loading.weights import SafetensorsSource, load_model
    from engine.model.compiled import CompiledStep
    from engine.verify.self_check import step_inputs

    first, _ = load_model(
        t.config, SafetensorsSource(t.path), torch.float32, progress=False, parallel=ParallelContext(pp_size=2)
    )
    with torch.inference_mode():
        return first(*step_inputs(CompiledStep(first), bucket, ranks.PAGE_SIZE))


def _replicated(name: str, shape: tuple[int, ...], num_kv_heads: int) -> bool:
    """Checkpoint tensors every rank reads whole: norms, routers, the shared expert's gate."""
    if len(shape) == 1 and "norm" in name:
        return True
    if name.endswith((".gate.weight", "shared_expert_gate.weight")):
        return True
    return num_kv_heads < 2 and any(p in name for p in ("k_proj", "v_proj"))


def test_each_rank_reads_its_share_of_the_checkpoint(case: tuple[TinyModel, Any]) -> None:
    """From the loader's own counter: each rank reads exactly its parameters' bytes, i.e. 1/N of
    every split tensor plus the replicated ones whole."""
    t, by_mode = case
    entries = [e for f in sorted(t.path.glob("*.safetensors")) for e in read_header(f)]
    total = sum(e.nbytes for e in entries)
    replicated = sum(e.nbytes for e in entries if _replicated(e.name, e.shape, t.config.num_kv_heads))
    split = total - replicated
    for mode, results in by_mode.items():
        read = [res["bytes_read"] for res in results]
        assert read == [res["param_bytes"] for res in results], mode
        assert sum(read) == total + replicated, mode
        for r, n in enumerate(read):
            assert abs(n - replicated - split / 2) <= 0.02 * split, f"{mode} rank {r} read {n} of {total} bytes"


@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_rank_death_fails_rank_zero_naming_it(tmp_path: Path, stages: int) -> None:
    """SIGKILL of rank 1 mid-generation (a tensor-parallel peer, or the second pipeline stage):
    rank 0 (which spawned it) exits non-zero within 60 s, naming rank 1."""
    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path / "model")
    log = tmp_path / "rank0.log"
    env = os.environ | {"LONGCTX_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with open(log, "wb") as err:
        rank0 = subprocess.Popen(
            [sys.executable, "-m", "tests.parallel_ranks", "serve", str(t.path), "--stages", str(stages)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        try:
            assert rank0.stdout is not None
            assert rank0.stdout.readline().strip() == b"generating"
            spawned = re.search(rb"spawned rank 1 \(pid (\d+)\)", log.read_bytes())
            assert spawned is not None
            pid = int(spawned.group(1))
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            rc = rank0.wait(timeout=60)
            elapsed = time.monotonic() - t0
        finally:
            rank0.kill()
    text = log.read_text()
    assert rc != 0 and elapsed < 60
    assert "rank 1 failed" in text and "SIGKILL" in text, text[-2000:]


def test_split_helpers() -> None:
    assert [split_range(161, 2, r) for r in range(2)] == [(0, 81), (81, 80)]
    ctx = ParallelContext(1, 4)
    assert split_heads(8, 2, ctx) == (2, 2, 0, 1)  # 2 query heads per rank, KV head 0 replicated
    assert split_heads(8, 8, ctx) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="not divisible"):
        split_heads(6, 2, ctx)


def test_read_tensor_part_reads_only_the_part(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    x = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    save_file({"x": x}, tmp_path / "a.safetensors")
    (entry,) = read_header(tmp_path / "a.safetensors")
    assert torch.equal(read_tensor(entry), x)
    for part in (SourceSlice(0, ((1, 2),)), SourceSlice(1, ((0, 2), (3, 2))), SourceSlice(2, ((4, 1),))):
        got, nbytes = read_tensor_part(entry, part.dim, part.ranges)
        assert torch.equal(got, part.take(x)) and nbytes == got.numel() * 4


def test_cli_spawns_ranks_with_expert_parallelism(tmp_path: Path, demo_float32: Any) -> None:
    """`longctx generate --tensor-parallel-size 2 --expert-parallel` spawns rank 1 itself and prints
    transformers' greedy text for a tiny Qwen3-MoE with the demo tokenizer."""
    prompt = "The quick brown fox"
    expected = tiny_moe_with_demo_tokenizer(tmp_path, demo_float32.tokenizer, prompt, 12)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "api.cli", "generate", "--model", str(tmp_path), "--prompt", prompt]
    cmd += ["--max-tokens", "12", "--dtype", "float32", "--tensor-parallel-size", "2", "--expert-parallel"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env | {"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    assert "spawned rank 1" in out.stderr and "rank 1 of 2 ready" in out.stderr


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fused_expert_layout_shards_identically(tmp_path: Path, expert_parallel: bool) -> None:
    """transformers 5's fused expert tensors give each rank the same parameters as per-expert
    tensors (loading needs no process group), and those are the right slices of the whole."""
    from engine.loading.weights import SafetensorsSource, load_model
    from tests.test_moe import fuse_checkpoint

    t = build_tiny(Qwen2MoeConfig, Qwen2MoeForCausalLM, tmp_path / "a", **QWEN2_MOE)
    fuse_checkpoint(t.path, tmp_path / "b")
    whole: Any = t.model.model.layers[0].mlp
    I = QWEN2_MOE["moe_intermediate_size"] // 2
    for rank in range(2):
        ctx = ParallelContext(rank, 2, expert_parallel)
        a, _ = load_model(t.config, SafetensorsSource(t.path), torch.float32, progress=False, parallel=ctx)
        b, _ = load_model(t.config, SafetensorsSource(tmp_path / "b"), torch.float32, progress=False, parallel=ctx)
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert n1 == n2 and torch.equal(p1, p2), n1
        mine: Any = a.model.layers[0].mlp
        if expert_parallel:  # experts 3r .. 3r + 2, whole
            assert torch.equal(mine.w13, whole.w13[3 * rank : 3 * rank + 3])
            assert torch.equal(mine.w2, whole.w2[3 * rank : 3 * rank + 3])
        else:  # columns [I r, I (r + 1)) of every expert's gate and up, and the same rows of down
            cols = slice(I * rank, I * (rank + 1))
            up = slice(2 * I + I * rank, 2 * I + I * (rank + 1))
            assert torch.equal(mine.w13, torch.cat((whole.w13[:, cols], whole.w13[:, up]), dim=1))
            assert torch.equal(mine.w2, whole.w2[:, :, cols])
