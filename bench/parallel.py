"""Step time and bytes communicated per step: TP=1, TP=2, TP=2 + expert parallel, PP=2 (with and
without micro-batches) and PP=2 x TP=2, on CPU; TP=1, TP=2, PP=2 (unsplit) and PP=2 x TP=2 also
through the compiled step.

A random Qwen3-MoE checkpoint (float32) is written once; each configuration then runs in its
own processes (rank 0 spawns the others, as `longctx generate --tensor-parallel-size` does),
with the machine's cores split evenly between ranks. Measured on rank 0: one prefill step
(B prompts of P tokens) and the mean of S decode steps of B tokens (after a warm-up step), and the bytes this rank
put into collectives per step (all-reduce, all-gather, all-to-all payloads, point-to-point
sends and the plan broadcast). Under pipeline parallelism also rank 0's bubble: the share of
each phase's time its stage spent outside its layers (waiting for the other stage). Compiled
rows: the decode steps (B tokens, or a micro-batch's share: compiled buckets; the prefill is past
the largest and runs eager) through the compiled step, the buckets up to B's compiled and
self-checked first on every rank as `serve` does (graphs under a fresh `LONGCTX_HOME` per run:
a cold compile, timed); every row's greedy decode tokens are compared with TP=1's.
Prints a table and writes JSON to bench/results/parallel.json.

    python bench/parallel.py [--quick] [--dense] [--configs tp1-1thread,tp2,tp2-comp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
MODEL: dict[str, Any] = dict(
    hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192, num_experts=8,
    num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=4096,
)  # fmt: skip
# name: (tensor-parallel ranks, expert parallel, threads per rank (0 = the machine's cores split
# evenly), pipeline stages, most micro-batches per step (0 = as many as stages), compiled step)
CONFIGS: dict[str, tuple[int, bool, int, int, int, bool]] = {
    "tp1": (1, False, 0, 1, 0, False),
    "tp1-1thread": (1, False, 1, 1, 0, False),
    "tp1-1t-comp": (1, False, 1, 1, 0, True),
    "tp2": (2, False, 0, 1, 0, False),
    "tp2-comp": (2, False, 0, 1, 0, True),
    "tp2+ep": (2, True, 0, 1, 0, False),
    "pp2": (1, False, 0, 2, 0, False),
    "pp2-unsplit": (1, False, 0, 2, 1, False),
    "pp2-uns-comp": (1, False, 0, 2, 1, True),
    "pp2xtp2": (2, False, 0, 2, 0, False),
    "pp2xtp2-comp": (2, False, 0, 2, 0, True),
}


def write_checkpoint(path: Path, dense: bool = False) -> None:
    """The random Qwen3-MoE, or (`dense`) a Qwen3 of the same attention with a dense MLP of
    `intermediate_size` (what the compiled step's regions cover whole: an MoE layer's experts stay eager)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if dense:
        moe_only = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step")
        Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in MODEL.items() if k not in moe_only})).save_pretrained(path)
    else:
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).save_pretrained(path)


