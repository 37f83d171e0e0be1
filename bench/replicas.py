"""Replicas behind `longctx route` against random routing, in one run on one machine.

N replicas (`longctx serve`, the demo model) share one private Redis (state and KV); C
conversations of T turns each (a long first prompt, then short questions) are sent by a few
client threads, turn by turn, in three passes over fresh conversations of the same text:
(a) random: each turn to a random replica directly; (b) routed: every turn through
`longctx route`; (c) routed, with one replica SIGKILLed before turn 3 (the moved conversations
go on elsewhere). Reported per pass: TTFT p50/p95 of the later turns, cached fraction per turn
(`usage.input_tokens_details.cached_tokens / input_tokens`), bytes the KV Redis sent
(`total_net_output_bytes`), failed turns, the p95 of each turn's end (from its last text delta
to `response.completed`: the KV commit wait and the commit); for (c) the TTFT of the moved
conversations' turns after the kill. The router finds the replicas in the registry they publish
(`--replicas-from-redis`). Agreement: the share of turns whose greedy output is the same text in (a) and
(b) (a speed figure counts only beside it). Prints a table and writes
bench/results/replicas.json.

On a 2-core machine the replicas share the CPUs (`--threads 1` each): the load average is
reported, and the ratio of routed to random TTFT is bounded by what a Redis read costs next to
a device-pool hit on loopback (small: both skip the prefill), not by the routing.

    python bench/replicas.py [--replicas 3 --convs 30 --turns 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from sess_common import filler, loadavg, pct  # noqa: E402

QUESTIONS = ["What is the first record about?", "Name two words from it.", "Which season appears?",
             "Summarize it in five words.", "Which place is named?", "Say thanks."]  # fmt: skip


def turn(base: str, conv: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed turn over HTTP: TTFT to the first text delta, the final usage and text, the
    replica that served it (`x-longctx-replica`, or `base` when sent directly)."""
    import httpx

    body = {"model": "demo", "conversation": conv, "input": text, "stream": True, "temperature": 0,
            "max_output_tokens": max_tokens}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    last_delta = t0
    final: dict[str, Any] | None = None
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
        replica = r.headers.get("x-longctx-replica", base)
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                last_delta = time.perf_counter()
                if ttft is None:
                    ttft = last_delta - t0
            elif event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                final = event.get("response")
                end_s = time.perf_counter() - last_delta
    if final is None or final.get("status") == "failed":
        return {"error": "no final response", "replica": replica}
    usage = final["usage"]
    text = "".join(p.get("text", "") for item in final["output"] if item["type"] == "message" for p in item["content"])
    cached = usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"]
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "replica": replica, "text": text,
            "cached": cached, "end_s": end_s}  # fmt: skip


def redis_sent(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("stats")["total_net_output_bytes"])


def run_pass(name: str, targets: list[str], a: argparse.Namespace, kill: Any = None) -> dict[str, Any]:
    import httpx

    rng = random.Random(7)
    convs = []
    for _ in range(a.convs):
        r = httpx.post(targets[0] + "/v1/conversations", json={"items": []}, timeout=60)
        convs.append(r.json()["id"])
    results: list[list[dict[str, Any]]] = [[] for _ in range(a.convs)]
    moved: set[int] = set()
    killed_url = None
    for t in range(a.turns):
        if kill is not None and t == 2:
            killed_url = kill()
            moved = {c for c in range(a.convs) if results[c] and results[c][-1].get("replica") == killed_url}

        def one(c: int, t: int = t) -> None:
            text = filler(c, a.words) + "\n" + QUESTIONS[0] if t == 0 else QUESTIONS[t % len(QUESTIONS)]
            target = rng.choice(targets) if len(targets) > 1 else targets[0]
            results[c].append({"turn": t, **turn(target, convs[c], text, a.max_tokens)})

        with ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(one, range(a.convs)))
    later = [r for rs in results for r in rs if r["turn"] > 0 and "error" not in r]
    out: dict[str, Any] = {
        "pass": name,
        "failed": sum("error" in r for rs in results for r in rs),
        "ttft_p50_s": pct([r["ttft_s"] for r in later], 0.5),
        "ttft_p95_s": pct([r["ttft_s"] for r in later], 0.95),
        "turn_end_p95_s": pct([r["end_s"] for rs in results for r in rs if "error" not in r], 0.95),
        "cached_by_turn": [
            round(min((rs[t]["cached"] for rs in results if len(rs) > t and "error" not in rs[t]), default=0), 3)
            for t in range(a.turns)
        ],
        "cached_mean_by_turn": [
            round(sum(rs[t]["cached"] for rs in results if "error" not in rs[t]) / len(results), 3)
            for t in range(a.turns)
        ],
        "texts": [[r.get("text") for r in rs] for rs in results],
    }
    if kill is not None:
        after = [rs[t]["ttft_s"] for c, rs in enumerate(results) if c in moved for t in range(2, a.turns)
                 if "error" not in rs[t]]  # fmt: skip
        out.update(killed=killed_url, moved_convs=len(moved), moved_ttft_p50_s=pct(after, 0.5) if after else None,
                   moved_ttft_max_s=max(after) if after else None)  # fmt: skip
    return out


