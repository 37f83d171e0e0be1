"""What each rank runs in tests/test_parallel.py (`python -m tests.parallel_ranks MODE ...`).

Kept apart from the test module so that a rank imports neither pytest nor transformers.

    logits MODEL OUT [--modes tp,ep]: RANK/WORLD_SIZE/MASTER_* set by the caller (as torchrun does);
        a mixed prefill/decode step through a sharded runner on every rank, then greedy
        requests through the engine on rank 0 with the other ranks replaying its plans.
        Each rank saves its results per mode to OUT/rank{r}-{mode}.pt. A mode may name a
        weight quantization after a dash (`tp-int8`, `tp-int4`: int4 with group 32). Mode
        `compiled`: tensor parallel through the compiled step (graphs cached under OUT), its
        self-check of bucket 8 on every rank, then the mixed step (no engine run);
        `ppcompiled`: the same on two pipeline stages.
    serve MODEL [--stages 2]: rank 0 spawns rank 1 itself (its tensor-parallel peer, or the
        second pipeline stage) and generates until killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import torch

from engine.distributed.launch import init_parallel, leave_together
from engine.distributed.parallel import ParallelContext
from engine.distributed_runner import DistributedRunner, serve_worker
from engine.engine import Engine, EngineConfig
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from engine.model.quant import NONE, QuantConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.block_pool import BlockPool
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

PROMPT_LENGTHS = (7, 23, 45)
MIXED_SPLIT = 20
PAGE_SIZE = 4
GREEDY_TOKENS = 24
IN_PLAY_PAGES = 30
# Pipeline-parallel modes: (tensor-parallel size, stages); every other mode is 2 tensor-parallel ranks.
LAYOUTS = {"pp": (1, 2), "pptp": (2, 2), "ppep": (2, 2), "ppcompiled": (1, 2)}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    p = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return [p[2], p[0], p[1]]  # the long one prefills a chunk while two decode


def sharded_runner(model: CausalLM, num_pages: int = 256) -> ModelRunner:
    from engine.attention.torch_paged import TorchPagedBackend

    c = model.config
    spec = KVSpec(len(model.stage_layers), model.local_kv_heads, c.head_dim, PAGE_SIZE, "float32")
    return ModelRunner(
        model, KVCache(spec, num_pages), TorchPagedBackend(model.local_heads, model.local_kv_heads, c.head_dim)
    )


def engine_config() -> EngineConfig:
    return EngineConfig(kv_cache_bytes=4 << 20, page_size=PAGE_SIZE, enable_prefix_caching=False)


def in_play_config(model: CausalLM) -> EngineConfig:
    """Chunked prefill (16-token steps), the prefix cache, and KV for `IN_PLAY_PAGES` pages on
    every stage (too few for the greedy requests at once: some are preempted)."""
    c, p = model.config, model.parallel
    most = max(len(p.stage_layers(c.num_layers, s)) for s in range(p.pp_size))
    page = KVSpec(most, model.local_kv_heads, c.head_dim, PAGE_SIZE, "float32").bytes_per_page
    return EngineConfig(kv_cache_bytes=IN_PLAY_PAGES * page, page_size=PAGE_SIZE, max_num_batched_tokens=16)


def greedy_in_play(engine: Engine, vocab: int) -> dict[str, object]:
    """The greedy requests twice (the second time from the prefix cache) under `in_play_config`:
    their tokens, and how many preemptions, cached prompt tokens and chunked prefills there were."""
    tokens = greedy_with_engine(engine, vocab)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    handles = [engine.add_request(p, params) for p in prompts(vocab)]
    engine.run_until_idle()
    outs = [list(h) for h in handles]
    again = [[t for out in o for t in out.token_ids] for o in outs]
    cached = sum(o[-1].cached_tokens for o in outs)
    return {"tokens": tokens, "again": again, "preemptions": engine.stats.preemptions, "cached": cached}


def local_runner(model: CausalLM) -> ModelRunner:
    """This rank's runner, sized as `engine_config()` says."""
    c = engine_config()
    return ModelRunner.for_model(model, c.page_size, c.kv_cache_bytes, c.attention_backend)


