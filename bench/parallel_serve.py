"""Sharded models as users get them: `longctx serve` in one process, TP=2, PP=2 and PP=2 x TP=2,
through the `openai` client, side by side in one run.

Models: a random Llama with the demo tokenizer (hidden 512, 4 layers, 8 / 4 heads, MLP 1,024,
vocabulary 49,152: every layout divides it), and the demo model (SmolLM2-135M, 9 / 3 heads:
tensor parallelism cannot split it, so one process and PP=2 only). Every server runs the
defaults (compiled step, dtype auto) with `--threads` per rank so that the ranks share the
machine's cores (1 each at 2 or more ranks on 2 cores); the single process's background
compile is waited for (`/ready?wait_compiled_s`), a sharded server compiles before it is ready.
Per layout: seconds to ready (cold graph store the first time a layout's shapes are seen),
one stream's decode tokens/s after its first token (median of `--rounds`), 4 concurrent
streams' aggregate tokens/s, and the agreement of what was generated with the one-process
server: the lone stream's greedy text equal or not, and how many of the 4 concurrent streams'
texts are (in bfloat16 a step's numerics depend on the batch it shares: concurrent streams are
batched differently by every layout, and a random model's near-ties flip; `--dtype float32`
removes that).

    python bench/parallel_serve.py [--tokens 64] [--rounds 3] [--models tiny,demo] [--dtype auto]

Prints a table and writes bench/results/parallel_serve-DTYPE.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
LAYOUTS: dict[str, tuple[str, ...]] = {
    "one process": (),
    "TP=2": ("--tensor-parallel-size", "2"),
    "PP=2": ("--pipeline-parallel-size", "2"),
    "PP=2 x TP=2": ("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"),
}
PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a bicycle works, part by part.",
    "Describe a journey across a desert, day by day.",
    "List everything you would pack for a month at sea, and why.",
]


def tiny_llama(path: Path) -> Path:
    """The random Llama, saved with the demo tokenizer and chat template."""
    from engine.loading.model_source import resolve_model
    from tests.tiny_models import llama_with_demo_tokenizer

    return llama_with_demo_tokenizer(
        path, resolve_model("smollm2-135m-instruct").path, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    )  # fmt: skip


async def one_stream(client: Any, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage is not None else len(stamps)
    decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return {"ttft_s": stamps[0] - t0 if stamps else float("nan"), "tokens": n, "decode_s": decode_s,
            "text": "".join(text), "end_s": time.perf_counter() - t0}  # fmt: skip


async def measure(url: str, model: str, tokens: int, rounds: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    singles = [await one_stream(client, model, PROMPTS[0], tokens) for _ in range(rounds)]
    t0 = time.perf_counter()
    concurrent = await asyncio.gather(*(one_stream(client, model, p, tokens) for p in PROMPTS))
    wall = time.perf_counter() - t0
    rates = [(s["tokens"] - 1) / s["decode_s"] for s in singles if s["decode_s"] > 0]
    return {
        "single_decode_tokens_per_s": statistics.median(rates) if rates else float("nan"),
        "single_ttft_s": statistics.median(s["ttft_s"] for s in singles),
        "concurrent_tokens_per_s": sum(s["tokens"] for s in concurrent) / wall,
        "texts": [singles[0]["text"], *[s["text"] for s in concurrent]],
    }


def run_layout(model: str, layout: tuple[str, ...], threads: int, a: Any, tmp: Path) -> dict[str, Any]:
    from tests.redis_server import delete_prefix, unique_prefix
    from tests.server import http_get, start_server, wait_compiled

    prefix = unique_prefix()
    flags = ["--redis-url", a.redis_url, "--served-model-name", "m", "--background-workers", "0", "--compile"]
    flags += ["--threads", str(threads), "--kv-cache-bytes", "256MiB", "--dtype", a.dtype, *layout]
    t0 = time.perf_counter()
    server = start_server(model, *flags, log=tmp / f"serve-{prefix}.log", prefix=prefix, ready_timeout_s=1800)
    try:
        ready = wait_compiled(server)
        ready_s = time.perf_counter() - t0
        phases = http_get(server.url + "/ready")[1].get("phase_seconds", {})
        result = asyncio.run(measure(server.url, "m", a.tokens, a.rounds))
    finally:
        server.stop()
        delete_prefix(a.redis_url, prefix)
    result |= {"ready_s": ready_s, "phases": phases, "compiled_buckets": ready.get("compiled_buckets")}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="tiny,demo")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--dtype", default="auto", help="the servers' --dtype (auto: what users get)")
    a = ap.parse_args()
    cores = os.cpu_count() or 2
    report: dict[str, Any] = {
        "tokens": a.tokens, "rounds": a.rounds, "dtype": a.dtype, "cores": cores, "load_before": os.getloadavg(),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        models = {"tiny": str(tiny_llama(tmp / "tiny")), "demo": "smollm2-135m-instruct"}
        for name in a.models.split(","):
            rows: dict[str, Any] = {}
            for layout, flags in LAYOUTS.items():
                if name == "demo" and "--tensor-parallel-size" in flags:
                    continue  # 9 heads, 3 KV heads: no even split in two
                ranks = 2 ** (len(flags) // 2)
                threads = max(1, cores // ranks)
                rows[layout] = run_layout(models[name], flags, threads, a, tmp)
                r = rows[layout]
                r["threads_per_rank"] = threads
                ref = rows["one process"]["texts"]
                r["single_text_equal"] = r["texts"][0] == ref[0]
                r["concurrent_texts_equal"] = sum(x == y for x, y in zip(r["texts"][1:], ref[1:], strict=True))
                print(f"{name} {layout}: {json.dumps({k: v for k, v in r.items() if k != 'texts'})}", flush=True)
            report[name] = rows
    report["load_after"] = os.getloadavg()
    print(f"\n{'model':6} {'layout':12} {'threads/rank':>12} {'ready s':>8} {'TTFT s':>7} {'1-stream tok/s':>14} "
          f"{'4-stream tok/s':>14} {'1-stream text = 1 proc':>22} {'4-stream texts = 1 proc':>23}")  # fmt: skip
    for name in a.models.split(","):
        for layout, r in report[name].items():
            print(f"{name:6} {layout:12} {r['threads_per_rank']:>12} {r['ready_s']:>8.1f} {r['single_ttft_s']:>7.2f} "
                  f"{r['single_decode_tokens_per_s']:>14.1f} {r['concurrent_tokens_per_s']:>14.1f} "
                  f"{'yes' if r['single_text_equal'] else 'NO':>22} {r['concurrent_texts_equal']:>21}/4")  # fmt: skip
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"parallel_serve-{a.dtype}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
