"""Ranks forked from a process that imported torch once, for a command that starts a group of
ranks itself and waits for their results (the doctor's parallel stage; the sharding tests).

Each rank of such a group used to be a new interpreter importing torch (and dynamo where it
compiles) again: 2-3 s of CPU per rank, 8 ranks for the doctor's TP=2, PP=2 and PP=2 x TP=2.
Here they are children of multiprocessing's fork server, a fresh interpreter that imports the
`preload` modules once and forks a rank per request; it has run no torch operation and started
no OpenMP or CUDA context, so forking it is safe. A rank still gets what torchrun would give a
process: its own environment (RANK, WORLD_SIZE, MASTER_*, set here for the whole group), stderr
to its own log, the exit status of its `main`. Ranks that run a server (`longctx serve`,
`generate`) are started by `engine/distributed/launch.py` as before (the command line run again,
or under torchrun).

The fork server is one per process: the modules it preloads are those of every request made
before it started (a module it lacks is imported in the rank, as before).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
import time
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

from engine.distributed.launch import rendezvous_env

BASE_PRELOAD = ("torch",)
# What torchrun sets for one process; a group started here gets its own.
PER_PROCESS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")
_preload: list[str] = []


def _context(preload: tuple[str, ...]) -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    for module in (*BASE_PRELOAD, *preload):
        if module not in _preload:
            _preload.append(module)
    ctx.set_forkserver_preload(list(_preload))  # no effect once the server runs
    return ctx


def _rank_main(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: the rank's environment and stderr, then `module.main(argv)`."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)


def start_ranks(
    module: str, argv: list[str], logs: list[Path], env: dict[str, str] | None = None, preload: tuple[str, ...] = ()
) -> list[BaseProcess]:
    """Ranks 0..len(logs)-1 of one group running `module.main(argv)`, each with its stderr
    appended to its log and as its whole environment this process's (less torchrun's
    per-process variables, should this process have been started by it), `env`, the group's
    rendezvous (`launch.rendezvous_env`) and its RANK and LOCAL_RANK."""
    ctx = _context((*preload, module))
    inherited = {k: v for k, v in os.environ.items() if k not in PER_PROCESS}
    group = inherited | (env or {}) | rendezvous_env(len(logs))
    procs: list[BaseProcess] = []
    for r, log in enumerate(logs):
        rank_env = group | {"RANK": str(r), "LOCAL_RANK": str(r)}
        proc = ctx.Process(target=_rank_main, args=(module, argv, rank_env, str(log)), name=f"rank{r}")
        proc.start()
        procs.append(proc)
    return procs


def run_ranks(
    module: str,
    argv: list[str],
    logs: list[Path],
    timeout_s: float,
    env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
) -> None:
    """`start_ranks`, then `wait_ranks`: returns once every rank exited 0."""
    wait_ranks(start_ranks(module, argv, logs, env, preload), logs, timeout_s)


def wait_ranks(procs: list[BaseProcess], logs: list[Path], timeout_s: float) -> None:
    """Every rank's exit within `timeout_s` (a hang, not speed); raises RuntimeError naming the
    first rank seen to fail (the others are killed then, not waited for) or one still running at
    the deadline, with its log's tail."""
    deadline = time.monotonic() + timeout_s
    try:
        while running := [p for p in procs if p.exitcode is None]:
            left = deadline - time.monotonic()
            if left <= 0:
                r = procs.index(running[0])
                raise RuntimeError(f"rank {r} did not finish within {timeout_s:.0f} s: {_tail(logs[r])}")
            wait([p.sentinel for p in running], timeout=left)
            for r, proc in enumerate(procs):
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"rank {r} exited with {proc.exitcode}: {_tail(logs[r])}")
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=10)


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no log: {e})"
