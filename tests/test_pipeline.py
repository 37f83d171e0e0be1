"""Pipeline parallelism (alone, and with tensor and expert parallelism) against one process.

Each case launches real ranks (`tests/parallel_ranks.py`, torchrun's environment, gloo) and
compares with the same checkpoint in this process: the float32 logits of a mixed prefill/decode
step split into micro-batches, greedy tokens through the engine with chunked prefill,
preemption and the prefix cache all in play, and the bytes each rank read from the checkpoint.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from engine.distributed.parallel import ParallelContext, parse_layer_split
from engine.distributed.pipeline import micro_batches
from engine.engine import Engine
from engine.loading.safetensors_file import read_header
from kvstore.block_pool import BlockPool
from tests import parallel_ranks as ranks
from tests.test_parallel import ROOT, launch_ranks
from tests.tiny_models import TinyModel, build_tiny, rel_error, run_mixed_step, tiny_moe_with_demo_tokenizer

THRESHOLD = 1e-5
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4}
# (config, model class, kwargs, the modes launched together, ranks): 4 ranks only once.
CASES: dict[str, tuple[type, type, dict[str, Any], tuple[str, ...], int]] = {
    # Tied embeddings: stage 0 embeds, stage 1's LM head is the same tensor (each reads it).
    "llama-tied-pp": (LlamaConfig, LlamaForCausalLM, {"num_hidden_layers": 4, "tie_word_embeddings": True}, ("pp",), 2),
    "mixtral-pp": (MixtralConfig, MixtralForCausalLM, MIXTRAL, ("pp",), 2),
    "mixtral-pp-tp-ep": (MixtralConfig, MixtralForCausalLM, MIXTRAL, ("pptp", "ppep"), 4),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, Any]:
    config_cls, model_cls, kwargs, modes, world = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    torch.set_num_threads(1)
    t = build_tiny(config_cls, model_cls, tmp / "model", **kwargs)
    (tmp / "out").mkdir()
    return t, launch_ranks(t.path, tmp / "out", modes, world)


@pytest.mark.slow
def test_pipeline_matches_single_process(case: tuple[TinyModel, Any]) -> None:
    """Rank 0's logits of the mixed step (two micro-batches) within 1e-5 of one process; the
    greedy tokens equal, both times (the second from the prefix cache), with preemptions."""
    t, by_mode = case
    runner = ranks.sharded_runner(t.model)
    mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), ranks.prompts(t.config.vocab_size), 20)
    ref = ranks.greedy_in_play(Engine(t.model, None, ranks.in_play_config(t.model)), t.config.vocab_size)
    assert ref["preemptions"] and ref["cached"]  # what the case claims to exercise happened here
    for mode, results in by_mode.items():
        rank0 = results[0]
        for ours, want in zip(rank0["mixed"], mixed, strict=True):
            assert rel_error(ours, want) < THRESHOLD, mode
        assert all(r["mixed"] == [] for r in results[1:]), mode  # logits reach rank 0 only
        got = rank0["in_play"]
        assert got["tokens"] == ref["tokens"] and got["again"] == ref["again"], mode
        assert got["preemptions"] > 0 and got["cached"] > 0, (mode, got)
        assert all(r["steps"] > 0 for r in results[1:]), mode  # every other rank ran rank 0's plans


def _stage_of(name: str, layers: int, stages: int) -> set[int]:
    """The stages that hold a checkpoint tensor (even split): its layer's, or embedding/head."""
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return {s for s in range(stages) if i in ParallelContext(pp_rank=s, pp_size=stages).stage_layers(layers)}
    if name.startswith("model.embed_tokens."):
        return {0}
    return {stages - 1}  # final norm, LM head


@pytest.mark.slow
def test_each_stage_reads_only_its_tensors(case: tuple[TinyModel, Any]) -> None:
    """From the loader's counter: a stage reads its layers, stage 0 the embedding, the last the
    final norm and head (tied: the embedding again); with 4 layers on 2 stages, about half each."""
    t, by_mode = case
    entries = [e for f in sorted(t.path.glob("*.safetensors")) for e in read_header(f)]
    tied = t.config.tie_word_embeddings
    for mode, results in by_mode.items():
        tp = len(results) // 2
        read = [r["bytes_read"] for r in results]
        assert read == [r["param_bytes"] for r in results], mode
        for stage in range(2):
            want = sum(
                e.nbytes
                for e in entries
                if stage in _stage_of(e.name, t.config.num_layers, 2)
                or (tied and stage == 1 and e.name.startswith("model.embed_tokens."))
            )
            got = sum(read[stage * tp : (stage + 1) * tp])
            if tp == 1:
                assert got == want, (mode, stage, got, want)
            else:  # tensor parallel inside the stage: the ranks' shares cover it, norms/router twice
                assert want <= got <= 1.1 * want, (mode, stage, got, want)
        total = sum(e.nbytes for e in entries)
        assert max(read) < 0.65 * total * (1 if tp == 1 else 0.6), (mode, read, total)


