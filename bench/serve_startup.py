"""Seconds from `longctx serve` to `/health` and to `/ready`, by startup phase.

Runs the server on the demo model (default dtype) a few times in a temporary LONGCTX_HOME
(managed redis-server): the first run from a fresh copy of the GGUF, so it converts the
tokenizer and dequantizes the weights and writes the conversion cache beside the file; the
later runs read that cache. Each run's phases come from `/ready`, the model phase's own
split (config, weights, tokenizer) from the server's log. Prints a table and writes JSON to
bench/results/serve_startup.json. Note the machine's load average beside the numbers.

    python bench/serve_startup.py [--runs 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def one_run(gguf: Path, home: Path, dtype: str, log: Path) -> dict[str, Any]:
    import subprocess

    from tests.server import free_port, http_get, serve_command

    port = free_port()
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            serve_command(gguf, port, "bench", "--dtype", dtype), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "LONGCTX_HOME": str(home)},
        )  # fmt: skip
    health = None
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
            if health is None and http_get(f"http://127.0.0.1:{port}/health", 1.0)[0] == 200:
                health = time.perf_counter() - t0
            status, body = http_get(f"http://127.0.0.1:{port}/ready", 1.0)
            if status == 200:
                ready = time.perf_counter() - t0
                break
            time.sleep(0.02)
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    text = log.read_text()
    model_split = re.search(r"ready: loaded .*?\((.*?)\)\n", text)
    return {
        "health_s": round(health or 0.0, 2),
        "ready_s": round(ready, 2),
        "phases": body["phase_seconds"],
        "model_split": model_split.group(1) if model_split else "",
        "exit_code": code,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    from engine.loading.model_source import pull_demo

    demo = pull_demo()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lc-bench-", dir="/tmp") as tmp:
        home = Path(tmp)
        gguf = home / "model" / demo.name
        gguf.parent.mkdir()
        shutil.copy(demo, gguf)  # no conversion cache yet
        for i in range(args.runs):
            row = one_run(gguf, home, args.dtype, home / f"run{i}.log")
            row["run"] = "first (converts, writes the cache)" if i == 0 else "cached"
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
    print(f"{'run':<36} {'health':>7} {'ready':>7}  phases")
    for r in rows:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        print(
            f"{r['run']:<36} {r['health_s']:>7.2f} {r['ready_s']:>7.2f}  {phases}  (load avg {r['load_average']:.1f})"
        )
        print(f"{'':<52}model: {r['model_split']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve_startup.json").write_text(json.dumps({"dtype": args.dtype, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
