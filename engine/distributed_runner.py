"""Rank 0 schedules, every rank computes: the step plan is broadcast before each forward pass.

Only rank 0 holds a scheduler, a block pool and the requests; the other ranks hold their shard
of the model and of the KV cache (the same pages, their own heads) and replay each step's
plan, a list of `Chunk`s, exactly as rank 0 runs it. Logits are gathered on every rank (the
vocabulary-parallel head), but only rank 0 samples, so nothing comes back from the workers.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.attention.registry import make_backend
from engine.distributed.launch import Watchdog
from engine.distributed.parallel import ParallelContext
from engine.model.model import CausalLM
from engine.model_runner import Chunk, ModelRunner, build_kernels
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

log = logging.getLogger("longctx.distributed")


class DistributedRunner(ModelRunner):
    """Rank 0's runner: announces the KV layout once, then broadcasts each step's plan and runs
    its own shard of it. Call `shutdown` to release the workers."""

    def __init__(self, runner: ModelRunner, parallel: ParallelContext, watchdog: Watchdog | None = None):
        super().__init__(runner.model, runner.kv_cache, runner.backend)
        assert parallel.is_driver
        self.parallel = parallel
        self.watchdog = watchdog
        spec = runner.kv_cache.spec
        parallel.broadcast_object(("init", runner.kv_cache.num_pages, spec.page_size, spec.dtype, runner.backend.name))

    def run(self, chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        try:
            # A page table may be a view of a request's table: send only its live pages.
            sent = [dataclasses.replace(c, page_table=_own(c.page_table)) for c in chunks]
            self.parallel.broadcast_object(("run", sent, all_logits))
            return super().run(chunks, all_logits)
        except RuntimeError as e:  # gloo: a peer closed its socket; name it rather than the socket
            if self.watchdog is not None:
                self.watchdog.explain(e)
            raise

    def shutdown(self) -> None:
        self.parallel.broadcast_object(("stop",))


def _own(pages: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
    return pages.clone() if isinstance(pages, torch.Tensor) else pages


def serve_worker(model: CausalLM, parallel: ParallelContext, watchdog: Watchdog | None = None) -> int:
    """A non-zero rank's loop: build the KV shard rank 0 announces, then run every plan it
    broadcasts until it says stop. Returns the number of steps run."""
    try:
        return _serve(model, parallel)
    except RuntimeError as e:
        if watchdog is not None:
            watchdog.explain(e)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()


def _serve(model: CausalLM, parallel: ParallelContext) -> int:
    assert not parallel.is_driver
    msg = parallel.broadcast_object()
    assert isinstance(msg, tuple) and msg[0] == "init", msg
    _, num_pages, page_size, dtype, backend_name = msg
    mc = model.config
    device = model.model.norm.weight.device
    spec = KVSpec(mc.num_layers, model.local_kv_heads, mc.head_dim, page_size, dtype)
    build_kernels(device)
    backend = make_backend(backend_name, device, model.local_heads, model.local_kv_heads, mc.head_dim)
    runner = ModelRunner(model, KVCache(spec, num_pages, device), backend)
    log.info("rank %d: KV shard of %d pages, %.1f MB", parallel.rank, num_pages, runner.kv_cache.num_bytes / 1e6)
    steps = 0
    while True:
        msg = parallel.broadcast_object()
        assert isinstance(msg, tuple)
        if msg[0] == "stop":
            return steps
        runner.run(msg[1], msg[2])
        steps += 1
