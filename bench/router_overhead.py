"""What `longctx route` adds to time to first token: one replica (the demo model), the router
in front of it, and the same streamed request (a short prompt, cached after the first) sent
alternately straight to the replica and through the router, in one run, each over a kept-alive
connection. Prints the p50/p95 TTFT of each and the difference, and writes
bench/results/router_overhead.json.

    python bench/router_overhead.py [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from sess_common import loadavg, pct  # noqa: E402


def ttft(client: Any, base: str) -> float:
    body = {"model": "demo", "input": "Say hello.", "stream": True, "temperature": 0, "max_output_tokens": 2,
            "store": False}  # fmt: skip
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def main() -> None:
    import httpx

    from engine.loading.model_source import pull_demo
    from tests.redis_server import private_redis
    from tests.server import free_port, start_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="each way")
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="router-bench-"))
    with private_redis() as url:
        args = ("--redis-url", url, "--dtype", "float32", "--threads", "2", "--background-workers", "0",
                "--served-model-name", "demo")  # fmt: skip
        server = start_server(pull_demo(), *args, log=logs / "r.log")
        port = free_port()
        cmd = [sys.executable, "-m", "api.cli", "route", "--port", str(port), "--replica", server.url]
        router = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(base + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            client = httpx.Client()  # kept-alive connections both ways, as a real client has
            for _ in range(3):  # warm both paths (connections, the prefix cache)
                ttft(client, server.url), ttft(client, base)
            direct, routed = [], []
            for _ in range(a.requests):
                direct.append(ttft(client, server.url))
                routed.append(ttft(client, base))
        finally:
            router.terminate()
            router.wait(10)
            server.stop()
    out = {"requests": a.requests, "loadavg": loadavg(),
           "direct_p50_ms": pct(direct, 0.5) * 1e3, "direct_p95_ms": pct(direct, 0.95) * 1e3,
           "routed_p50_ms": pct(routed, 0.5) * 1e3, "routed_p95_ms": pct(routed, 0.95) * 1e3}  # fmt: skip
    out["added_p50_ms"] = out["routed_p50_ms"] - out["direct_p50_ms"]
    print(f"{a.requests} requests each way, alternating; load {out['loadavg']}")
    print(f"{'path':8} {'TTFT p50':>10} {'p95':>10}")
    print(f"{'direct':8} {out['direct_p50_ms']:>8.1f}ms {out['direct_p95_ms']:>8.1f}ms")
    print(f"{'routed':8} {out['routed_p50_ms']:>8.1f}ms {out['routed_p95_ms']:>8.1f}ms")
    print(f"added by the router, p50: {out['added_p50_ms']:.1f} ms")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "router_overhead.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
