"""The HTTP server's overhead: the same streams through `longctx serve` and through `Engine` in process.

Demo model, bfloat16, the same engine flags on both sides. For 1, 4 and 16 concurrent streaming
clients (`openai.AsyncOpenAI`, one process) on `/v1/chat/completions` and `/v1/responses`, and
the same chat prompts (rendered with the model's chat template) through an in-process `Engine`
(`add_request` from asyncio): time to first token and inter-token latency p50 / p95, aggregate
output tokens/s. Both are loaded at once and each concurrency level runs the three back to
back, so a change in the machine's load hits them alike. Also the server's seconds from start
to ready, by phase (from `/ready`). Prints a table and writes bench/results/http.json; note
the load average it prints beside the numbers.

Targets: at 16 streams HTTP aggregate >= 90% of in-process; at one stream TTFT overhead <= 25 ms p50.

    python bench/http_serving.py [--streams 1,4,16] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file's name shadows the standard library's `http` package (urllib, httpx need it): run as a
# script, its folder comes off the import path first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

# The server runs with OMP_WAIT_POLICY=PASSIVE (set by `api` before torch loads its OpenMP
# runtime, which reads it once, unless the environment says otherwise). The in-process engine
# gets the same policy, set here before anything loads torch; the server inherits it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
THREADS = 2
ENGINE_FLAGS = ["--dtype", "bfloat16", "--threads", str(THREADS), "--kv-cache-bytes", "512MiB", "--max-num-seqs", "16"]
SERVE_FLAGS = [
    *ENGINE_FLAGS,
    "--served-model-name",
    "demo",
    "--kv-redis-url",
    "none",
    "--background-workers",
    "0",
    "--max-output-tokens",
    "512",
]
_next_prompt = [0]


def prompt() -> str:
    """A fresh prompt each call (no prefix-cache hit between runs) that makes the model write on."""
    _next_prompt[0] += 1
    k = 100 * _next_prompt[0]
    return f"Write a long story about the dragon number {k} and its treasure."


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class Run:
    """TTFTs, inter-token gaps and tokens of one batch of concurrent streams."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.seconds = 0.0

    def stream(self, started: float) -> Any:
        run = self
        last: list[float | None] = [None]

        def token(n: int = 1) -> None:
            now = time.perf_counter()
            if last[0] is None:
                run.ttft.append(now - started)
            else:
                run.itl.append(now - last[0])
            last[0] = now
            run.tokens += n

        return token

    def summary(self) -> dict[str, float]:
        return {
            "ttft_p50_ms": 1000 * pct(self.ttft, 0.5), "ttft_p95_ms": 1000 * pct(self.ttft, 0.95),
            "itl_p50_ms": 1000 * pct(self.itl, 0.5), "itl_p95_ms": 1000 * pct(self.itl, 0.95),
            "tokens": self.tokens, "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
        }  # fmt: skip


async def in_process(engine: Any, tok: Any, n: int, max_tokens: int) -> Run:
    from engine.sampling_params import SamplingParams

    run = Run()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    async def one() -> None:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt()}], add_generation_prompt=True)
        started = time.perf_counter()
        token = run.stream(started)
        async with engine.generate(ids, params) as handle:
            async for out in handle:
                if out.token_ids:
                    token(len(out.token_ids))

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    run.seconds = time.perf_counter() - t0
    return run


async def over_http(client: Any, route: str, n: int, max_tokens: int) -> Run:
    run = Run()

    async def one() -> None:
        started = time.perf_counter()
        token = run.stream(started)
        if route == "chat":
            stream = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": prompt()}], max_tokens=max_tokens,
                temperature=0, stream=True,
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    token()
        else:
            stream = await client.responses.create(
                model="demo", input=prompt(), max_output_tokens=max_tokens, temperature=0, stream=True, store=False
            )
            async for event in stream:
                if event.type == "response.output_text.delta" and event.delta:
                    token()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    run.seconds = time.perf_counter() - t0
    return run


def load_engine() -> tuple[Any, Any]:
    import torch

    from api.engine_args import add_engine_args, engine_config
    from engine.engine import Engine
    from engine.loading.loader import load

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(ENGINE_FLAGS)
    torch.set_num_threads(THREADS)
    loaded = load(args.model, args.dtype, args.device, progress=False)
    config = engine_config(args, kv_redis_url=None)
    engine = Engine(loaded.model, loaded.tokenizer, config, fingerprint=loaded.stats.fingerprint)
    return engine.start(), loaded.tokenizer


