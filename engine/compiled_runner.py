"""Switching a `ModelRunner` to the compiled step (`engine/model/compiled.py`)."""

from __future__ import annotations

import logging

from engine.loading.model_source import longctx_home
from engine.model.compile_setup import configure
from engine.model.compiled import CompiledStep
from engine.model_runner import ModelRunner

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