def main() -> None:
    from engine.loading.model_source import pull_demo
    from tests.redis_server import private_redis
    from tests.server import free_port, start_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--convs", type=int, default=30)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--words", type=int, default=300, help="first prompt, about one token a word")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--kv-cache-bytes", default="96MiB", help="each replica's device pool")
    ap.add_argument("--quick", action="store_true", help="3 replicas x 8 conversations x 4 turns")
    a = ap.parse_args()
    if a.quick:
        a.convs, a.turns = 8, 4
    gguf, logs = pull_demo(), Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    out: dict[str, Any] = {"args": vars(a), "loadavg_start": loadavg()}
    print(f"load average {out['loadavg_start']}; logs in {logs}", flush=True)
    with private_redis() as url:
        args = ("--redis-url", url, "--kv-redis-url", url, "--dtype", "float32", "--threads", "1",
                "--kv-cache-bytes", a.kv_cache_bytes, "--background-workers", "0",
                "--served-model-name", "demo")  # fmt: skip

        def start(n: int) -> Any:
            return start_server(gguf, *args, log=logs / f"r{n}.log", prefix="bench")

        with ThreadPoolExecutor(a.replicas) as pool:
            servers = list(pool.map(start, range(a.replicas)))
        port = free_port()
        cmd = [sys.executable, "-m", "api.cli", "route", "--port", str(port), "--replicas-from-redis",
               "--redis-url", url, "--redis-prefix", "bench"]  # fmt: skip
        router = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        import httpx

        while True:
            try:
                r = httpx.get(base + "/ready", timeout=1)
                if r.status_code == 200 and r.json()["replicas_up"] == a.replicas:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        try:
            passes = []
            for name, targets, kill in (("random", [s.url for s in servers], None), ("routed", [base], None),
                                        ("routed, one killed at turn 3", [base], "kill")):  # fmt: skip
                sent = redis_sent(url)

                def do_kill() -> str:
                    victim = servers[-1]
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
                    return str(victim.url)

                p = run_pass(name, targets, a, do_kill if kill else None)
                p["redis_sent_mb"] = round((redis_sent(url) - sent) / 1e6, 1)
                p["loadavg"] = loadavg()
                passes.append(p)
                print(f"{name}: done, load {p['loadavg']}", flush=True)
            out["router_metrics"] = httpx.get(base + "/metrics", timeout=5).text
        finally:
            router.terminate()
            router.wait(10)
            for s in servers:
                if s.proc.poll() is None:
                    s.stop()
    rand, routed = passes[0], passes[1]
    same = sum(
        x == y for tr, tt in zip(rand["texts"], routed["texts"], strict=True) for x, y in zip(tr, tt, strict=True)
    )
    total = sum(len(tr) for tr in rand["texts"])
    out["agreement"] = round(same / total, 3)
    out["ttft_ratio_routed_to_random_p50"] = round(routed["ttft_p50_s"] / rand["ttft_p50_s"], 3)
    for p in passes:
        p.pop("texts")
    out["passes"] = passes
    print(f"\n{a.replicas} replicas x {a.convs} conversations x {a.turns} turns; agreement random vs routed "
          f"{out['agreement']:.0%}")  # fmt: skip
    head = f"{'pass':32} {'failed':>6} {'TTFT p50':>9} {'p95':>7} {'end p95':>8} {'Redis MB':>9}"
    print(head + "  min cached by turn / mean")
    for p in passes:
        row = f"{p['pass']:32} {p['failed']:>6} {p['ttft_p50_s']:>8.3f}s {p['ttft_p95_s']:>6.3f}s"
        row += f" {p['turn_end_p95_s']:>7.3f}s {p['redis_sent_mb']:>9}"
        print(f"{row}  {p['cached_by_turn']} / {p['cached_mean_by_turn']}")
    k = passes[2]
    print(f"killed {k['killed']}: {k['moved_convs']} conversations moved, their TTFT after: p50 "
          f"{k['moved_ttft_p50_s']}, max {k['moved_ttft_max_s']}")  # fmt: skip
    print(f"routed / random TTFT p50: {out['ttft_ratio_routed_to_random_p50']}; load {passes[-1]['loadavg']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("replicas-quick.json" if a.quick else "replicas.json")).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