async def bench(url: str, levels: list[int], max_tokens: int, rounds: int) -> dict[str, Any]:
    import openai

    engine, tok = await asyncio.to_thread(load_engine)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    out: dict[str, Any] = {}
    try:
        for n in levels:
            # An unrecorded short run of each path at this concurrency first: a batch size's first
            # steps are slow on both sides (kernel and allocator set-up), and were counted before.
            await in_process(engine, tok, n, 4)
            for route in ("chat", "responses"):
                await over_http(client, route, n, 4)
            for r in range(rounds):
                for name in ("in_process", "chat", "responses"):
                    run = await (in_process(engine, tok, n, max_tokens) if name == "in_process"
                                 else over_http(client, name, n, max_tokens))  # fmt: skip
                    out.setdefault(f"{name}_{n}", []).append(run.summary())
                    print(f"{name} x{n} round {r}: {run.summary()}", file=sys.stderr, flush=True)
    finally:
        await client.close()
        engine.shutdown()
    return {k: _median(v) for k, v in out.items()}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    from tests.redis_server import delete_prefix, unique_prefix
    from tests.server import start_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream (max_tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per level (medians reported)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    a = ap.parse_args()
    levels = [int(x) for x in a.streams.split(",")]
    prefix = unique_prefix()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        server = start_server("smollm2-135m-instruct", "--redis-url", a.redis_url, *SERVE_FLAGS,
                              log=Path(tmp) / "serve.log", prefix=prefix)  # fmt: skip
        ready_s = time.perf_counter() - t0
        try:
            from tests.server import http_get

            phases = http_get(server.url + "/ready")[1].get("phase_seconds", {})
            load_before = os.getloadavg()
            results = asyncio.run(bench(server.url, levels, a.tokens, a.rounds))
            load_after = os.getloadavg()
        finally:
            server.stop()
            delete_prefix(a.redis_url, prefix)
    report = {"ready_s": ready_s, "phases": phases, "load_before": load_before, "load_after": load_after,
              "tokens": a.tokens, "rounds": a.rounds, "threads": THREADS, "runs": results}  # fmt: skip
    report["targets"] = targets(results, levels)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http.json").write_text(json.dumps(report, indent=2))
    print_table(report, levels)


def targets(runs: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hi, lo = max(levels), min(levels)
    for route in ("chat", "responses"):
        ratio = runs[f"{route}_{hi}"]["tokens_per_s"] / runs[f"in_process_{hi}"]["tokens_per_s"]
        overhead = runs[f"{route}_{lo}"]["ttft_p50_ms"] - runs[f"in_process_{lo}"]["ttft_p50_ms"]
        out[route] = {f"aggregate_ratio_{hi}": ratio, "aggregate_met": ratio >= 0.9,
                      f"ttft_overhead_ms_{lo}": overhead, "ttft_met": overhead <= 25}  # fmt: skip
    return out


def print_table(report: dict[str, Any], levels: list[int]) -> None:
    runs = report["runs"]
    lb, la = report["load_before"], report["load_after"]
    print(f"load average {lb[0]:.1f} before, {la[0]:.1f} after; {report['threads']} threads; "
          f"{report['tokens']} tokens per stream; medians of {report['rounds']} rounds")  # fmt: skip
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in report["phases"].items())
    print(f"start to ready {report['ready_s']:.1f} s ({phases})")
    head = ("streams", "path", "TTFT p50", "p95", "ITL p50", "p95", "tok/s", "vs engine")
    print("{:>7} {:<11} {:>9} {:>7} {:>8} {:>7} {:>7} {:>9}".format(*head))
    for n in levels:
        base = runs[f"in_process_{n}"]["tokens_per_s"]
        for name in ("in_process", "chat", "responses"):
            r = runs[f"{name}_{n}"]
            print(f"{n:>7} {name:<11} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p95_ms']:>5.0f}ms {r['itl_p50_ms']:>6.1f}ms "
                  f"{r['itl_p95_ms']:>5.1f}ms {r['tokens_per_s']:>7.1f} {r['tokens_per_s'] / base:>8.0%}")  # fmt: skip
    for route, t in report["targets"].items():
        print(f"{route}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))


if __name__ == "__main__":
    main()