def greedy_with_engine(engine: Engine, vocab: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    handles = [engine.add_request(p, params) for p in prompts(vocab)]
    engine.run_until_idle()
    return [[t for out in h for t in out.token_ids] for h in handles]


def run_logits(model_dir: Path, out: Path, modes: list[str]) -> None:
    layouts = {LAYOUTS.get(m.partition("-")[0], (2, 1)) for m in modes}
    assert len(layouts) == 1, f"modes of one launch share a layout: {modes}"
    tp, pp = layouts.pop()
    base, watchdog = init_parallel(tp, pipeline_size=pp)
    if any(m.endswith("compiled") for m in modes):
        from tests.compile_cache import configure_compile

        configure_compile(out / f"compile-{base.rank}" / "graphs")  # the graphs per rank, inductor's cache shared
    for mode in modes:  # one process group, the model built again per mode
        kind, _, quant = mode.partition("-")
        ctx = dataclasses.replace(base, expert_parallel=kind in ("ep", "ppep"))
        result = (
            run_compiled(ctx, model_dir)
            if kind in ("compiled", "ppcompiled")
            else run_mode(ctx, model_dir, QuantConfig(quant or "none"))
        )
        torch.save(result, out / f"rank{ctx.global_rank}-{mode}.pt")
    leave_together(watchdog)


def run_mode(ctx: ParallelContext, model_dir: Path, quant: QuantConfig = NONE) -> dict[str, object]:
    from tests.tiny_models import run_mixed_step

    config = ModelConfig.from_pretrained_dir(model_dir)
    src = SafetensorsSource(model_dir)
    model, stats = load_model(config, src, torch.float32, progress=False, parallel=ctx, quantization=quant)
    runner = sharded_runner(model)
    ctx.comm.reset()
    mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), prompts(config.vocab_size), MIXED_SPLIT)
    comm = ctx.comm.total
    result: dict[str, object] = {"mixed": mixed, "bytes_read": stats.bytes_read, "comm": comm}
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = in_play_config(model) if ctx.pipelined else engine_config()
    if ctx.is_driver:
        local = ModelRunner.for_model(model, cfg.page_size, cfg.kv_cache_bytes, cfg.attention_backend)
        dist_runner = DistributedRunner(local, ctx)
        engine = Engine(model, None, cfg, parallel=ctx, runner=dist_runner)
        if ctx.pipelined:
            result["in_play"] = greedy_in_play(engine, config.vocab_size)
        else:
            result["greedy"] = greedy_with_engine(engine, config.vocab_size)
        dist_runner.shutdown()
    else:
        result["steps"] = serve_worker(model, ctx)
    return result


def run_compiled(ctx: ParallelContext, model_dir: Path) -> dict[str, object]:
    """The compiled step on this rank's shard: its self-check (every rank in step: the checks'
    eager and compiled runs both communicate; a later stage on the hidden states the stage before
    it sent), then the mixed step through it."""
    from engine.distributed_runner import stage_check_inputs
    from engine.model.compiled import CompiledStep
    from engine.verify.self_check import check_bucket
    from tests.tiny_models import run_mixed_step

    config = ModelConfig.from_pretrained_dir(model_dir)
    model, _ = load_model(config, SafetensorsSource(model_dir), torch.float32, progress=False, parallel=ctx)
    runner = sharded_runner(model)
    step = CompiledStep(model)
    runner.step = step
    hidden = stage_check_inputs(step, PAGE_SIZE, (8,), ctx)
    checks = [check_bucket(step, 8, PAGE_SIZE, hidden.get(8))]  # a bucket the mixed step uses too: compiled once
    mixed = run_mixed_step(runner, BlockPool(runner.kv_cache.num_pages), prompts(config.vocab_size), MIXED_SPLIT)
    return {"mixed": mixed, "checks": [c.error for c in checks], "buckets": sorted(step.compiled_buckets),
            "check_input": hidden.get(8)}  # fmt: skip


def run_serve(model_dir: Path, stages: int) -> None:
    tp = 2 // stages  # two ranks: tensor parallel, or two pipeline stages
    ctx, watchdog = init_parallel(tp, dead_after_s=10.0, pipeline_size=stages)
    config = ModelConfig.from_pretrained_dir(model_dir)
    model, _ = load_model(config, SafetensorsSource(model_dir), torch.float32, progress=False, parallel=ctx)
    if not ctx.is_driver:
        serve_worker(model, ctx, watchdog)
        return
    engine = Engine(
        model, None, engine_config(), parallel=ctx, runner=DistributedRunner(local_runner(model), ctx, watchdog)
    )
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    announced = False
    while True:  # until rank 1 dies
        engine.add_request(prompts(config.vocab_size)[0], params)
        while engine.has_unfinished():
            engine.step()
            if not announced:
                print("generating", flush=True)
                announced = True


def main(argv: list[str]) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["logits", "serve"])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--modes", default="tp", help="comma-separated: tp (tensor parallel), ep (experts too)")
    p.add_argument("--stages", type=int, default=1, help="serve: pipeline stages (1 or 2)")
    args = p.parse_args(argv)
    if args.mode == "logits":
        run_logits(args.model, args.out, args.modes.split(","))
    else:
        run_serve(args.model, args.stages)


if __name__ == "__main__":
    main(sys.argv[1:])
