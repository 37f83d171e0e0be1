"""`longctx route` as a subprocess for the router tests, and reading its `/metrics`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ROOT, free_port


def router_metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, replica label or "") -> value of the router's `/metrics`."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            out[(s.name, s.labels.get("replica", ""))] = s.value
    return out


def wait_router(base: str, proc: subprocess.Popen[bytes], replicas_up: int) -> None:
    """Until the router's `/ready` counts `replicas_up` replicas in rotation (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            r = httpx.get(base + "/ready", timeout=1)
            if r.status_code == 200 and r.json()["replicas_up"] == replicas_up:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)


def start_router(*args: str, log: Path | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """`longctx route` on a free port with `args` (its output into `log`): its base URL and process."""
    port = free_port()
    cmd = [sys.executable, "-m", "api.cli", "route", "--port", str(port), *args]
    with open(log or os.devnull, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)
