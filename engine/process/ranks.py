"""A sharded model in the engine process: the process the API started is rank 0, and spawns the
other ranks itself (each re-runs `python -m engine.process.main` with RANK set), or joins a group
`torchrun` started (then every process has RANK in its environment).

Rank 0 keeps what the engine process always does (the channel to the API process, the
scheduler, sampling) and drives the others through a `DistributedRunner`; ranks 1..N-1 talk to
no one but rank 0 (the channel's socket is not inherited by them): they
load their shard and replay each step (`serve_worker`) until rank 0 says stop. A rank that dies
ends rank 0 through the watchdog, which first tells the API process which rank it was
(`wire.Failed`), so the server's error names it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.distributed.launch import Watchdog
    from engine.distributed.parallel import ParallelContext
    from engine.model.model import CausalLM
    from engine.model_runner import ModelRunner

log = logging.getLogger("longctx.engine")


def world_size(spec: Any) -> int:
    """Ranks the spec asks for (1: one process)."""
    return int(spec.tensor_parallel_size * spec.pipeline_parallel_size)


def is_worker(spec: Any) -> bool:
    """Whether this process is rank 1..N-1 of a sharded engine (it then opens no channel)."""
    return world_size(spec) > 1 and os.environ.get("RANK", "0") != "0"


def join(spec: Any) -> tuple[ParallelContext, Watchdog | None]:
    """This process's place: one process, or a rank of the group (rank 0 spawns the others
    unless torchrun did). Threads per rank: `spec.threads` when given, else cores / N."""
    from engine.distributed.parallel import SINGLE

    if world_size(spec) == 1:
        if spec.expert_parallel:
            raise ValueError("--expert-parallel needs --tensor-parallel-size of 2 or more")
        return SINGLE, None
    import torch

    from engine.distributed.launch import init_parallel
    from engine.distributed.parallel import parse_layer_split

    parallel, watchdog = init_parallel(
        spec.tensor_parallel_size,
        spec.expert_parallel,
        spec.load.get("device", "cpu"),
        pipeline_size=spec.pipeline_parallel_size,
        layer_split=parse_layer_split(spec.pipeline_layer_split),
    )
    if spec.threads:
        torch.set_num_threads(spec.threads)
    return parallel, watchdog


def on_rank_failure(watchdog: Watchdog, channel: Any) -> None:
    """Before the watchdog ends this process, tell the API process which rank failed and why
    (on the process's channel, waiting up to 2 s for the message to leave: the process exits
    right after)."""
    from engine.process import wire
    from engine.process.channel import ChannelClosed

    def tell(reason: str) -> None:
        with contextlib.suppress(ChannelClosed):
            channel.send(wire.encoder.encode(wire.Failed(reason)))
            channel.flush(2.0)

    watchdog.on_fail = tell


def driver_runner(model: CausalLM, config: Any, parallel: ParallelContext, watchdog: Watchdog | None) -> ModelRunner:
    """Rank 0's runner: its own shard's, broadcasting each step to the others."""
    from engine.distributed_runner import DistributedRunner
    from engine.model_runner import ModelRunner

    local = ModelRunner.for_model(model, config.page_size, config.kv_cache_bytes, config.attention_backend)
    return DistributedRunner(local, parallel, watchdog, config)


def stop_workers(runner: Any, parallel: ParallelContext, watchdog: Watchdog | None) -> None:
    """Rank 0's orderly end: tell the other ranks to stop (or, before the engine was built,
    that there will be none), wait for them, leave the group."""
    if not parallel.distributed:
        return
    from engine.distributed.launch import finish_parallel

    if runner is not None and hasattr(runner, "shutdown"):
        runner.shutdown()
    else:
        parallel.broadcast_object(("stop",))
    if watchdog is not None:
        finish_parallel(watchdog)


def worker_main(spec: Any) -> int:
    """Rank 1..N-1: load this rank's shard, then replay rank 0's steps until it says stop."""
    from engine.distributed.launch import finish_parallel
    from engine.distributed_runner import serve_worker
    from engine.loading.loader import load

    parallel, watchdog = join(spec)
    loaded = load(**spec.load, parallel=parallel)
    log.info("rank %d: shard loaded (%.1f MB read)", parallel.global_rank, loaded.stats.bytes_read / 1e6)
    steps = serve_worker(loaded.model, parallel, watchdog, loaded.stats.fingerprint)
    log.info("rank %d: stopped after %d steps", parallel.global_rank, steps)
    if watchdog is not None:
        finish_parallel(watchdog)
    return 0
