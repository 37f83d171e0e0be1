"""Multi-turn reuse under KV-cache pressure, side by side in one run.

Per cell: `k` x as many conversations as the device pool holds (k = 2, 4, 8), 4 turns each (a
first prompt of `--conv-tokens`, then each turn adds the previous output and `--new-tokens`), all
of a turn's conversations submitted at once to one engine; the Redis tier behind a pipelined
proxy adding 0, 5 or 50 ms to every reply (`tests/delay_proxy.py`: replies are held back, never
serialized, no bandwidth cap); the host tier on (holding every conversation) or off; with Redis
the only tier, waiting requests' pages read ahead into host memory (`--kv-prefetch-bytes`, the
default) or not (`--prefetches on,off`; "on" alone with the host tier). Reported
per cell: the share of each later turn's previous prompt + output served from cache (min and
mean over later turns), TTFT p50/p95 of later turns against a cold prefill of a first prompt
alone (same engine settings, measured first) and against the same turns recomputed (per
conversation count, one run of the same turns with no prefix cache and no tiers: what a later
turn costs at the same concurrency without reuse), bytes read from Redis, preemptions, restored pages
left unused, pages a lookup read from the Redis writer's queue and pages handed to it when
their request was preempted. The outputs of every cell are checked against the first cell's (greedy decoding:
the tokens must agree whatever was restored).

Then the restore breakdown of a `--restore-tokens` turn (the previous turn's pages held only by
the host tier, or only by a local Redis): lookup (hashing and matching), the tier's read,
decode and copy into the pool, the new tokens' prefill, the first decode step, TTFT; from the
host tier with the idle engine copying free pages into it ahead of their eviction and without
(`--copy-ahead`), after each pause between turns of `--think-ms`.

    python bench/pressure.py [--conv-tokens 256] [--factors 2,4,8] [--delays-ms 0,5,50]

Prints a table and writes JSON to bench/results/pressure.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PAGE = 16


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Runner:
    """One engine (started on its own thread) and the conversations of one cell."""

    def __init__(
        self,
        lm: Any,
        pool_pages: int,
        host_pages: int,
        redis_url: str | None,
        a: Any,
        prefix: str = "",
        reuse: bool = True,
        prefetch: bool = True,
    ):
        from engine.engine import Engine, EngineConfig

        c = lm.config
        per_page = 2 * c.num_layers * c.num_kv_heads * c.head_dim * lm.dtype.itemsize * PAGE
        cfg = EngineConfig(
            kv_cache_bytes=pool_pages * per_page, host_cache_bytes=host_pages * per_page,
            kv_redis_url=redis_url, kv_redis_prefix=prefix or f"longctx-bench-{uuid.uuid4().hex[:10]}",
            max_num_batched_tokens=a.budget, threads=a.threads, compile=a.compile, enable_prefix_caching=reuse,
            kv_prefetch_bytes=None if prefetch else 0,
        )  # fmt: skip
        self.engine = Engine(lm.model, lm.tokenizer, cfg, fingerprint=lm.stats.fingerprint).start()
        self.prefix = cfg.kv_redis_prefix

    def turn(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        """Submit every prompt at once; per prompt its output ids, cached tokens and TTFT."""
        from engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out: list[dict[str, Any]] = [{} for _ in prompts]
        t0 = time.perf_counter()
        handles = [self.engine.add_request(p, params) for p in prompts]

        def consume(i: int) -> None:
            ids: list[int] = []
            for o in handles[i]:
                if o.token_ids and "ttft_s" not in out[i]:
                    out[i]["ttft_s"] = time.perf_counter() - t0
                ids += o.token_ids
                out[i]["cached"] = o.cached_tokens
            out[i]["ids"] = ids

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self) -> None:
        self.engine.shutdown()


def run_cell(
    lm: Any, factor: int, delay_ms: int, host: bool, url: str, a: Any, reuse: bool = True, prefetch: bool = True
) -> dict[str, Any]:
    """One cell; `reuse=False`: the same turns recomputed (no prefix cache, no tiers), the
    reference a later turn's TTFT is held to under the same concurrency."""
    from tests.delay_proxy import DelayProxy
    from tests.redis_server import delete_prefix

    vocab = lm.config.vocab_size
    conv_pages = -(-(a.conv_tokens + a.turns * (a.new_tokens + a.output_tokens)) // PAGE) + 1
    pool_pages = a.pool_pages or a.pool_convs * conv_pages
    n = factor * a.pool_convs
    proxy = DelayProxy(url, delay_ms / 1000.0, lifetime_s=900) if delay_ms and reuse else None
    tier_url = (proxy.url if proxy else url) if reuse else None
    host_pages = n * conv_pages + 8 if host and reuse else 0
    runner = Runner(lm, pool_pages, host_pages, tier_url, a, reuse=reuse, prefetch=prefetch)
    redis = runner.engine.store.redis if runner.engine.store is not None else None
    prompts = [_tokens(1000 + c, a.conv_tokens, vocab) for c in range(n)]
    previous = [0] * n
    later: list[dict[str, Any]] = []
    first: list[float] = []
    outputs: list[list[int]] = []
    try:
        for t in range(a.turns):
            res = runner.turn(prompts, a.output_tokens)
            for c, r in enumerate(res):
                if not t:
                    first.append(r["ttft_s"])
                if t:
                    later.append({"turn": t, "conv": c, "share": r["cached"] / previous[c], "ttft_s": r["ttft_s"]})
                done = prompts[c] + r["ids"]
                outputs.append(r["ids"])
                previous[c] = len(done)
                prompts[c] = done + _tokens(50_000 + 97 * c + t, a.new_tokens, vocab)
            if redis is not None:
                redis.flush(30.0)
        stats = runner.engine.kv_stats()
        snap = runner.engine.snapshot()
    finally:
        runner.close()
        if proxy is not None:
            proxy.stop()
        delete_prefix(url, runner.prefix)
    value_bytes = redis.value_bytes if redis is not None else 0
    shares = [x["share"] for x in later]
    ttfts = [x["ttft_s"] for x in later]
    return {
        "factor": factor, "conversations": n, "pool_pages": pool_pages, "delay_ms": delay_ms, "host": host,
        "prefetch": prefetch, "read_ahead": stats.get("prefetch", {}).get("stored", 0),
        "read_ahead_used": stats.get("prefetch", {}).get("hits", 0),
        "reuse": reuse, "min_share": min(shares), "mean_share": sum(shares) / len(shares),
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
        "first_ttft_p50_s": _pct(first, 0.5), "first_ttft_p95_s": _pct(first, 0.95),
        "redis_bytes_read": stats.get("redis", {}).get("loaded", 0) * value_bytes,
        "preemptions": snap.preemptions, "unused": stats.get("restored_unused", {}),
        "redis_queue_hits": stats.get("redis", {}).get("queue_hits", 0),
        "redis_swapped_out": stats.get("redis", {}).get("swapped_out", 0),
        "later": later, "outputs": outputs,
    }  # fmt: skip


def cold_prefill(lm: Any, url: str, a: Any) -> float:
    """TTFT of a first prompt alone (nothing cached), median of 3."""
    runner = Runner(lm, 4 * (a.conv_tokens // PAGE + 4), 0, None, a)
    try:
        return sorted(
            runner.turn([_tokens(7 + i, a.conv_tokens, lm.config.vocab_size)], 1)[0]["ttft_s"] for i in range(3)
        )[1]
    finally:
        runner.close()


def restore_breakdown(lm: Any, tier: str, url: str, a: Any, think_s: float = 0.0, ahead: bool = True) -> dict[str, Any]:
    """A `restore_tokens` turn whose previous turn's pages are only in the host tier or only in
    Redis (another conversation took the whole device pool; without a host tier its pages are
    gone from this process): where its TTFT goes, median of `--restore-reps` restores, each of
    the same history with other new tokens. Beside it, the raw read of the same bytes (host:
    one copy of the payloads; Redis: the `MGET`s alone, undecoded): the floor the tier sets.

    `think_s`: the pause between the other conversation's turn and the restored one (a user's
    or a tool's time between turns; the engine idles). `ahead=False`: the engine does not copy
    free pages into the host tier while idle (`EngineCore.copy_ahead`), as before it did."""
    import engine.scheduling.prefix as sp
    from engine.model_runner import ModelRunner
    from kvstore.kv_cache import KVCache
    from kvstore.prefix import hash_page
    from kvstore.redis_connect import mget
    from kvstore.redis_tier import RedisTier
    from kvstore.tiers import HostTier, _Fetch
    from tests.redis_server import delete_prefix

    n = a.restore_tokens
    pages = n // PAGE + 8
    vocab = lm.config.vocab_size
    prompt = _tokens(4242, n, vocab)
    spans: list[tuple[str, float, float]] = []

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spans.append((name, t0, time.perf_counter()))

        return wrapper

    patches = [
        (sp.PrefixLookup, "_match_prefix", "lookup"),
        (RedisTier, "get_prefix", "tier read"),
        (HostTier, "get_prefix", "tier read"),
        (_Fetch, "load", "decode + copy into the pool"),
        (KVCache, "write_pages", "copy into the pool"),
        (KVCache, "write_images", "copy into the pool"),
        (ModelRunner, "run", "run"),
    ]
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patches]
    # The host tier holds every conversation of the run (as in the grid's "host on" cells).
    host_pages = (a.restore_reps + 2) * (pages + 8) if tier == "host" else 0
    runner = Runner(lm, pages, host_pages, url if tier == "redis" else None, a)
    if not ahead:
        runner.engine.copy_ahead = lambda: False  # type: ignore[method-assign]
    reps: list[dict[str, float]] = []
    ahead_pages: list[int] = []
    raw_s: list[float] = []
    cached = 0
    try:
        runner.turn([prompt], a.output_tokens)  # the previous turn: computed, saved
        runner.turn([prompt + _tokens(76, a.new_tokens, vocab)], 2)  # the same steps once (compiled buckets)
        # The reference: the same turn with the history still in the device pool (nothing restored).
        hit_s = runner.turn([prompt + _tokens(75, a.new_tokens, vocab)], 2)[0]["ttft_s"]
        store = runner.engine.store
        assert store is not None
        if store.redis is not None:
            store.redis.flush(30.0)
        ns = runner.engine.scheduler._salted("")
        keys: list[bytes] = []
        for i in range(n // PAGE):
            keys.append(hash_page(keys[-1] if keys else b"", prompt[i * PAGE : (i + 1) * PAGE], ns))
        for r in range(a.restore_reps):
            runner.turn([_tokens(99 + r, n + 6 * PAGE, vocab)], 1)  # another conversation takes the whole pool
            ahead_before = store.host.counters.copied_ahead
            time.sleep(think_s)
            for cls, attr, name in patches:
                setattr(cls, attr, timed(name, getattr(cls, attr)))
            spans.clear()
            try:
                res = runner.turn([prompt + _tokens(77 + r, a.new_tokens, vocab)], 2)[0]
            finally:
                for cls, attr, fn in saved:
                    setattr(cls, attr, fn)
            ahead_pages.append(store.host.counters.copied_ahead - ahead_before)
            cached = res["cached"]
            reps.append(_spans_to_parts(spans, res["ttft_s"]))
            # The raw read of the history's pages from the tier, as the restore asked for them.
            t0 = time.perf_counter()
            if store.redis is not None:
                per = store.redis.pages_per_read
                for i in range(0, len(keys), per):
                    mget(store.redis._reader, [store.redis.key(h) for h in keys[i : i + per]])
            else:
                bytearray().join([p for h in keys if (p := store.host._pages.get(h)) is not None])
            raw_s.append(time.perf_counter() - t0)
    finally:
        runner.close()
        delete_prefix(url, runner.prefix)
    med = {k: sorted(x[k] for x in reps)[len(reps) // 2] for k in reps[0]}
    raw = sorted(raw_s)[len(raw_s) // 2]
    return {"tier": tier, "tokens": n, "cached": cached, "bytes": (n // PAGE) * _page_bytes(lm), "raw_read_s": raw,
            "device_hit_ttft_s": hit_s, "seconds": med, "reps": reps, "think_s": think_s, "ahead": ahead,
            "copied_ahead_pages": sorted(ahead_pages)[len(ahead_pages) // 2]}  # fmt: skip


def _page_bytes(lm: Any) -> int:
    c = lm.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * lm.dtype.itemsize * PAGE


def _spans_to_parts(spans: list[tuple[str, float, float]], ttft_s: float) -> dict[str, float]:
    """One restore's timed spans -> seconds per part (nested spans counted once)."""
    times: dict[str, float] = {}
    runs = [(t0, t1) for name, t0, t1 in spans if name == "run"]
    for name, t0, t1 in spans:
        if name != "run":
            inner = sum(
                e - b for m, b, e in spans if m not in ("run", name, "copy into the pool") and t0 <= b and e <= t1
            )
            # Redis batches are copied into the pool on the lookup thread as they arrive: inside the read.
            copies = sum(e - b for m, b, e in spans if m == "copy into the pool" and t0 <= b and e <= t1)
            own = {"lookup": inner, "tier read": copies, "decode + copy into the pool": copies}.get(name, 0.0)
            times[name] = times.get(name, 0.0) + (t1 - t0) - own
    times.setdefault("tier read", 0.0)
    times.setdefault("copy into the pool", 0.0)
    times["decode"] = times.pop("decode + copy into the pool", 0.0)
    times["prefill of the new tokens"] = sum(t1 - t0 for t0, t1 in runs[:-1]) if len(runs) > 1 else 0.0
    times["first decode step"] = runs[-1][1] - runs[-1][0] if runs else 0.0
    times["ttft"] = ttft_s
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conv-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--pool-convs", type=int, default=2)
    p.add_argument(
        "--pool-pages", type=int, default=0, help="device pool in pages (default: --pool-convs whole conversations)"
    )
    p.add_argument("--factors", default="2,4,8")
    p.add_argument("--delays-ms", default="0,5,50")
    p.add_argument("--hosts", default="off,on")
    p.add_argument("--prefetches", default="on", help="on,off: Redis-only cells with and without reading ahead")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the compiled step, as served (default)"
    )
    p.add_argument("--restore-tokens", type=int, default=2048, help="0: no restore breakdown")
    p.add_argument("--restore-reps", type=int, default=5)
    p.add_argument("--think-ms", default="0", help="pauses between the other conversation's turn and the restored one")
    p.add_argument("--copy-ahead", default="off,on", help="host tier: the idle engine copying free pages ahead or not")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.add_argument("--out", default=str(RESULTS / "pressure.json"))
    a = p.parse_args()

    from engine.loading.loader import load
    from engine.loading.model_source import pull_demo

    lm = load(a.model or str(pull_demo()), dtype=a.dtype, progress=False)
    factors = [int(x) for x in a.factors.split(",") if x]  # none: the restore breakdown only
    cold = cold_prefill(lm, a.redis_url, a) if factors else float("nan")
    cells = []
    recomputed: dict[int, dict[str, Any]] = {}
    for factor in factors:
        t0 = time.perf_counter()
        recomputed[factor] = run_cell(lm, factor, 0, False, a.redis_url, a, reuse=False)
        print(f"cell {factor}x recomputed (no reuse): {time.perf_counter() - t0:.1f} s", flush=True)
        for delay in [int(x) for x in a.delays_ms.split(",")]:
            for host in [h == "on" for h in a.hosts.split(",")]:
                for prefetch in [x == "on" for x in a.prefetches.split(",")] if not host else [True]:
                    t0 = time.perf_counter()
                    cells.append(run_cell(lm, factor, delay, host, a.redis_url, a, prefetch=prefetch))
                    cells[-1]["wall_s"] = time.perf_counter() - t0
                    print(
                        f"cell {factor}x +{delay}ms host={'on' if host else 'off'} "
                        f"read-ahead={'on' if prefetch else 'off'}: {cells[-1]['wall_s']:.1f} s",
                        flush=True,
                    )
    # Greedy: every cell's outputs must agree with those of the cell with the same conversations.
    agree = {}
    for c in cells:
        ref = next(r for r in cells if r["factor"] == c["factor"])
        agree[(c["factor"], c["delay_ms"], c["host"], c["prefetch"])] = c["outputs"] == ref["outputs"]
    breakdown = []
    for think_ms in [int(x) for x in a.think_ms.split(",")] if a.restore_tokens else []:
        for ahead in [x == "on" for x in a.copy_ahead.split(",")]:
            breakdown.append(restore_breakdown(lm, "host", a.redis_url, a, think_ms / 1000, ahead))
        breakdown.append(restore_breakdown(lm, "redis", a.redis_url, a, think_ms / 1000))
    print(f"\ncold prefill of a {a.conv_tokens}-token first prompt alone: TTFT {cold * 1000:.0f} ms ({lm.dtype})")
    for factor, r in recomputed.items():
        print(
            f"{factor}x recomputed (no prefix cache, no tiers): later TTFT p50 / p95 "
            f"{r['ttft_p50_s'] * 1000:.0f} / {r['ttft_p95_s'] * 1000:.0f} ms"
        )
    print(
        "pool  convs  Redis+  host  ahead  later turns cached  later TTFT p50 / p95 (x cold)  "
        "x recomputed  first turns' TTFT p50 / p95  Redis MB  preempt  unused  queue hits / swapped out  "
        "read ahead / used  agree"
    )
    for c in cells:
        unused = sum(c["unused"].values())
        ok = agree[(c["factor"], c["delay_ms"], c["host"], c["prefetch"])]
        ref = recomputed[c["factor"]]
        print(
            f"{c['factor']}x  {c['conversations']:5d}  {c['delay_ms']:3d} ms  {'on ' if c['host'] else 'off'}  "
            f"{'on ' if c['prefetch'] else 'off'}  "
            f"min {c['min_share'] * 100:5.1f}% mean {c['mean_share'] * 100:5.1f}%  "
            f"{c['ttft_p50_s'] * 1000:6.0f} / {c['ttft_p95_s'] * 1000:6.0f} ms "
            f"({c['ttft_p50_s'] / cold:.2f} / {c['ttft_p95_s'] / cold:.2f})  "
            f"{c['ttft_p50_s'] / ref['ttft_p50_s']:.2f} / {c['ttft_p95_s'] / ref['ttft_p95_s']:.2f}  "
            f"{c['first_ttft_p50_s'] * 1000:6.0f} / {c['first_ttft_p95_s'] * 1000:6.0f} ms  "
            f"{c['redis_bytes_read'] / 1e6:7.1f}  {c['preemptions']:7d}  {unused:6d}  "
            f"{c['redis_queue_hits']:5d} / {c['redis_swapped_out']:5d}  "
            f"{c['read_ahead']:5d} / {c['read_ahead_used']:5d}  {ok}"
        )
    print(f"\nrestore of a {a.restore_tokens}-token turn (+{a.new_tokens} new tokens), seconds:")
    for b in breakdown:
        parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in b["seconds"].items())
        how = f"copy ahead {'on' if b['ahead'] else 'off'}, " if b["tier"] == "host" else ""
        print(
            f"  from {b['tier']} ({how}{b['think_s'] * 1000:.0f} ms between turns, "
            f"{b['copied_ahead_pages']} pages copied ahead): "
            f"cached {b['cached']} of {b['tokens'] + a.new_tokens}: {parts}; "
            f"raw read of its {b['bytes'] / 1e6:.1f} MB {b['raw_read_s'] * 1000:.1f} ms; "
            f"TTFT with the history in the device pool {b['device_hit_ttft_s'] * 1000:.1f} ms"
        )
    for c in [*cells, *recomputed.values()]:
        del c["outputs"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    args = vars(a)
    Path(a.out).write_text(json.dumps({"args": args, "dtype": str(lm.dtype), "cold_ttft_s": cold, "cells": cells,
                                       "recomputed": {str(k): v for k, v in recomputed.items()},
                                       "outputs_agree": {str(k): v for k, v in agree.items()},
                                       "restore": breakdown}, indent=1))  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
