"""Starting the ranks of a sharded engine, and failing fast when one of them dies.

`torchrun` sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for every process; without it, the
process that was started (rank 0) re-executes its own command line N-1 times with those
variables set, so `longctx generate --tensor-parallel-size 2` needs nothing else. Gloo is
used on CPU and NCCL on CUDA.

A rank that dies mid-collective can leave the others blocked forever (NCCL) or until a long
timeout (gloo, which must tolerate an idle server), so liveness is watched separately: every
rank bumps a heartbeat counter in the rendezvous store, rank 0 also polls the processes it
spawned, and the first rank found dead (exited, or silent for `dead_after_s`) ends this
process with an error naming it. Rank 0 hosts the store, so its death ends the others too.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from engine.distributed.parallel import ParallelContext

log = logging.getLogger("longctx.launch")

# Collectives may legitimately wait this long: workers block in the plan broadcast while idle.
COLLECTIVE_TIMEOUT = timedelta(days=7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_env(world_size: int) -> dict[str, str]:
    """What torchrun sets alike for every rank of a group on this machine (a free port for the
    store rank 0 hosts); each rank adds its RANK and LOCAL_RANK."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size)}  # fmt: skip


def spawn_ranks(world_size: int) -> dict[int, subprocess.Popen[bytes]]:
    """Re-run this process's command line as ranks 1..N-1; this process becomes rank 0."""
    os.environ.update(rendezvous_env(world_size) | {"RANK": "0", "LOCAL_RANK": "0"})
    children = {}
    for r in range(1, world_size):
        env = os.environ | {"RANK": str(r), "LOCAL_RANK": str(r)}
        children[r] = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env)
        log.info("spawned rank %d (pid %d)", r, children[r].pid)
    return children


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Watchdog:
    """Heartbeats in the store; on a dead peer, logs which rank and exits this process (status 1)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        children: dict[int, subprocess.Popen[bytes]],
        dead_after_s: float = 10.0,
        interval_s: float = 0.5,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.children = children
        self.dead_after_s, self.interval_s = dead_after_s, interval_s
        self.stopping = threading.Event()
        self.on_fail: Callable[[str], None] | None = None  # told the reason before this process exits
        self._thread = threading.Thread(target=self._loop, name="longctx-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def explain(self, error: BaseException) -> None:
        """A collective failed (a peer's socket closed): give the watchdog time to name the dead
        rank and end the process; if no rank is found dead, return so the caller re-raises."""
        log.warning("collective failed (%s); checking which rank died", error)
        time.sleep(self.dead_after_s + 4 * self.interval_s)

    def stop(self) -> None:
        """Expected shutdown: ranks that exit from now on are not failures. Waits for the
        heartbeat thread to leave its loop, so that no store call of it is in flight when the
        process group (and then the process, whose exit would destroy the store under it) goes."""
        self.stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        beat = 0
        seen: dict[int, tuple[bytes, float]] = {}
        while not self.stopping.is_set():
            beat += 1
            try:
                self.store.set(f"longctx/hb/{self.rank}", str(beat))
            except Exception as e:  # the store lives in rank 0
                if self.stopping.is_set():  # rank 0 may leave first in an orderly shutdown
                    return
                self._fail(0, f"unreachable ({type(e).__name__}: {e})")
            for r, child in self.children.items():
                code = child.poll()
                if code is not None and not self.stopping.is_set():
                    self._fail(r, f"pid {child.pid} {describe_exit(code)}")
            if self.rank == 0:
                now = time.monotonic()
                for r in range(1, self.world_size):
                    key = f"longctx/hb/{r}"
                    value = self.store.get(key) if self.store.check([key]) else b""
                    if r not in seen or seen[r][0] != value:
                        seen[r] = (value, now)
                    elif now - seen[r][1] > self.dead_after_s and not self.stopping.is_set():
                        self._fail(r, f"no heartbeat for {now - seen[r][1]:.0f}s")
            self.stopping.wait(self.interval_s)

    def _fail(self, rank: int, why: str) -> None:
        msg = f"rank {rank} failed: {why}; stopping rank {self.rank}"
        log.error("%s", msg)
        print(f"longctx: error: {msg}", file=sys.stderr, flush=True)
        if self.on_fail is not None:
            try:
                self.on_fail(f"rank {rank} failed: {why}")
            except Exception:  # the process exits all the same
                log.exception("could not report the failure")
        for child in self.children.values():
            if child.poll() is None:
                child.kill()
        os._exit(1)


def init_parallel(
    world_size: int,
    expert_parallel: bool = False,
    device: str = "cpu",
    *,
    dead_after_s: float = 10.0,
    pipeline_size: int = 1,
    layer_split: tuple[int, ...] = (),
) -> tuple[ParallelContext, Watchdog]:
    """Join (or start, spawning the other ranks) a group of `pipeline_size` stages of
    `world_size` tensor-parallel ranks each; returns this rank's context and its running
    watchdog. On CPU, each rank gets an equal share of the cores unless torch's thread count
    was set explicitly (LONGCTX_THREADS or `--threads`)."""
    import torch.distributed as dist

    total = world_size * pipeline_size
    children = spawn_ranks(total) if "RANK" not in os.environ else {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != total:
        raise ValueError(
            f"launched with WORLD_SIZE={world} but --tensor-parallel-size {world_size} "
            f"x --pipeline-parallel-size {pipeline_size} = {total}"
        )
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts the store
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timedelta(seconds=120),
    )
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    if not cuda:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        threads = int(os.environ.get("LONGCTX_THREADS", "0")) or max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
    watchdog = Watchdog(store, rank, world, children, dead_after_s).start()
    log.info("rank %d of %d ready (%s)", rank, world, "nccl" if cuda else f"gloo, {torch.get_num_threads()} threads")
    if pipeline_size == 1:
        return ParallelContext(rank, world, expert_parallel, group=dist.group.WORLD), watchdog
    stage, tp_rank = divmod(rank, world_size)
    group = None
    for s in range(pipeline_size):  # every rank creates every stage's group, in the same order
        g = dist.new_group(list(range(s * world_size, (s + 1) * world_size)))
        group = g if s == stage else group
    ctx = ParallelContext(
        tp_rank, world_size, expert_parallel, group, stage, pipeline_size, layer_split, world=dist.group.WORLD
    )
    return ctx, watchdog


def leave_together(watchdog: Watchdog) -> None:
    """For ranks that each run to their own end (no driver telling them to stop): stop the
    watchdog, meet every other rank at a barrier (rank 0 holds the store: none leaves before all
    are done), then `finish_parallel`."""
    import torch.distributed as dist

    watchdog.stop()
    dist.barrier()
    finish_parallel(watchdog)


def finish_parallel(watchdog: Watchdog, timeout_s: float = 30.0) -> None:
    """Wait for spawned ranks to exit after an orderly shutdown, then leave the group."""
    import torch.distributed as dist

    watchdog.stop()
    for child in watchdog.children.values():
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
    if dist.is_initialized():
        dist.destroy_process_group()