def test_micro_batches_split_by_tokens() -> None:
    assert micro_batches([25, 1, 1], 2, 2) == [0, 1, 3]  # the prefill chunk, then the decodes
    assert micro_batches([20, 6, 22], 2, 2) == [0, 2, 3]
    assert micro_batches([1, 1, 1, 1], 2, 2) == [0, 2, 4]
    b = micro_batches([1] * 6, 4, 4)
    assert b[0] == 0 and b[-1] == 6 and len(b) == 5 and all(x < y for x, y in itertools.pairwise(b))
    assert micro_batches([1], 2, 2) == [0, 1]  # fewer chunks than stages: unsplit
    assert micro_batches([9, 9, 9], 4, 4) == [0, 3]
    assert micro_batches([9, 9, 9], 2, 1) == [0, 3]  # micro-batching off
    assert micro_batches([100, 1, 1], 3, 3) == [0, 1, 2, 3]  # every group gets a chunk


def test_stage_layers_even_and_chosen() -> None:
    even = [ParallelContext(pp_rank=s, pp_size=3).stage_layers(32) for s in range(3)]
    assert even == [range(0, 11), range(11, 22), range(22, 32)]
    split = parse_layer_split("10,10,12")
    chosen = [ParallelContext(pp_rank=s, pp_size=3, layer_split=split).stage_layers(32) for s in range(3)]
    assert chosen == [range(0, 10), range(10, 20), range(20, 32)]
    with pytest.raises(ValueError, match="sums to 32, the model has 30"):
        ParallelContext(pp_rank=0, pp_size=3, layer_split=split).stage_layers(30)
    with pytest.raises(ValueError, match="3 stages, --pipeline-parallel-size 2"):
        ParallelContext(pp_rank=0, pp_size=2, layer_split=split)
    with pytest.raises(ValueError, match="at least one layer"):
        parse_layer_split("4,0")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layer_split("4;4")


@pytest.mark.slow
def test_cli_generate_with_pipeline_stages(tmp_path: Path, demo_float32: Any) -> None:
    """`longctx generate --pipeline-parallel-size 2 --pipeline-layer-split 1,1` spawns stage 1
    itself and prints transformers' greedy text for a tiny Qwen3-MoE with the demo tokenizer;
    each rank logs what it read."""
    prompt = "The quick brown fox"
    expected = tiny_moe_with_demo_tokenizer(tmp_path, demo_float32.tokenizer, prompt, 12)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "api.cli", "generate", "--model", str(tmp_path), "--prompt", prompt]
    cmd += ["--max-tokens", "12", "--dtype", "float32", "--pipeline-parallel-size", "2"]
    cmd += ["--pipeline-layer-split", "1,1", "--max-num-batched-tokens", "3"]  # chunked prefill too
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env | {"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    assert "spawned rank 1" in out.stderr and "rank 1 of 2 ready" in out.stderr
    for r in range(2):  # each rank's bytes read, in its own log line
        assert re.search(rf"rank {r} \(stage {r} of 2\): .* loaded \d+ tensors, [\d.]+ MB", out.stderr), out.stderr


def test_namespace_names_the_stage_and_keeps_single_stage_keys() -> None:
    """Each stage's pages live under a namespace of its own; on one stage the digest is the one
    computed before stages existed (stored pages stay usable)."""
    import hashlib

    import msgspec

    from kvstore.prefix import Namespace

    base = Namespace("LlamaForCausalLM", "w", "float32", "float32", 16, numerics="n")
    old = {k: v for k, v in base.__dict__.items() if k not in ("pp_size", "pp_rank")}
    assert base.digest == hashlib.blake2b(msgspec.msgpack.encode(old), digest_size=16).digest()
    stages = {Namespace("LlamaForCausalLM", "w", "float32", "float32", 16, pp_size=2, pp_rank=r).key for r in (0, 1)}
    assert len(stages | {base.key}) == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pipeline-parallel-size", "2", "--pipeline-layer-split", "1,1,1"], "has 3 stages"),
        (["--pipeline-layer-split", "1,1"], "needs --pipeline-parallel-size of 2 or more"),
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size must be >= 1"),
    ],
)
def test_generate_refuses_a_bad_pipeline_layout(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any rank is spawned or any weight read: exit status 2, the flag named."""
    from api.cli import main

    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", *flags]) == 2
    assert message in capsys.readouterr().err
