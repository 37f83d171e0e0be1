"""The compiled step's buckets, compiled in the background while the engine already serves.

`serve` answers from the eager step as soon as the model is loaded and the engine built: every
bucket starts pending (`CompiledStep.pending`: it runs eager). Buckets whose graphs are already in
the graph store (a warm start) are ready at once; the others are compiled by a child process at
the lowest CPU priority (`engine/process/compiler.py`), which stores their graphs and names each
bucket as it is done. Between two steps the engine loop switches in one ready bucket at a time:
its graphs bound from the store (no dynamo, no inductor in the engine process), then the
self-check against the eager modules (`engine/verify/self_check.py`); a bucket that fails it, or
whose graphs did not reach the store, or that the compiler could not compile, stays eager with
an ERROR naming why. The start never waits for, or fails for, a bucket.

Why a process and not a thread: dynamo and inductor are not made for tracing on one thread
while another runs the model (global config, the compile lock, the GIL held through tracing), and
a child at the lowest priority leaves the cores to the requests served meanwhile.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from typing import IO

from engine.model.compiled import CompiledStep
from engine.verify.self_check import CompileReport, safe_check

log = logging.getLogger("longctx.compile")


class BackgroundCompile:
    """Drives the background compiler and switches its buckets in (on the engine loop's thread).

    Args:
        step: the engine's compiled step; `buckets` become pending on it.
        page_size: the KV page size (the self-check's scratch caches).
        buckets: the buckets to compile and check.
        spec_path: the engine process's `LoadSpec` file (the compiler loads the same model).
    """

    def __init__(self, step: CompiledStep, page_size: int, buckets: tuple[int, ...], spec_path: str):
        self.step, self.page_size = step, page_size
        self.started = time.perf_counter()
        self.report = CompileReport(pending=sorted(buckets))
        step.pending |= set(buckets)
        self.arrived: queue.SimpleQueue[tuple[int, str | None]] = queue.SimpleQueue()  # (bucket, why not)
        stored = [b for b in buckets if step.stored(b)]
        for b in stored:
            self.arrived.put((b, None))
        missing = [b for b in buckets if b not in stored]
        self.proc: subprocess.Popen[str] | None = None
        if missing:
            cmd = [sys.executable, "-m", "engine.process.compiler", spec_path, str(page_size), *map(str, missing)]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            assert self.proc.stdout is not None
            reader = threading.Thread(
                target=self._read, args=(self.proc, self.proc.stdout, missing), name="longctx-compiler", daemon=True
            )
            reader.start()
        log.info(
            "compiled step: %d buckets' graphs stored, %d compiling in the background%s; eager until each is checked",
            len(stored), len(missing), f" (process {self.proc.pid})" if self.proc else "",
        )  # fmt: skip

    def _read(self, proc: subprocess.Popen[str], out: IO[str], missing: list[int]) -> None:
        """The compiler's lines as arrivals; a bucket it never named arrives with why."""
        named: set[int] = set()
        for line in out:
            word, _, rest = line.strip().partition(" ")
            bucket_s, _, why = rest.partition(" ")
            if not bucket_s.isdigit():
                continue
            bucket = int(bucket_s)
            named.add(bucket)
            if word == "stored":
                self.arrived.put((bucket, None))
            elif word == "unstored":
                self.arrived.put((bucket, "its graphs could not be kept in the graph store"))
            else:
                self.arrived.put((bucket, f"compiling failed: {why}"))
        code = proc.wait()
        for bucket in missing:
            if bucket not in named:
                self.arrived.put((bucket, f"the compiler process exited with code {code}"))

    def ready(self) -> bool:
        """A bucket is waiting to be switched in (cheap: the engine loop asks every iteration)."""
        return not self.arrived.empty()

    def switch_in(self) -> None:
        """Settle one arrived bucket: checked and compiled, or eager with why."""
        bucket, why = self.arrived.get_nowait()
        step, report = self.step, self.report
        t0 = time.perf_counter()
        if why is None and not step.stored(bucket):
            why = "its graphs are not in the graph store"
        step.pending.discard(bucket)
        if why is None:
            report.add(step, safe_check(step, bucket, self.page_size))
        else:
            report.fail(step, bucket, why)
        report.pending.remove(bucket)
        report.check_s += time.perf_counter() - t0
        if report.done:
            report.compile_s = time.perf_counter() - self.started
            log.info("every compiled bucket settled %.1fs after the engine started serving", report.compile_s)
            report.log_summary()
            self.close()

    def close(self) -> None:
        """Stop the compiler if it still runs (the engine is stopping)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
