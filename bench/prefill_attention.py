"""Prefill attention on CPU: `paged_prefill.cpp` against one masked SDPA over the chunk's gathered
keys (`engine/attention/torch_paged.py`, `GATHER_FROM`), side by side in one run.

Part 1, the attention call alone: per (chunk queries, keys) one layer of the demo model's shape
(9 query heads, 3 KV heads, head dim 64, bf16, pages of 16 shuffled), each route timed over
the same inputs (median of rounds that alternate the routes), and each route's largest error
against float64 attention, relative to the output's largest value.

Part 2, what a user waits for: the demo model in process (bf16, compiled, `--threads` threads),
each route in turn for the whole engine (`GATHER_FROM` set), rounds alternating: the time to the
first token of a fresh 2,048-token prompt (chunks of `max_num_batched_tokens`), and of a turn of
+32 tokens after a cached 2,048-token history (the restored turn of `bench/pressure.py`); greedy
first tokens compared between the routes.

Part 3 (`--served-roots OLD,NEW`), as users get it: `longctx serve` (bf16, compiled) from two
checkouts in turn (e.g. one before the route and this one), through the `openai` client: TTFT of
a fresh chat prompt of ~2,000 tokens, and of the next turn (the reply and ~32 new tokens: the
history in the prefix cache), the median of `--served-turns` (3) per start.

    python bench/prefill_attention.py [--quick] [--threads 2] [--served-roots OLD,.]
        [--out results/prefill_attention.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(16, 2080), (32, 2080), (64, 2080), (32, 8192), (256, 2048), (512, 2048), (512, 8192)]
H, KVH, D, S = 9, 3, 64, 16


# Each route as `torch_paged.GATHER_FROM` selects it: never gathered, or every chunk gathered.
ROUTES: dict[str, int | None] = {"kernel": None, "gathered": 1}


@contextlib.contextmanager
def _route(gather_from: int | None, min_queries: int) -> Iterator[None]:
    """The dispatcher set to one route while inside; as it was after."""
    from engine.attention import torch_paged

    saved = torch_paged.GATHER_FROM, torch_paged.GATHER_MIN_QUERIES
    torch_paged.GATHER_FROM, torch_paged.GATHER_MIN_QUERIES = gather_from, min_queries
    try:
        yield
    finally:
        torch_paged.GATHER_FROM, torch_paged.GATHER_MIN_QUERIES = saved


def attention_calls(rounds: int) -> list[dict[str, Any]]:
    import torch

    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_paged import TorchPagedBackend

    rows = []
    for T, L in SHAPES:
        g = torch.Generator().manual_seed(T * 7 + L)
        n_pages = -(-L // S)
        cache = torch.randn(n_pages + 8, 2, S, KVH, D, generator=g).to(torch.bfloat16)
        table = torch.randperm(n_pages + 8, generator=g)[:n_pages].to(torch.int32)
        meta = AttentionMetadata.from_tables([table], [0], [T], [L], S)
        q, k, v = (torch.randn(T, h, D, generator=g).to(torch.bfloat16) for h in (H, KVH, KVH))
        backend = TorchPagedBackend(H, KVH, D)
        backend.plan(meta)
        backend.forward(0, q, k, v, cache)  # the chunk's own K/V written in, as every later call writes them
        want = _reference(q, cache, table, L)
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        errors = {}
        for rnd in range(rounds):
            for route, gather_from in ROUTES.items():
                with _route(gather_from, 1):
                    out = backend.forward(0, q, k, v, cache)
                    if rnd == 0:
                        errors[route] = ((out.double() - want).abs().max() / want.abs().max()).item()
                    n = 10
                    t0 = time.perf_counter()
                    for _ in range(n):
                        backend.forward(0, q, k, v, cache)
                    times[route].append((time.perf_counter() - t0) / n * 1e3)
        med = {r: statistics.median(t) for r, t in times.items()}
        rows.append(
            {"queries": T, "keys": L, **{f"{r}_ms": m for r, m in med.items()},
             "kernel / gathered": med["kernel"] / med["gathered"],
             **{f"{r}_error": e for r, e in errors.items()}}
        )  # fmt: skip
    return rows


def _reference(q: Any, cache: Any, table: Any, L: int) -> Any:
    """float64 causal attention of the last T positions of an L-key context."""
    import torch

    pages = cache[table.long()].double()
    keys, values = (pages[:, i].reshape(-1, KVH, D)[:L].repeat_interleave(H // KVH, dim=1) for i in (0, 1))
    T = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / D**0.5
    allowed = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def engine_turns(threads: int, rounds: int) -> dict[str, Any]:
    import torch

    from engine.engine import Engine, EngineConfig
    from engine.loading.loader import load
    from engine.model.compile_setup import compile_available
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    loaded = load("smollm2-135m-instruct", dtype="bfloat16", progress=False)
    tok = loaded.tokenizer
    compiled = compile_available() is None
    config = EngineConfig(kv_cache_bytes=512 << 20, max_num_batched_tokens=512, compile=compiled)
    engine = Engine(loaded.model, tok, config)
    if compiled:
        engine.runner.step.warm_up(config.page_size)  # type: ignore[attr-defined]
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    text = (ROOT / "README.md").read_text()
    base = tok.encode(text * 8)[:4096]

    def first_token(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        handle = engine.add_request(ids, greedy)
        engine.run_until_idle()
        dt = time.perf_counter() - t0
        return dt, handle.result()[0][0]

    first_token(base[:64])  # warm-up
    times: dict[str, dict[str, list[float]]] = {r: {"prompt": [], "turn": []} for r in ROUTES}
    tokens: dict[str, list[int]] = {r: [] for r in ROUTES}
    fresh = 1000
    for _ in range(rounds):
        for route, gather_from in ROUTES.items():
            fresh += 1
            history = [fresh, *base[1:2048]]  # its own first token: nothing from the prefix cache
            with _route(gather_from, 16):  # the dispatcher's smallest chunk
                dt, t = first_token(history)
                times[route]["prompt"].append(dt)
                tokens[route].append(t)
                dt, t = first_token(history + base[2048:2080])  # the history cached: a chunk of 32
                times[route]["turn"].append(dt)
                tokens[route].append(t)
    out: dict[str, Any] = {"compiled": compiled, "threads": threads}
    for route, parts in times.items():
        for part, ts in parts.items():
            out[f"{route}_{part}_ttft_ms"] = statistics.median(ts) * 1e3
    # the routes' prompts differ in their first token only: the first tokens, paired by round
    same = sum(a == b for a, b in zip(tokens["kernel"], tokens["gathered"], strict=True))
    out["first_tokens_agree"] = f"{same} of {len(tokens['kernel'])}"
    return out


def served_turns(root: Path, threads: int, redis_url: str, rounds: int = 3) -> dict[str, float]:
    """TTFTs through `longctx serve` run from checkout `root`: a fresh long prompt, then its next turn."""
    import asyncio
    import uuid

    import openai

    sys.path.insert(0, str(ROOT / "bench"))
    from served import demo_server

    doc = (ROOT / "docs" / "engine.md").read_text()[:7000]
    flags = ["--dtype", "bfloat16", "--threads", str(threads)]
    with demo_server(flags, redis_url, "prefill", root, {"PYTHONPATH": str(root)}) as (url, _, _):
        client: Any = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)

        async def ttft(messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
            t0, first, text = time.perf_counter(), None, ""
            stream = await client.chat.completions.create(
                model="demo",
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].delta.content
            return 1000 * ((first or time.perf_counter()) - t0), text

        async def drive() -> dict[str, list[float]]:
            await ttft([{"role": "user", "content": "Hello"}], 4)
            out: dict[str, list[float]] = {"prompt": [], "turn": []}
            for _ in range(rounds):
                first = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Summarize this:\n{doc}"}]
                t, reply = await ttft(first, 8)
                out["prompt"].append(t)
                follow = "Now say in one sentence what the prefill kernel reads, and why it avoids a copy."
                turn = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
                t, _ = await ttft(turn, 8)
                out["turn"].append(t)
            await client.close()  # inside the loop: closed after it, its transport would complain
            return out

        got = asyncio.run(drive())
    return {f"{part}_ttft_ms": statistics.median(ts) for part, ts in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--served-roots", default="", help="OLD,NEW checkouts whose `longctx serve` to compare")
    ap.add_argument("--served-turns", type=int, default=3, help="fresh prompts (each with its next turn) per start")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_attention.json"))
    args = ap.parse_args()
    import torch

    from engine.attention import cpu_kernel
    from engine.loading.model_source import longctx_home

    torch.set_num_threads(args.threads)
    cpu_kernel.load(longctx_home() / "kernels")
    flags = cpu_kernel.cpu_flag_set()
    if cpu_kernel.prefill(torch.bfloat16, D) is None:
        sys.exit("no bf16 prefill kernel on this CPU (needs AVX-512): nothing to compare")
    calls = attention_calls(3 if args.quick else 5)
    print(f"CPU: AMX {'amx_bf16' in flags}, AVX512-BF16 {'avx512_bf16' in flags}; threads {args.threads}")
    print(f"{'queries':>8} {'keys':>6} {'kernel ms':>10} {'gathered ms':>12} {'kernel/gathered':>16} {'errors':>20}")
    for r in calls:
        print(
            f"{r['queries']:>8} {r['keys']:>6} {r['kernel_ms']:>10.3f} {r['gathered_ms']:>12.3f} "
            f"{r['kernel / gathered']:>16.2f} {r['kernel_error']:>9.1e} {r['gathered_error']:>9.1e}"
        )
    turns = engine_turns(args.threads, 2 if args.quick else 4)
    print(f"engine (bf16, compiled {turns['compiled']}): TTFT, median of rounds")
    for part, label in (("prompt", "a fresh 2,048-token prompt"), ("turn", "+32 tokens after a cached 2,048")):
        k, g = turns[f"kernel_{part}_ttft_ms"], turns[f"gathered_{part}_ttft_ms"]
        print(f"  {label}: kernel {k:.1f} ms, gathered {g:.1f} ms ({k / g:.2f}x)")
    print(f"  greedy first tokens agree: {turns['first_tokens_agree']}")
    served: dict[str, list[dict[str, float]]] = {}
    roots = [r for r in args.served_roots.split(",") if r]
    for _ in range(2 if roots else 0):  # each checkout twice, alternating
        for root in roots:
            turns_here = served_turns(Path(root).resolve(), args.threads, args.redis_url, args.served_turns)
            served.setdefault(root, []).append(turns_here)
    for root, starts in served.items():
        per_part = {part: " / ".join(f"{s[part + '_ttft_ms']:.0f}" for s in starts) for part in ("prompt", "turn")}
        cells = ", ".join(f"{part} {ms} ms" for part, ms in per_part.items())
        print(f"served from {root} (TTFT per start, ~2k-token prompt / its next turn): {cells}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"calls": calls, "engine": turns, "served": served, "amx": "amx_bf16" in flags}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
