"""Rank 0 schedules, every rank computes: the step plan is broadcast before each forward pass.

Only rank 0 holds a scheduler, a block pool and the requests; the other ranks hold their shard
of the model and of the KV cache (the same pages, their own heads and layers) and replay each
step's plan, a list of `Chunk`s, exactly as rank 0 runs it. Logits are gathered on every rank
(the vocabulary-parallel head), but only rank 0 samples, so nothing else comes back from the
workers; with pipeline stages the last stage sends them to rank 0 (`engine/distributed/pipeline.py`)
and the plan carries the step's micro-batches.
With the host or Redis KV tiers, each rank keeps its own slices of the pages; the connector's
operations travel with the plan (`engine/distributed/kv_shards.py`). With the compiled step
every rank compiles and self-checks the buckets when rank 0 says so (`check_in_step`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.attention.registry import make_backend
from engine.compiled_runner import attach
from engine.distributed.kv_shards import ShardOps, ShardStore
from engine.distributed.launch import Watchdog
from engine.distributed.parallel import ParallelContext
from engine.distributed.pipeline import micro_batches
from engine.engine_config import EngineConfig
from engine.kv_tiers import build_tiers, kv_namespace
from engine.model.compiled import CompiledStep
from engine.model.model import CausalLM
from engine.model_runner import Chunk, ModelRunner, build_kernels
from engine.verify.self_check import CompileReport, step_inputs, warm_up_and_check
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

log = logging.getLogger("longctx.distributed")


class DistributedRunner(ModelRunner):
    """Rank 0's runner: announces the KV layout once, then broadcasts each step's plan and runs
    its own shard of it. Call `shutdown` to release the workers."""

    def __init__(
        self,
        runner: ModelRunner,
        parallel: ParallelContext,
        watchdog: Watchdog | None = None,
        config: EngineConfig | None = None,
    ):
        """`config`: the engine's settings, when it has KV tiers (each rank then builds its own)."""
        super().__init__(runner.model, runner.kv_cache, runner.backend)
        assert parallel.is_driver
        self.parallel = parallel
        self.watchdog = watchdog
        self.ops = ShardOps(parallel)  # the KV connector's operations for the other ranks
        spec = runner.kv_cache.spec
        init = ("init", runner.kv_cache.num_pages, spec.page_size, spec.dtype, runner.backend.name, config)
        parallel.broadcast_object(init)

    def run(self, chunks: list[Chunk], all_logits: bool = False, bounds: list[int] | None = None) -> torch.Tensor:
        try:
            # A page table may be a view of a request's table: send only its live pages.
            sent = [dataclasses.replace(c, page_table=_own(c.page_table)) for c in chunks]
            if self.parallel.pipelined and bounds is None:  # every stage splits the step alike
                tokens = [len(c.token_ids) for c in chunks]
                bounds = micro_batches(tokens, self.parallel.pp_size, self.max_micro_batches)
            self.parallel.broadcast_object(("run", sent, all_logits, self.ops.take(), bounds))
            return super().run(chunks, all_logits, bounds)
        except RuntimeError as e:  # gloo: a peer closed its socket; name it rather than the socket
            if self.watchdog is not None:
                self.watchdog.explain(e)
            raise

    def check_compiled(self, buckets: tuple[int, ...] | None = None) -> CompileReport | None:
        """Compile and self-check the compiled step's `buckets` (None: all it compiles) on every
        rank, in step (`check_in_step`); None when this engine runs eager."""
        if not isinstance(self.step, CompiledStep):
            return None
        buckets = self.step.buckets if buckets is None else buckets
        page = self.kv_cache.spec.page_size
        self.parallel.broadcast_object(("compile", page, buckets))
        return check_in_step(self.step, page, buckets, self.parallel)

    def shutdown(self) -> None:
        self.ops.flush()  # the last step's pages still go to the other ranks' tiers
        self.parallel.broadcast_object(("stop",))


def check_in_step(
    step: CompiledStep, page_size: int, buckets: tuple[int, ...], parallel: ParallelContext
) -> CompileReport:
    """Compile and self-check `buckets` on this rank, then agree with the other ranks: a bucket
    any rank failed runs eager here too. Every rank calls it with the same buckets.

    Each rank runs its own shard's graphs (its stage's layers; under tensor parallelism the
    all-reduces eager between them). A bucket's self-check runs the eager model and the compiled
    step, which both communicate under tensor parallelism, so every rank checks the same buckets
    in the same order when rank 0 says so (`DistributedRunner.check_compiled`). A bucket that
    fails on any rank runs eager on every rank (the report names the rank), so a bucket the
    report calls compiled is compiled everywhere. This happens before the engine serves: the
    single-process server's background compiler (`engine/process/background_compile.py`) is a
    child process, which cannot take part in the checks' collectives. The graphs go to the same
    graph store and inductor cache, so a second start only binds and checks them. A later
    pipeline stage checks its buckets on the hidden states the stages before it computed
    (`stage_check_inputs`), as it runs when serving."""
    hidden = stage_check_inputs(step, page_size, buckets, parallel)  # (eager: no compile to wait on)
    report = warm_up_and_check(step, page_size, buckets, hidden)
    for rank, failed in enumerate(parallel.all_gather_object(dict(report.eager))):
        assert isinstance(failed, dict)
        for bucket, why in sorted(failed.items()):
            if bucket not in report.eager:
                report.fail(step, bucket, f"on rank {rank}: {why}")
    return report


