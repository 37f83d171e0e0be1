"""Stage 7, parallel: the model sharded over `--tensor-parallel-size` ranks (`--expert-parallel`:
whole experts per rank) must give the single-process logits, within 1e-4 in float32.

The ranks are separate processes started the way torchrun would (`api/doctor/parallel_worker.py`,
gloo on CPU, NCCL on CUDA); each runs the fixed prompts, reports its logits, the checkpoint bytes
it read and its time per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from api.doctor.capture import rel_error
from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from api.doctor.tolerance import threshold
from engine.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
FLOAT32_LIMIT = 1e-4


def launch(ctx: DoctorContext, out: Path) -> list[dict[str, Any]]:
    opts = ctx.options
    n = opts.tensor_parallel_size
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    env |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    }
    if opts.threads:
        env["LONGCTX_THREADS"] = str(opts.threads)
    cmd = [sys.executable, "-m", "api.doctor.parallel_worker", str(ctx.loaded.source.path), str(out),
           "--world-size", str(n), "--dtype", ctx.dtype_name, "--device", opts.device,
           "--prompts", json.dumps(ctx.prompts)]  # fmt: skip
    if opts.expert_parallel:
        cmd.append("--expert-parallel")
    logs = [out / f"rank{r}.log" for r in range(n)]
    procs = []
    for r in range(n):
        with open(logs[r], "wb") as log:  # a file, not a pipe: a full pipe would block the rank
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stderr=log))
    try:
        for r, p in enumerate(procs):
            p.wait(timeout=TIMEOUT_S)
            if p.returncode != 0:
                raise RuntimeError(f"rank {r} exited with {p.returncode}: {logs[r].read_text()[-1500:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(n)]


def parallel_stage(ctx: DoctorContext, st: StageResult) -> None:
    opts = ctx.options
    if opts.tensor_parallel_size < 2:
        st.skip("no --tensor-parallel-size of 2 or more")
        return
    with tempfile.TemporaryDirectory(prefix="longctx-doctor-") as tmp:
        try:
            results = launch(ctx, Path(tmp))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            st.fail(f"the sharded run failed: {e}")
            return
    limit = FLOAT32_LIMIT if ctx.dtype == torch.float32 else threshold(ctx.dtype)
    single = [c.logits for c in ctx.ours]
    rows = []
    worst = 0.0
    for r, res in enumerate(results):
        errs = [rel_error(a.float(), b) for a, b in zip(res["logits"], single, strict=True)]
        step = sorted(res["step_s"])[len(res["step_s"]) // 2]
        rows.append([r, max(errs), f"{int(res['bytes_read']) / 1e6:.1f} MB", step * 1000])
        worst = max(worst, *errs)
    mode = "expert parallel" if opts.expert_parallel else "tensor parallel"
    st.table(["rank", "logits err vs 1 process", "bytes read", "ms per step"], rows)
    st.data = {"rows": rows, "mode": mode, "world_size": opts.tensor_parallel_size, "threshold": limit}
    st.note(f"{opts.tensor_parallel_size} ranks, {mode}")
    if worst > limit:
        st.fail(f"sharded logits differ from the single process: relative error {worst:.2e} > {limit:.0e}")
