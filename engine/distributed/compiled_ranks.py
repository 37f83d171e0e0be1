"""The compiled step on a tensor-parallel engine: every rank compiles and self-checks the same
buckets, in step.

Each rank runs its own shard's graphs, the all-reduces eager between them
(`engine/model/compiled.py`). A bucket's self-check runs the eager model and the compiled step,
and both communicate, so every rank checks the same buckets in the same order when rank 0 says
so: its `DistributedRunner.check_compiled` broadcasts the buckets, then checks its own. A bucket
that fails on any rank runs eager on every rank (the report names the rank), so a bucket the
report calls compiled is compiled everywhere.

This happens at start, before the engine serves: the single-process server's background compiler
(`engine/process/background_compile.py`) is a child process, which cannot take part in the
checks' collectives. The graphs go to the same graph store and inductor cache, so a second start
only binds and checks them.
"""

from __future__ import annotations

from engine.distributed.parallel import ParallelContext
from engine.model.compiled import CompiledStep
from engine.verify.self_check import CompileReport, warm_up_and_check


def check_in_step(
    step: CompiledStep, page_size: int, buckets: tuple[int, ...], parallel: ParallelContext
) -> CompileReport:
    """Compile and self-check `buckets` on this rank, then agree with the other ranks: a bucket
    any rank failed runs eager here too. Every rank calls it with the same buckets."""
    report = warm_up_and_check(step, page_size, buckets)
    mine = dict(report.eager)
    for rank, failed in enumerate(parallel.all_gather_object(mine)):
        assert isinstance(failed, dict)
        for bucket, why in sorted(failed.items()):
            if bucket not in report.eager:
                report.fail(step, bucket, f"on rank {rank}: {why}")
    return report
