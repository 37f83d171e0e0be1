"""Rank processes for the sharding tests, forked from a process that imported torch and the
engine once (multiprocessing's forkserver, those modules preloaded), instead of each rank
importing them again: about 2-3 s of CPU per rank on two loaded cores, a dozen launches of two to
four ranks in `tests/test_parallel.py` and `tests/test_pipeline.py`.

A rank gets what a torchrun-started process gets: its own environment (RANK, WORLD_SIZE,
MASTER_*), stderr to its log file, the exit status of its `main`. What `longctx generate` and
`serve` spawn themselves (`engine/distributed/launch.py`, the command line run again) is tested
as users run it, not through here.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path

# Imported once by the fork server (dynamo and inductor for the compiled modes: about 2 s a rank).
PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "tests.parallel_ranks", "tests.vision_ranks"]
_context: ForkServerContext | None = None


def context() -> ForkServerContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _rank_main(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: the rank's environment and stderr, then its module's `main(argv)`."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)


def run_ranks(module: str, argv: list[str], env: dict[str, str], logs: list[Path], timeout_s: float) -> None:
    """Ranks 0..len(logs)-1 running `module.main(argv)`, each with `env` plus its RANK/LOCAL_RANK
    as its whole environment and stderr to its log; returns when all exited 0, else fails naming
    the rank (with its log's tail). `timeout_s` is for a hang, not speed."""
    procs = []
    for r, log in enumerate(logs):
        rank_env = env | {"RANK": str(r), "LOCAL_RANK": str(r)}
        proc = context().Process(target=_rank_main, args=(module, argv, rank_env, str(log)), daemon=False)
        proc.start()
        procs.append(proc)
    try:
        for r, proc in enumerate(procs):
            proc.join(timeout=timeout_s)
            assert proc.exitcode == 0, f"rank {r} failed ({proc.exitcode}):\n{logs[r].read_text()[-3000:]}"
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
