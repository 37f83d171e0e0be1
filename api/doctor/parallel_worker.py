"""One rank of the doctor's parallel stage (`python -m api.doctor.parallel_worker MODEL OUT ...`).

RANK, WORLD_SIZE and MASTER_* are set by the parent (as torchrun does). Every rank loads its
shard, runs the same fixed prompts in the same steps (the collectives pair up), and writes its
logits (pipeline parallel: rank 0 only), bytes read and step times to OUT/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from engine.distributed.launch import init_parallel, leave_together
from engine.loading.loader import load
from engine.model_runner import Chunk


def main(argv: list[str]) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out", type=Path)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--pipeline-size", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    args = p.parse_args(argv)
    from api.doctor.capture import PAGE_SIZE, runner_for

    t0 = time.perf_counter()
    ctx, watchdog = init_parallel(args.world_size, args.expert_parallel, args.device, pipeline_size=args.pipeline_size)
    print(f"rank {ctx.global_rank}: group ready after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    loaded = load(args.model, args.dtype, args.device, progress=False, parallel=ctx)
    print(f"rank {ctx.global_rank}: loaded after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    prompts: list[list[int]] = json.loads(args.prompts)
    runner, pool = runner_for(loaded.model, max(len(x) for x in prompts))
    logits, times = [], []
    for ids in prompts:
        pages = pool.allocate(-(-len(ids) // PAGE_SIZE))
        t0 = time.perf_counter()
        out = runner.run([Chunk(ids, pages, len(ids))], all_logits=True).cpu()
        times.append(time.perf_counter() - t0)
        if out.numel():  # a pipeline stage other than rank 0's gets none
            logits.append(out)
        pool.free(pages)
    result = {"logits": logits, "bytes_read": loaded.stats.bytes_read, "step_s": times, "comm_bytes": ctx.comm.total}
    torch.save(result, args.out / f"rank{ctx.global_rank}.pt")
    leave_together(watchdog)


if __name__ == "__main__":
    main(sys.argv[1:])
