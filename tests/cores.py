"""Threads per engine in the tests: this machine's cores shared among pytest-xdist's workers.

Two OpenMP teams of 2 threads on 2 cores wait at every barrier for a thread the other team's work
has descheduled: under the suite's load a 512-token bf16 prefill ran at 22 tok/s with 2 threads
and 147 tok/s with 1. So with 2 workers on 2 cores each engine (in a worker, in a server or an
engine process it starts) gets 1 thread, and `OMP_NUM_THREADS` says so to every subprocess that
does not choose its own; tests of thread placement pass their own counts."""

from __future__ import annotations

import os

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
THREADS_ARG = str(THREADS)  # for `--threads`
