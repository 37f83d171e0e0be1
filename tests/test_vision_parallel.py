"""Tensor and expert parallelism on the MoE vision-language model (Qwen3-VL-MoE: M-RoPE,
DeepStack), 2 CPU ranks over gloo, against the single-process engine: the logits of an image
prompt prefilled in chunks that split its images, and greedy tokens of requests with and
without images through the engine (rank 0 encodes; the features travel in the step plans)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests import parallel_ranks, vision_ranks
from tests.rank_forks import run_ranks
from tests.tiny_models import rel_error
from tests.vision_models import build_tiny_vlm, run_chunks

pytestmark = pytest.mark.slow


def test_moe_vlm_tensor_and_expert_parallel_match_single_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    t = build_tiny_vlm("qwen3_vl", tmp_path / "model")
    (tmp_path / "out").mkdir()
    env = {"LONGCTX_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [str(t.path), str(tmp_path / "out"), "--modes", "tp,ep"]
    run_ranks("tests.vision_ranks", argv, [tmp_path / f"rank{r}.log" for r in range(2)], env, timeout_s=300)

    requests = vision_ranks.inputs(t.path)
    runner = parallel_ranks.sharded_runner(t.model)
    from kvstore.block_pool import BlockPool

    ids, images = requests[0]
    single = run_chunks(t, runner, BlockPool(runner.kv_cache.num_pages), ids, images, 7)
    engine = Engine(t.model, None, parallel_ranks.engine_config())
    params = SamplingParams(max_tokens=vision_ranks.GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    handles = [engine.add_request(i, params, images=im) for i, im in requests]
    engine.run_until_idle()
    greedy = [[tok for out in h for tok in out.token_ids] for h in handles]
    for mode in ("tp", "ep"):
        results = [torch.load(tmp_path / "out" / f"rank{r}-{mode}.pt") for r in range(2)]
        for r, res in enumerate(results):
            err = rel_error(res["logits"], single)
            assert err < 1e-5, f"{mode} rank {r}: error {err:.2e}"
            assert res["comm"] > 0
        assert results[0]["greedy"] == greedy, mode
        assert results[1]["steps"] > 0
