"""Switching a `ModelRunner` to the compiled step (`engine/model/compiled.py`), and checking its
buckets before serving."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.loading.model_source import longctx_home
from engine.model.compile_setup import configure
from engine.model.compiled import CompiledStep
from engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from engine.verify.self_check import CompileReport

log = logging.getLogger("longctx.compile")


def attach(runner: object, buckets: tuple[int, ...] | None = None) -> CompiledStep | None:
    """Give a `ModelRunner` the compiled step, its graphs cached under `$LONGCTX_HOME/compile`
    (buckets compile at first use, or all at once in `CompiledStep.warm_up`). A sharded rank's
    runner (rank 0's `DistributedRunner` included) gets its shard's step: its stage's layers, the
    all-reduces eager between the graphs. `buckets`: the step sizes compiled (None: all).
    Non-CPU devices stay eager, with a warning."""
    if not isinstance(runner, ModelRunner) or runner.device.type != "cpu":
        log.warning("the compiled step runs on CPU; running eager")
        return None
    configure(longctx_home())
    step = CompiledStep(runner.model, buckets)
    runner.step = step
    return step


def check_compiled(runner: object, buckets: tuple[int, ...] | None = None) -> CompileReport | None:
    """Compile and self-check the compiled step's `buckets` (None: all it compiles) before serving:
    a sharded engine's on every rank in step (`DistributedRunner.check_compiled`), one process's
    here (`warm_up_and_check`); a bucket that fails runs eager. None when the runner runs eager."""
    from engine.distributed_runner import DistributedRunner
    from engine.verify.self_check import warm_up_and_check

    step = getattr(runner, "step", None)
    if not isinstance(runner, ModelRunner) or not isinstance(step, CompiledStep):
        return None
    chosen = step.buckets if buckets is None else buckets
    if isinstance(runner, DistributedRunner):
        return runner.check_compiled(chosen)
    return warm_up_and_check(step, runner.kv_cache.spec.page_size, chosen)
