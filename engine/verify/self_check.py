"""The compiled step's self-check: every compiled bucket against the eager modules on one fixed
input, before it serves.

It runs once per bucket before the bucket serves (`longctx serve`: as each bucket's graphs arrive
from the background compiler, `engine/process/background_compile.py`; `longctx generate`: at
start, for the buckets it will use): a prefill of `bucket` fixed tokens through the compiled step and through
the eager model, each over a scratch KV cache, and compares the logits (relative error against
`bounds.compiled_bound`). While it runs, each region call is also recomputed by the region's
plain function on the same arguments, so a failing bucket names its worst region and layer. A
bucket over the bound runs eager from then on (`CompiledStep.eager_buckets`), with an ERROR
naming the region, bucket and error; the start never fails for it.

What it catches: a kernel or graph that computes something else on this CPU (a layout, a bound
weight, a lowering). What it cannot catch: rounding ties (the LM head's float32 logits remove
those, `engine/model/head.py`), or faults only other inputs reach.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_paged import TorchPagedBackend
from engine.model.compiled import CompiledStep
from engine.verify.agreement import rel_error
from engine.verify.bounds import compiled_bound

log = logging.getLogger("longctx.compile")


@dataclass(frozen=True)
class BucketCheck:
    """One bucket's comparison: the logits' relative error and the worst region's."""

    bucket: int
    error: float
    bound: float
    region: str  # "layer 3 post_attention"
    region_error: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound  # False for NaN / inf too


@dataclass
class CompileReport:
    """What the compile phase did: seconds compiling (or loading graphs), seconds checking, and
    per bucket its check; `eager` names the buckets that run eager, with why."""

    compile_s: float = 0.0
    check_s: float = 0.0
    checks: list[BucketCheck] = field(default_factory=list)
    eager: dict[int, str] = field(default_factory=dict)
    # Buckets compiling in the background (`engine/process/background_compile.py`): eager until
    # their graphs are stored and checked.
    pending: list[int] = field(default_factory=list)

    @property
    def compiled_buckets(self) -> list[int]:
        return sorted(c.bucket for c in self.checks if c.ok and c.bucket not in self.eager)

    @property
    def done(self) -> bool:
        """Every bucket is settled: compiled, or eager for a reason in `eager`."""
        return not self.pending

    def add(self, step: CompiledStep, check: BucketCheck) -> None:
        """Record `check`; a bucket over its bound runs eager from now on (logged as an ERROR)."""
        self.checks.append(check)
        if not check.ok:
            why = f"logits error {check.error:.2e} > {check.bound:.0e}; worst {check.region} ({check.region_error:.2e})"
            self.fail(step, check.bucket, why)

    def fail(self, step: CompiledStep, bucket: int, why: str) -> None:
        """`bucket` runs eager from now on, for `why`."""
        step.eager_buckets[bucket] = self.eager[bucket] = why
        log.error("compiled step bucket %d fails its self-check (%s): running it eager", bucket, why)

    def log_summary(self) -> None:
        worst = max(self.checks, key=lambda c: c.error / c.bound, default=None)
        largest = ""
        if worst is not None:
            largest = f"; largest logits error {worst.error:.1e} (bucket {worst.bucket}, bound {worst.bound:.0e})"
        log.info(
            "self-checked %d compiled buckets in %.2fs: %d eager%s",
            len(self.checks), self.check_s, len(self.eager), largest,
        )  # fmt: skip


def _ids(bucket: int, vocab: int) -> torch.Tensor:
    """Fixed, spread token ids (no special tokens at the ends of the vocabulary)."""
    return (torch.arange(bucket, dtype=torch.int64) * 7919 + 101) % max(vocab - 256, 1)