def run_rank(
    model_dir: Path,
    world_size: int,
    expert_parallel: bool,
    batch: int,
    prompt: int,
    steps: int,
    pp: int,
    micro: int,
    compile_step: bool = False,
) -> None:
    """One configuration; rank 0 prints its measurements as a JSON line."""
    import torch

    from engine.attention.torch_paged import TorchPagedBackend
    from engine.distributed.launch import finish_parallel, init_parallel
    from engine.distributed.parallel import SINGLE
    from engine.distributed_runner import DistributedRunner, serve_worker
    from engine.loading.weights import SafetensorsSource, load_model
    from engine.model.config import ModelConfig
    from engine.model_runner import Chunk, ModelRunner
    from kvstore.block_pool import BlockPool
    from kvstore.kv_cache import KVCache
    from kvstore.spec import KVSpec

    distributed = world_size * pp > 1
    ctx, watchdog = init_parallel(world_size, expert_parallel, pipeline_size=pp) if distributed else (SINGLE, None)
    if not distributed and os.environ.get("LONGCTX_THREADS"):
        torch.set_num_threads(int(os.environ["LONGCTX_THREADS"]))
    config = ModelConfig.from_pretrained_dir(model_dir)
    model, stats = load_model(config, SafetensorsSource(model_dir), torch.float32, progress=False, parallel=ctx)
    if not ctx.is_driver:
        serve_worker(model, ctx, watchdog)
        return
    page = 16
    spec = KVSpec(len(model.stage_layers), model.local_kv_heads, config.head_dim, page, "float32")
    pages_per_seq = -(-(prompt + steps + 1) // page)
    backend = TorchPagedBackend(model.local_heads, model.local_kv_heads, config.head_dim)
    runner = ModelRunner(model, KVCache(spec, batch * pages_per_seq + 2), backend)
    compile_s = 0.0
    if watchdog is not None:
        from engine.engine_config import EngineConfig

        runner = DistributedRunner(runner, ctx, watchdog, EngineConfig(compile=True) if compile_step else None)
    if compile_step:
        from engine.compiled_runner import attach
        from engine.model.compiled import BUCKETS, CompiledStep, bucket_for

        attach(runner)  # (the other ranks attach theirs from the config rank 0 announces)
        from engine.verify.self_check import warm_up_and_check

        t0 = time.perf_counter()
        # every bucket up to the decode step's (a micro-batch of a split step takes a smaller one)
        buckets = tuple(b for b in BUCKETS if b <= (bucket_for(batch) or 1))
        if isinstance(runner, DistributedRunner):
            report = runner.check_compiled(buckets)
        else:
            assert isinstance(runner.step, CompiledStep)
            report = warm_up_and_check(runner.step, page, buckets)
        compile_s = time.perf_counter() - t0
        assert report is not None and not report.eager, report
    runner.max_micro_batches = micro or pp
    pool = BlockPool(runner.kv_cache.num_pages)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    tables = [pool.allocate(pages_per_seq) for _ in range(batch)]
    warm = pool.allocate(1)
    for n in (16, 1):  # first calls allocate and pick kernels: not part of a step's time
        runner.run([Chunk(prompts[0][:n], warm, n)])
    ctx.comm.reset()
    runner.busy_s = runner.wall_s = 0.0
    t0 = time.perf_counter()
    logits = runner.run([Chunk(p, t, prompt) for p, t in zip(prompts, tables, strict=True)])
    prefill_s, prefill_comm = time.perf_counter() - t0, ctx.comm.total
    prefill_bubble = 1 - runner.busy_s / runner.wall_s if runner.wall_s else 0.0
    tokens = logits.argmax(-1).tolist()
    ctx.comm.reset()
    runner.busy_s = runner.wall_s = 0.0
    times = []
    generated = [tokens]
    for i in range(steps):
        t0 = time.perf_counter()
        chunks = [Chunk([tok], t, prompt + i + 1) for tok, t in zip(tokens, tables, strict=True)]
        tokens = runner.run(chunks).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
        generated.append(tokens)
    out = {
        "ranks": world_size * pp,
        "tensor_parallel": world_size,
        "pipeline_stages": pp,
        "micro_batches": runner.max_micro_batches if pp > 1 else 1,
        "prefill_bubble": prefill_bubble,
        "decode_bubble": 1 - runner.busy_s / runner.wall_s if runner.wall_s else 0.0,
        "prefill_tokens_per_s": batch * prompt / prefill_s,
        "decode_tokens_per_s": batch / (sum(times) / len(times)),
        "expert_parallel": expert_parallel,
        "threads_per_rank": torch.get_num_threads(),
        "bytes_read_per_rank": stats.bytes_read,
        "prefill_ms": prefill_s * 1e3,
        "prefill_comm_bytes": prefill_comm,
        "decode_ms": sum(times) / len(times) * 1e3,
        "decode_comm_bytes_per_step": ctx.comm.total / steps,
        "compiled": compile_step,
        "compile_and_check_s": compile_s,
        "greedy_tokens": generated,
    }
    if isinstance(runner, DistributedRunner) and watchdog is not None:
        runner.shutdown()
        finish_parallel(watchdog)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--rank-of", nargs=6, metavar=("MODEL", "RANKS", "EP", "PP", "MICRO", "COMPILE"), help=argparse.SUPPRESS
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated rows to run (tp1 always runs)")
    p.add_argument("--dense", action="store_true", help="a dense Qwen3 of the same attention instead of the MoE")
    args = p.parse_args()
    chosen = {"tp1", *args.configs.split(",")}
    if chosen - set(CONFIGS):
        raise SystemExit(f"unknown configs: {sorted(chosen - set(CONFIGS))}; known: {', '.join(CONFIGS)}")
    if args.quick:
        args.prompt, args.steps = 64, 8
    if args.rank_of:
        model, n, ep, pp, micro, comp = args.rank_of
        run_rank(Path(model), int(n), ep == "1", args.batch, args.prompt, args.steps, int(pp), int(micro), comp == "1")
        return
    results: dict[str, Any] = {
        "model": MODEL, "dense": args.dense, "batch": args.batch, "prompt": args.prompt, "cores": os.cpu_count(),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args.dense)
        for name, (n, ep, threads, pp, micro, comp) in CONFIGS.items():
            if name not in chosen:
                continue
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
            env |= {"LONGCTX_THREADS": str(threads)} if threads else {}
            env |= {"LONGCTX_HOME": str(Path(tmp) / f"home-{name}")}  # a cold compile per compiled row
            cmd = [sys.executable, __file__, "--rank-of", tmp, str(n), "1" if ep else "0", str(pp), str(micro)]
            cmd += ["1" if comp else "0"]
            cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(lines[-1].removeprefix("RESULT "))
    reference = results["tp1"]["greedy_tokens"]
    print(f"{'config':12} {'threads/rank':>12} {'MB read/rank0':>13} {'prefill tok/s':>13} {'prefill comm MB':>15} "
          f"{'decode tok/s':>12} {'decode comm KB/step':>19} {'bubble prefill':>14} {'bubble decode':>13} "
          f"{'compile s':>9} {'tokens = TP=1':>13}")  # fmt: skip
    for name in [c for c in CONFIGS if c in chosen]:
        r = results[name]
        r["tokens_agree"] = agree = r["greedy_tokens"] == reference
        print(f"{name:12} {r['threads_per_rank']:>12} {r['bytes_read_per_rank'] / 1e6:>13.1f} "
              f"{r['prefill_tokens_per_s']:>13.0f} {r['prefill_comm_bytes'] / 1e6:>15.2f} "
              f"{r['decode_tokens_per_s']:>12.1f} {r['decode_comm_bytes_per_step'] / 1e3:>19.1f} "
              f"{r['prefill_bubble']:>14.0%} {r['decode_bubble']:>13.0%} "
              f"{r['compile_and_check_s'] if r['compiled'] else 0:>9.1f} {'yes' if agree else 'NO':>13}")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("parallel-dense.json" if args.dense else "parallel.json")).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
