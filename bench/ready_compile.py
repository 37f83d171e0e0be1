"""Ready in seconds: `longctx serve`'s time to `/ready` with the compiled step's buckets compiling
in the background, and what that compile costs the requests served meanwhile.

Two starts of `longctx serve --compile` on the demo model (default dtype, shared test Redis):
- cold: a fresh `LONGCTX_HOME` whose `compile/` (graph store and inductor cache) is empty; the
  model file, its conversion cache and the attention kernels are linked from the usual home;
- warm: the same home again, every graph now stored.
For each: seconds from the command to `/ready` 200, and to every bucket settled
(`/ready?wait_compiled_s=...`). In the cold start, greedy single-stream chat completions run back
to back for `--during-s` seconds while buckets still compile, then `--after` more once all are
compiled: decode tokens/s of each (streamed chunks after the first over their time). The texts
are compared with the last one after the compile: eager and compiled bf16 steps may round
differently (a speed figure counts only beside what it generated). Prints a table and writes
JSON to bench/results/ready_compile.json. Run it under the exclusive lock.

    python bench/ready_compile.py [--during-s 30] [--after 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
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
PROMPT = "Write a long story about a dragon and its treasure."
REDIS = "redis://127.0.0.1:6379/15"


def chat(url: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed completion: decode tokens/s after the first chunk, and its text."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    times, parts = [], []
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=max_tokens,
        stream=True,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else 0.0
    return {"tok_s": round(rate, 2), "chunks": len(times), "text": "".join(parts)}


def compiling(url: str) -> list[int]:
    from tests.server import http_get

    return list(http_get(url + "/ready", 10.0)[1].get("compiling_buckets") or [])  # type: ignore[call-overload]


def start(gguf: Path, home: Path, log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """The server, and the seconds from its command to `/ready` 200."""
    from tests.server import free_port, http_get, serve_command

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(gguf, port, f"bench-ready-{os.getpid()}", "--compile", "--redis-url", REDIS,
                        "--served-model-name", "demo", "--background-workers", "0")  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "LONGCTX_HOME": str(home)}
        )
    while http_get(url + "/ready", 1.0)[0] != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.05)
    return proc, url, time.perf_counter() - t0


def one_start(gguf: Path, home: Path, log: Path, during_s: float, after: int, max_tokens: int) -> dict[str, Any]:
    from tests.server import http_get

    t0 = time.perf_counter()
    proc, url, ready_s = start(gguf, home, log)
    row: dict[str, Any] = {"ready_s": round(ready_s, 2), "during": [], "after": []}
    try:
        row["compiling_at_ready"] = compiling(url)
        end = time.perf_counter() + during_s
        while time.perf_counter() < end and compiling(url):
            r = chat(url, max_tokens)
            r["compiling_after"] = compiling(url)
            row["during"].append(r)
        _, body = http_get(url + "/ready?wait_compiled_s=900", 910.0)
        row["all_compiled_s"] = round(time.perf_counter() - t0, 2)
        row["compiled_buckets"], row["eager_buckets"] = body.get("compiled_buckets"), body.get("eager_buckets")
        row["after"] = [chat(url, max_tokens) for _ in range(after)]
    finally:
        proc.terminate()
        row["exit_code"] = proc.wait(timeout=60)
    ref = row["after"][-1]["text"] if row["after"] else None
    for r in row["during"] + row["after"]:
        r["same_text"] = r["text"] == ref
    return row


def _median(rows: list[dict[str, Any]]) -> float:
    return statistics.median(r["tok_s"] for r in rows) if rows else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--during-s", type=float, default=30.0, help="seconds of requests while buckets compile")
    p.add_argument("--after", type=int, default=3, help="requests once every bucket is compiled")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(RESULTS / "ready_compile.json"))
    args = p.parse_args()
    from engine.loading.model_source import longctx_home, pull_demo

    gguf = pull_demo()
    source = longctx_home()
    results: dict[str, Any] = {"load_average": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="lc-bench-ready-", dir="/tmp") as tmp:
        home = Path(tmp)
        for name in ("models", "kernels"):  # everything but compile/: the graph store starts empty
            if (source / name).exists():
                (home / name).symlink_to(source / name)
        for run in ("cold", "warm"):
            during = args.during_s if run == "cold" else 0.0
            results["runs"][run] = one_start(gguf, home, home / f"{run}.log", during, args.after, args.max_tokens)
            print((home / f"{run}.log").read_text()[-1500:], file=sys.stderr)
    cols = ("ready s", 8), ("all compiled s", 15), ("tok/s during (n)", 17), ("tok/s after", 12), ("same text", 10)
    print(f"{'start':<6}" + "".join(f" {c:>{w}}" for c, w in cols))
    for run, r in results["runs"].items():
        rows = r["during"] + r["after"]
        same = f"{sum(x['same_text'] for x in rows)}/{len(rows)}"
        during = f"{_median(r['during']):.1f} ({len(r['during'])})" if r["during"] else "-"
        after = _median(r["after"])
        print(f"{run:<6} {r['ready_s']:>8.1f} {r['all_compiled_s']:>15.1f} {during:>17} {after:>12.1f} {same:>10}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