def step_inputs(step: CompiledStep, bucket: int, page_size: int, hidden: torch.Tensor | None = None) -> tuple[Any, ...]:
    """The check's step of `bucket` tokens: (input, metadata, scratch KV caches, backend). The
    input is the fixed token ids, or for a later pipeline stage `hidden` (the previous stage's
    eager output on them, `engine/distributed_runner.stage_check_inputs`), else fixed hidden
    states of an embedding's scale (real ones run in the hundreds: a check on these errs more)."""
    m = step.model
    cfg = m.config
    norm = m.model.norm.weight
    pages = -(-bucket // page_size)
    caches = [
        torch.zeros(pages, 2, page_size, m.local_kv_heads, cfg.head_dim, dtype=norm.dtype, device=norm.device)
        for _ in step.layers  # this pipeline stage's layers
    ]
    meta = AttentionMetadata.build([list(range(pages))], [bucket], [bucket], page_size, norm.device)
    backend = TorchPagedBackend(m.local_heads, m.local_kv_heads, cfg.head_dim)
    backend.plan(meta)
    if m.parallel.first_stage:
        inputs = _ids(bucket, cfg.vocab_size)
    elif hidden is not None:
        inputs = hidden.clone()
    else:
        g = torch.Generator().manual_seed(bucket)
        inputs = 0.05 * torch.randn(bucket, cfg.hidden_size, generator=g).to(norm.dtype)
    return inputs.to(norm.device), meta, caches, backend


@torch.inference_mode()
def check_bucket(step: CompiledStep, bucket: int, page_size: int, hidden: torch.Tensor | None = None) -> BucketCheck:
    """The compiled step at `bucket` against the eager model on the fixed input (`step_inputs`)."""
    dtype = step.model.model.norm.weight.dtype
    ids, meta, caches, backend = step_inputs(step, bucket, page_size, hidden)
    eager = step.model(ids, meta, caches, backend)  # [bucket, V] float32 ([bucket, hidden] before the last stage)
    ids, meta, caches, backend = step_inputs(step, bucket, page_size, hidden)
    worst = ("", 0.0)

    def observe(_bucket: int, layer: int, which: int, args: tuple[Any, ...], out: Any) -> None:
        nonlocal worst
        fn = step.regions[which].fn
        ref = fn(*args)
        err = max(rel_error(a, b) for a, b in zip(_tensors(out), _tensors(ref), strict=True))
        if not err <= worst[1]:  # (NaN and inf included)
            worst = (f"layer {layer} {fn.__name__}", err)

    step.observer = observe
    try:
        by_region = step(ids, meta, caches, backend)
    finally:
        step.observer = None
    ids, meta, caches, backend = step_inputs(step, bucket, page_size, hidden)
    direct = step(ids, meta, caches, backend)  # the bound graphs as steps call them
    error = max(rel_error(by_region, eager), rel_error(direct, eager))
    return BucketCheck(bucket, error, compiled_bound(dtype), *worst)


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple | list) else (out,)
    flat: list[torch.Tensor] = []
    for x in items:
        flat.extend(_tensors(x) if isinstance(x, tuple | list) else [x])
    return flat


def safe_check(step: CompiledStep, bucket: int, page_size: int, hidden: torch.Tensor | None = None) -> BucketCheck:
    """`check_bucket`, a graph that raises counting as one that fails its check."""
    try:
        return check_bucket(step, bucket, page_size, hidden)
    except Exception as e:
        return BucketCheck(bucket, float("inf"), compiled_bound(step.model.model.norm.weight.dtype), str(e), 0.0)


def warm_up_and_check(
    step: CompiledStep,
    page_size: int,
    buckets: tuple[int, ...] | None = None,
    hidden: dict[int, torch.Tensor] | None = None,
) -> CompileReport:
    """Compile (or load) `buckets`' graphs (default: the step's), then check each (a later
    pipeline stage on `hidden[bucket]`, its input); a bucket over its bound runs eager."""
    buckets = step.buckets if buckets is None else buckets
    report = CompileReport(compile_s=step.warm_up(page_size, buckets))
    t0 = time.perf_counter()
    for bucket in buckets:
        report.add(step, safe_check(step, bucket, page_size, (hidden or {}).get(bucket)))
    report.check_s = time.perf_counter() - t0
    report.log_summary()
    return report
