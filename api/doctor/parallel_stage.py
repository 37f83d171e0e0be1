"""Stage 7, parallel: the model sharded over `--tensor-parallel-size` ranks (`--expert-parallel`:
whole experts per rank), over `--pipeline-parallel-size` stages, and over both together (P x T
ranks) must give the single-process logits, within 1e-4 in float32.

The ranks are separate processes with the environment torchrun would give them
(`api/doctor/parallel_worker.py`, gloo on CPU, NCCL on CUDA), forked from a process that
imported torch once (`engine/distributed/forked.py`: 8 ranks for the three layouts); each runs
the fixed prompts and reports the checkpoint bytes it read and its time per step; under tensor
parallelism every rank reports logits, under pipeline parallelism global rank 0 does (the
logits come back to it).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from api.doctor.capture import rel_error
from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from api.doctor.tolerance import threshold
from engine.distributed.forked import run_ranks

TIMEOUT_S = 600
FLOAT32_LIMIT = 1e-4
PRELOAD = ("api.doctor.capture", "engine.loading.loader")  # what a rank imports besides torch


class Layout(NamedTuple):
    tensor_parallel: int
    stages: int

    @property
    def name(self) -> str:
        parts = ([f"PP={self.stages}"] if self.stages > 1 else []) + (
            [f"TP={self.tensor_parallel}"] if self.tensor_parallel > 1 else []
        )
        return " x ".join(parts)


def layouts(tensor_parallel: int, stages: int) -> list[Layout]:
    """What the flags ask to check: each kind alone, then both together."""
    out = [Layout(tensor_parallel, 1)] if tensor_parallel > 1 else []
    if stages > 1:
        out.append(Layout(1, stages))
        if tensor_parallel > 1:
            out.append(Layout(tensor_parallel, stages))
    return out


def launch(ctx: DoctorContext, out: Path, layout: Layout) -> list[dict[str, Any]]:
    opts = ctx.options
    n = layout.tensor_parallel * layout.stages
    env = {"LONGCTX_THREADS": str(opts.threads)} if opts.threads else {}
    argv = [str(ctx.loaded.source.path), str(out), "--world-size", str(layout.tensor_parallel),
            "--pipeline-size", str(layout.stages), "--dtype", ctx.dtype_name, "--device", opts.device,
            "--prompts", json.dumps(ctx.prompts)]  # fmt: skip
    if opts.expert_parallel and layout.tensor_parallel > 1:
        argv.append("--expert-parallel")
    logs = [out / f"rank{r}.log" for r in range(n)]  # files, not pipes: a full pipe would block the rank
    run_ranks("api.doctor.parallel_worker", argv, logs, TIMEOUT_S, env, preload=PRELOAD)
    return [torch.load(out / f"rank{r}.pt") for r in range(n)]


def parallel_stage(ctx: DoctorContext, st: StageResult) -> None:
    opts = ctx.options
    todo = layouts(opts.tensor_parallel_size, opts.pipeline_parallel_size)
    if not todo:
        st.skip("no --tensor-parallel-size or --pipeline-parallel-size of 2 or more")
        return
    limit = FLOAT32_LIMIT if ctx.dtype == torch.float32 else threshold(ctx.dtype)
    single = [c.logits for c in ctx.ours]
    rows = []
    worst = 0.0
    for layout in todo:
        with tempfile.TemporaryDirectory(prefix="longctx-doctor-") as tmp:
            try:
                results = launch(ctx, Path(tmp), layout)
            except RuntimeError as e:
                st.fail(f"the {layout.name} run failed: {e}")
                return
        for r, res in enumerate(results):
            pairs = zip(res["logits"], single, strict=True) if res["logits"] else ()  # PP: rank 0 has them
            errs = [rel_error(a.float(), b) for a, b in pairs]
            step = sorted(res["step_s"])[len(res["step_s"]) // 2]
            err: float | str = max(errs) if errs else "(on rank 0)"
            rows.append([layout.name, r, err, f"{int(res['bytes_read']) / 1e6:.1f} MB", step * 1000])
            worst = max(worst, *errs) if errs else worst
    mode = "expert parallel" if opts.expert_parallel else "tensor parallel"
    st.table(["layout", "rank", "logits err vs 1 process", "bytes read", "ms per step"], rows)
    st.data = {
        "rows": rows,
        "mode": mode,
        "world_size": opts.tensor_parallel_size,
        "pipeline_stages": opts.pipeline_parallel_size,
        "threshold": limit,
    }
    st.note(", ".join(layout.name for layout in todo) + (f" ({mode})" if opts.tensor_parallel_size > 1 else ""))
    if worst > limit:
        st.fail(f"sharded logits differ from the single process: relative error {worst:.2e} > {limit:.0e}")
