"""What a served token costs each process: `longctx serve` on the demo model, one stream at a
time through the `openai` client (`/v1/chat/completions`, `stream: true`), and per token, from
`/proc`, summed over every thread of each process:

- the API process's CPU time (ms) and its context switches, voluntary (a thread that slept and
  was woken: each one a wake-up) and involuntary;
- the engine process's CPU time and its involuntary context switches (a spinning OpenMP worker
  taken off its core: the step waits for it at the next barrier);
- TTFT p50 of 5 fresh short prompts (one token each, before the decode requests);
- the client's decode tokens/s after the first token (summed over `--streams` concurrent
  streams), and the engine's own inter-token time (its `/metrics` histogram).

Figures on a 2-core machine drift by 10-30% between server starts, so `--roots A,B` starts the
server from each checkout in turn, and `--envs` with each environment variant (`--starts` times
each, alternating), and the table compares
the medians: the wake-ups and CPU per token are steadier than tokens/s and show a channel's cost
where the speed cannot. Writes JSON to bench/results/process_cost.json.

    python bench/process_cost.py [--roots OLD_CHECKOUT,.] [--envs ';GOMP_SPINCOUNT=10000'] [--dtype int4] [--starts 3]
        [--requests 4] [--tokens 200] [--streams 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"
TICK = os.sysconf("SC_CLK_TCK")


def counters(pid: int) -> dict[str, float]:
    """CPU seconds and context switches of every thread of `pid` (threads that ended meanwhile
    are in the process's own CPU figure, not in its switch counts)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    out = {"cpu_s": (int(fields[11]) + int(fields[12])) / TICK, "voluntary": 0.0, "involuntary": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                out["voluntary"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                out["involuntary"] += int(line.split()[1])
    return out


def engine_pid(api_pid: int) -> int:
    """The API process's child that runs `engine.process.main`."""
    for task in Path(f"/proc/{api_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"engine.process.main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError("no engine process found")


def inter_token_ms(url: str) -> tuple[float, float]:
    """(sum, count) of the engine's inter-token histogram so far."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    s = n = 0.0
    for line in text.splitlines():
        if line.startswith("longctx:engine_inter_token_latency_seconds_sum"):
            s = float(line.rpartition(" ")[2])
        elif line.startswith("longctx:engine_inter_token_latency_seconds_count"):
            n = float(line.rpartition(" ")[2])
    return s, n


def one_start(root: Path, extra_env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    import openai
    import served
    from served import DTYPE_FLAGS, demo_server, stream_chat

    served._seq[0] = 0  # the same prompts at every start
    flags = [*DTYPE_FLAGS[args.dtype], "--threads", str(args.threads)]
    with demo_server(flags, args.redis_url, "cost", root, {"PYTHONPATH": str(root), **extra_env}) as (url, proc, _):
        engine = engine_pid(proc.pid)

        async def drive() -> list[dict[str, Any]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
            await stream_chat(client, "story", 16)  # the route's first-call costs stay out
            ttfts = []
            for _ in range(5):
                s = await stream_chat(client, "story", 1)
                ttfts.append(1000 * ((s.first or s.end) - s.start))
            rows = []
            for _ in range(args.requests):
                a0, e0, m0 = counters(proc.pid), counters(engine), inter_token_ms(url)
                got = await asyncio.gather(*(stream_chat(client, "story", args.tokens) for _ in range(args.streams)))
                a1, e1, m1 = counters(proc.pid), counters(engine), inter_token_ms(url)
                n = max(1, sum(g.tokens for g in got))
                tps = sum((g.tokens - 1) / (g.end - g.first) for g in got if g.first is not None and g.end > g.first)
                rows.append({
                    "tokens": n, "client_tokens_per_s": tps, "text": got[0].text,
                    "engine_inter_token_ms": 1000 * (m1[0] - m0[0]) / max(1.0, m1[1] - m0[1]),
                    "api_cpu_ms": 1000 * (a1["cpu_s"] - a0["cpu_s"]) / n,
                    "api_voluntary": (a1["voluntary"] - a0["voluntary"]) / n,
                    "api_involuntary": (a1["involuntary"] - a0["involuntary"]) / n,
                    "engine_cpu_ms": 1000 * (e1["cpu_s"] - e0["cpu_s"]) / n,
                    "engine_voluntary": (e1["voluntary"] - e0["voluntary"]) / n,
                    "engine_involuntary": (e1["involuntary"] - e0["involuntary"]) / n,
                })  # fmt: skip
            await client.close()
            for row in rows:
                row["ttft_ms"] = statistics.median(ttfts)
            return rows

        rows = asyncio.run(drive())
    keys = [k for k in rows[0] if k not in ("tokens", "text")]
    return {k: statistics.median(r[k] for r in rows) for k in keys} | {"texts": [r["text"] for r in rows]}


COLUMNS = [
    ("ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("client_tokens_per_s", "client tok/s", "{:.1f}"),
    ("engine_inter_token_ms", "engine step ms", "{:.2f}"),
    ("api_cpu_ms", "API CPU ms/tok", "{:.3f}"),
    ("api_voluntary", "API wake-ups/tok", "{:.2f}"),
    ("api_involuntary", "API preempted/tok", "{:.2f}"),
    ("engine_cpu_ms", "engine CPU ms/tok", "{:.2f}"),
    ("engine_voluntary", "engine wake-ups/tok", "{:.2f}"),
    ("engine_involuntary", "engine preempted/tok", "{:.2f}"),
]


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    print("| checkout | starts | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for root, starts in results.items():
        cells = []
        for key, _, fmt in COLUMNS:
            values = [s[key] for s in starts]
            cells.append(fmt.format(statistics.median(values)) + " (" + "-".join(
                fmt.format(v) for v in (min(values), max(values))) + ")")  # fmt: skip
        print(f"| {root} | {len(starts)} | " + " | ".join(cells) + " |")
    texts = [s["texts"][0] for starts in results.values() for s in starts]
    print(f"\nfirst request's text: {len(set(texts))} distinct across {len(texts)} starts (greedy: 1 expected)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--roots", default=".", help="checkouts to start the server from, in turn")
    ap.add_argument("--envs", default="", help="';'-separated variants of the server's environment, e.g. ';A=1 B=2'")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--streams", type=int, default=1, help="concurrent streams per request round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--out", default=str(RESULTS / "process_cost.json"))
    args = ap.parse_args()
    variants = []
    for r in args.roots.split(","):
        for e in args.envs.split(";"):
            extra = dict(kv.split("=", 1) for kv in e.split() if kv)
            label = str(Path(r).resolve()) + (f" [{e}]" if e else "")
            variants.append((label, Path(r).resolve(), extra))
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in variants}
    for i in range(args.starts):
        for label, root, extra in variants if i % 2 == 0 else variants[::-1]:
            row = one_start(root, extra, args)
            results[label].append(row)
            tps, cpu, wakes = row["client_tokens_per_s"], row["api_cpu_ms"], row["api_voluntary"]
            print(
                f"start {i + 1}, {label}: {tps:.1f} tok/s, API {cpu:.3f} ms and {wakes:.2f} wake-ups a token",
                flush=True,
            )
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