@torch.inference_mode()
def stage_check_inputs(
    step: CompiledStep, page_size: int, buckets: tuple[int, ...], parallel: ParallelContext
) -> dict[int, torch.Tensor]:
    """Per bucket, this stage's self-check input from the stage before it: the first stage runs
    the check's fixed token ids through its eager layers and sends the hidden states on, each
    later stage receives them, runs them through its own and sends those on (each rank to its
    tensor-parallel peer, as steps go). Empty on the first stage (its input is the token ids).
    The residual stream in mid-model runs in the hundreds (RMS 135-1080 on the demo model):
    a check on small synthetic states erred about twice as much (4.7e-2 against 1.8e-2 on the
    demo's second half in bf16, the bound 5e-2)."""
    if not parallel.pipelined:
        return {}
    model = step.model
    dtype, device = model.model.norm.weight.dtype, model.model.norm.weight.device
    hidden: dict[int, torch.Tensor] = {}
    sends = []
    for bucket in buckets:
        if not parallel.first_stage:
            src = parallel.stage_rank(parallel.pp_rank - 1)
            hidden[bucket] = parallel.recv((bucket, model.config.hidden_size), dtype, device, src)
        if not parallel.last_stage:
            x, meta, caches, backend = step_inputs(step, bucket, page_size, hidden.get(bucket))
            out = model(x, meta, caches, backend)
            sends.append((parallel.send(out, parallel.stage_rank(parallel.pp_rank + 1)), out))
    for request, _ in sends:
        request.wait()
    return hidden


def _own(pages: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
    return pages.clone() if isinstance(pages, torch.Tensor) else pages


def serve_worker(
    model: CausalLM, parallel: ParallelContext, watchdog: Watchdog | None = None, fingerprint: str = ""
) -> int:
    """A non-zero rank's loop: build the KV shard rank 0 announces, then run every plan it
    broadcasts until it says stop. Returns the number of steps run. `fingerprint`: the digest
    of this rank's weights (`LoadStats.fingerprint`), which names its pages in the KV tiers."""
    try:
        return _serve(model, parallel, fingerprint)
    except RuntimeError as e:
        if watchdog is not None:
            watchdog.explain(e)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()


def _serve(model: CausalLM, parallel: ParallelContext, fingerprint: str) -> int:
    assert not parallel.is_driver
    msg = parallel.broadcast_object()
    assert isinstance(msg, tuple) and msg[0] in ("init", "stop"), msg
    if msg[0] == "stop":  # rank 0 stopped before building its engine
        return 0
    _, num_pages, page_size, dtype, backend_name, config = msg
    mc = model.config
    device = model.model.norm.weight.device
    spec = KVSpec(len(model.stage_layers), model.local_kv_heads, mc.head_dim, page_size, dtype)
    build_kernels(device)
    backend = make_backend(backend_name, device, model.local_heads, model.local_kv_heads, mc.head_dim)
    runner = ModelRunner(model, KVCache(spec, num_pages, device), backend)
    if config is not None and config.compile:  # rank 0's runner has it too: both attach alike
        attach(runner, config.compile_buckets)
    log.info(
        "rank %d: KV shard of %d pages, %d layers, %.1f MB",
        parallel.global_rank,
        num_pages,
        len(model.stage_layers),
        runner.kv_cache.num_bytes / 1e6,
    )
    tiers = None
    if config is not None and (config.host_cache_bytes or config.kv_redis_url):
        namespace = kv_namespace(model, spec, config.kv_dtype, fingerprint, parallel)
        tiers = ShardStore(build_tiers(runner.kv_cache, namespace, config), parallel, config.kv_lookup_timeout_s)
    steps = 0
    try:
        while True:
            msg = parallel.broadcast_object()
            assert isinstance(msg, tuple)
            if msg[0] == "stop":
                return steps
            if msg[0] == "compile":
                if not isinstance(runner.step, CompiledStep):
                    raise RuntimeError(f"rank {parallel.global_rank}: asked to compile, but its step runs eager")
                check_in_step(runner.step, msg[1], msg[2], parallel)
                continue
            if msg[0] == "ops":
                assert tiers is not None, "KV operations without tiers"
                tiers.apply(msg[1])
                continue
            if msg[3]:
                assert tiers is not None, "KV operations without tiers"
                tiers.apply(msg[3])
            runner.run(msg[1], msg[2], msg[4])
            steps += 1
    finally:
        if tiers is not None:
            tiers.close()
