"""Long contexts through the engine: one session grown to 1,048,576 tokens, step cost by context.

Parts, each in its own subprocess (its own peak RSS):

- `windowed`: a tiny random Mistral (every layer windowed, bf16, 256 B of KV per token) grown
  as one conversation: turns whose prompts extend the previous one (1k, 8k, 64k, 256k, 1M), each
  prefilled in chunks (the shared prefix comes from the prefix cache) and then decoded (16
  steps, 128 at the last). Per context: decode step time (wall and CPU), split into attention
  (the backend's plan + forward) and the rest, device pages held (pool pages not free, from
  `Engine.snapshot()`), prefill time; overall wall time, tokens/s, peak RSS, and with
  `--kv-redis-url` the bytes written to Redis.
- `full`: the same for a tiny full-attention Llama at 8k / 32k / 128k; and decode at 1M on the
  model runner over 1M tokens of random K/V (prefilling 1M tokens of full attention costs
  hours on a CPU; `--full-contexts ...,1048576` does it through the engine instead).
- `demo`: the demo model (bf16) at 1k / 4k / 8k.
- `serve` (`--serve`): a windowed tiny model behind `longctx serve`, one conversation grown to
  1M tokens by `responses.create` turns of large `input_text` items, then the server restarted on
  the same Redis: the next turn's cached tokens and the stored items
  (`bench/long_context_serve.py`).
- `memory`: peak memory of one 2k-token prefill chunk against 256k cached tokens, by attention
  path (`bench/long_context_memory.py`).

Prints a table, writes JSON and an SVG plot (decode step time against context) to
bench/results/. `--quick` stops at 64k (windowed) and 32k (full), with fewer decode steps.

    python bench/long_context.py [--quick] [--parts windowed,full,demo,memory] [--kv-redis-url URL] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
WINDOW, CHUNK, PAGE = 4096, 4096, 16
WINDOWED = (1024, 8192, 65536, 262144, 1048576)
FULL = (8192, 32768, 131072)
DEMO = (1024, 4096, 8192)
TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepTimer:
    """Wall and CPU (this thread's) seconds inside the attention backend's plan and forward."""

    def __init__(self, backend: Any):
        self.wall = self.cpu = 0.0
        for name in ("plan", "forward"):
            setattr(backend, name, self._timed(getattr(backend, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.thread_time() - c

        return timed


def tiny_model(kind: str, tmp: Path, max_len: int) -> Any:
    """A random tiny model saved by transformers and loaded by ours, in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedModel

    from engine.loading.weights import SafetensorsSource, load_model
    from engine.model.config import ModelConfig

    torch.manual_seed(0)
    ref: PreTrainedModel
    if kind == "windowed":
        ref = MistralForCausalLM(MistralConfig(**TINY, sliding_window=WINDOW, max_position_embeddings=max_len))
    else:
        rope = {"rope_type": "default", "rope_theta": 1e6}
        ref = LlamaForCausalLM(LlamaConfig(**TINY, max_position_embeddings=max_len, rope_parameters=rope))
    ref.save_pretrained(tmp)
    config = ModelConfig.from_pretrained_dir(tmp)
    return load_model(config, SafetensorsSource(tmp), torch.bfloat16, progress=False)[0]


def grow(engine: Any, vocab: int, contexts: list[int], steps: int, last_steps: int) -> list[dict[str, Any]]:
    """One conversation: a turn per context length, each prompt extending the last; stepping on
    this thread and timing every step. Returns a row per context."""
    import random

    from engine.sampling_params import SamplingParams

    rng = random.Random(1)
    stream = [rng.randrange(vocab) for _ in range(contexts[-1])]
    timer = StepTimer(engine.runner.backend)
    rows = []
    for i, n in enumerate(contexts):
        decode = last_steps if i == len(contexts) - 1 else steps
        engine.add_request(stream[:n], SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
        prefill_s = waited_s = 0.0
        prefilled = engine.snapshot().prompt_tokens_computed
        walls, cpus, attn_walls, attn_cpus, held = [], [], [], [], 0
        while engine.has_unfinished():
            before = engine.snapshot()
            aw, ac = timer.wall, timer.cpu
            w, c = time.perf_counter(), time.thread_time()
            engine.step()
            w, c = time.perf_counter() - w, time.thread_time() - c
            snap = engine.snapshot()
            held = max(held, snap.total_pages - snap.free_pages)
            if snap.steps == before.steps:  # nothing ran: the request waits for pages from a tier
                waited_s += w
                time.sleep(0.001)
            elif snap.prompt_tokens_computed > before.prompt_tokens_computed:
                prefill_s += w
            else:
                walls.append(w)
                cpus.append(c)
                attn_walls.append(timer.wall - aw)
                attn_cpus.append(timer.cpu - ac)
        skip = min(2, len(walls) - 1)  # the first decode steps warm caches

        def med(xs: list[float], skip: int = skip) -> float:
            return 1000 * statistics.median(xs[skip:])

        rows.append(
            {
                "context": n,
                "prefill_tokens": engine.snapshot().prompt_tokens_computed - prefilled,
                "prefill_s": prefill_s,
                "tier_wait_s": waited_s,
                "decode_steps": len(walls),
                "step_ms": med(walls),
                "step_cpu_ms": med(cpus),
                "attention_ms": med(attn_walls),
                "attention_cpu_ms": med(attn_cpus),
                "rest_cpu_ms": med([c - a for c, a in zip(cpus, attn_cpus, strict=True)]),
                "pages_held": held,
                "rss_mb": rss_mb(),
            }
        )
        print(f"  {n:>8} tokens: prefill {prefill_s:.1f} s, decode step {rows[-1]['step_ms']:.2f} ms", file=sys.stderr)
    return rows


def delete_prefix(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    return sum(client.delete(*keys[i : i + 500]) for i in range(0, len(keys), 500))


def engine_for(model: Any, tokens: int, args: argparse.Namespace, redis_url: str | None = None) -> Any:
    from engine.engine import Engine, EngineConfig

    mc = model.config
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * model.model.norm.weight.element_size()
    config = EngineConfig(
        kv_cache_bytes=(tokens + 64 * PAGE) * per_token,
        page_size=PAGE,
        max_num_batched_tokens=CHUNK,
        max_model_len=tokens + 256,
        threads=args.threads,
        kv_redis_url=redis_url,
        kv_redis_prefix=f"bench-long-{os.getpid()}",
        kv_redis_ttl=900,
    )
    return Engine(model, None, config, fingerprint=f"bench-long-context-{os.getpid()}")


def part_tiny(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    contexts = [int(x) for x in (args.windowed_contexts if kind == "windowed" else args.full_contexts).split(",")]
    steps, last = (8, 32) if args.quick else (16, 128)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(kind, Path(tmp), contexts[-1] + 1024)
    rss_model = rss_mb()
    engine = engine_for(model, contexts[-1] + last, args, args.kv_redis_url if kind == "windowed" else None)
    t0 = time.perf_counter()
    rows = grow(engine, model.config.vocab_size, contexts, steps, last)
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {
        "rows": rows,
        "wall_s": wall,
        "tokens": contexts[-1] + steps * (len(contexts) - 1) + last,
        "peak_rss_mb": rss_mb(),
        "rss_after_load_mb": rss_model,
        "kv_pool_mb": engine.kv_cache.num_bytes / 2**20,
        "device_pages": engine.kv_cache.num_pages,
        "window_pages_bound": -(-WINDOW // PAGE) + 2 if kind == "windowed" else None,
    }
    out["tokens_per_s"] = out["tokens"] / wall
    tier = engine.store.redis if engine.store is not None else None
    if tier is not None:
        tier.flush(timeout_s=120.0)
        out["redis_pages_written"] = tier.counters.written
        out["redis_pages_dropped"] = tier.counters.dropped
        out["redis_bytes_written"] = tier.counters.written * tier.value_bytes  # payload + header
    engine.shutdown()
    if tier is not None:  # this run's keys only (its own prefix); never a flush
        out["redis_keys_deleted"] = delete_prefix(args.kv_redis_url, engine.config.kv_redis_prefix + ":")
    if kind == "full":
        out["runner_decode"] = [runner_decode(model, n, args) for n in (1024, 1 << 20)]
    return out


def runner_decode(model: Any, n: int, args: argparse.Namespace, steps: int = 8) -> dict[str, Any]:
    """Decode steps of one sequence over n tokens of random K/V on the model runner (no engine,
    no scheduler): what a full-attention step costs at n without prefilling n tokens."""
    import torch

    from engine.attention.torch_paged import TorchPagedBackend
    from engine.model_runner import Chunk, ModelRunner
    from kvstore.kv_cache import KVCache
    from kvstore.spec import KVSpec

    mc = model.config
    spec = KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, PAGE, "bfloat16")
    pages = -(-(n + steps) // PAGE)
    cache = KVCache(spec, pages)
    for layer in cache.layers:
        layer.normal_()
    runner = ModelRunner(model, cache, TorchPagedBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim))
    timer = StepTimer(runner.backend)
    table = list(range(pages))
    walls, cpus, attn = [], [], []
    for i in range(steps):
        a, w, c = timer.cpu, time.perf_counter(), time.thread_time()
        logits = runner.run([Chunk([i % mc.vocab_size], table, n + i + 1)])
        walls.append(time.perf_counter() - w)
        cpus.append(time.thread_time() - c)
        attn.append(timer.cpu - a)
        assert torch.isfinite(logits).all()
    med = lambda xs: 1000 * statistics.median(xs[2:])  # noqa: E731
    return {
        "context": n,
        "step_ms": med(walls),
        "step_cpu_ms": med(cpus),
        "attention_cpu_ms": med(attn),
        "rest_cpu_ms": med([c - a for c, a in zip(cpus, attn, strict=True)]),
    }


def part_demo(args: argparse.Namespace) -> dict[str, Any]:
    from engine.loading.loader import load

    loaded = load("smollm2-135m-instruct", dtype="bfloat16", progress=False)
    model = loaded.model
    steps = 8 if args.quick else 16
    limit = model.config.max_position_embeddings - steps - 1
    contexts = [min(n, limit) for n in DEMO]
    engine = engine_for(model, contexts[-1] + steps, args)
    rows = grow(engine, model.config.vocab_size, contexts, steps, steps)
    engine.shutdown()
    return {"rows": rows, "peak_rss_mb": rss_mb()}


def part_memory(context: int = 1 << 18, chunk: int = 2048) -> dict[str, Any]:
    """`bench/long_context_memory.py` once per attention path, each in its own process."""
    rows = []
    for path in ("split", "blocked", "dense"):
        cmd = [sys.executable, str(ROOT / "bench" / "long_context_memory.py"), "--path", path]
        cmd += ["--context", str(context), "--chunk", str(chunk)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"rows": rows}


def part_serve(args: argparse.Namespace) -> dict[str, Any]:
    """`bench/long_context_serve.py` in its own process (it starts and restarts `longctx serve`)."""
    cmd = [sys.executable, str(ROOT / "bench" / "long_context_serve.py"), "--threads", str(args.threads)]
    cmd += ["--tokens", str(args.serve_tokens), "--turn-tokens", str(args.serve_turn_tokens)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}"}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    if part == "memory":
        return part_memory()
    if part == "serve":
        return part_serve(args)
    cmd = [sys.executable, __file__, "--part", part, "--threads", str(args.threads)]
    cmd += ["--windowed-contexts", args.windowed_contexts, "--full-contexts", args.full_contexts]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--kv-redis-url", args.kv_redis_url] if args.kv_redis_url else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}"}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["part_wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="windowed,full,demo,memory")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-redis-url", default=None)
    p.add_argument("--windowed-contexts", default=None)
    p.add_argument("--full-contexts", default=None)
    p.add_argument("--serve", action="store_true", help="also grow a conversation through `longctx serve`")
    p.add_argument("--serve-tokens", type=int, default=1 << 20, help="context the served conversation grows to")
    p.add_argument("--serve-turn-tokens", type=int, default=32768, help="tokens of each turn's input_text item")
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve and "serve" not in args.parts.split(","):
        args.parts += ",serve"
    if args.windowed_contexts is None:
        args.windowed_contexts = ",".join(str(n) for n in (WINDOWED[:3] if args.quick else WINDOWED))
    if args.full_contexts is None:
        args.full_contexts = ",".join(str(n) for n in (FULL[:2] if args.quick else FULL))
    if args.part:
        import torch

        torch.set_num_threads(args.threads)
        out = part_demo(args) if args.part == "demo" else part_tiny(args.part, args)
        print(json.dumps(out))
        return
    from bench.long_context_report import report

    results: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    for part in args.parts.split(","):
        print(f"{part} ...", file=sys.stderr)
        results[part] = run_part(part, args)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    results["args"] = {k: v for k, v in vars(args).items() if k != "part"}
    report(results, RESULTS, quick=args.quick)


if __name__ == "__main__":
    main()
