"""The background compiler: `python -m engine.process.compiler SPEC PAGE_SIZE BUCKET...`.

A child of the engine process (`background_compile.py`), at the lowest CPU priority (nice 19 and
`SCHED_IDLE`, one torch thread, one inductor compile thread), so the requests the engine serves
meanwhile keep the cores. It loads the same model as the engine (`LoadSpec.load`: same dtype,
quantization, layouts, hence the same graph signatures), builds a `CompiledStep` on it and
compiles each bucket (`CompiledStep.warm_up`), which keeps every graph in the graph store
(`$LONGCTX_HOME/compile/graphs`). After each bucket it prints one line on stdout:
`stored B` (every graph of bucket B is in the store), `unstored B` (compiled, but some graph could
not be stored) or `failed B WHY`. Dynamo and inductor run only here, on this process's main thread:
the engine process binds the stored graphs without tracing (`engine/model/direct.py`).

It dies with its parent (Linux's parent-death signal) and exits 0 after the last bucket.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys


def _lowest_priority() -> None:
    os.nice(19)
    with contextlib.suppress(AttributeError, OSError):  # not Linux: nice alone
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    spec_path, page_size, *buckets = argv
    _die_with_parent()
    _lowest_priority()
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # one compile thread, no worker pool
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s [compiler] %(message)s"
    )
    logging.getLogger("longctx").setLevel(spec.log_level)
    import torch

    torch.set_num_threads(1)
    from engine.loading.loader import load
    from engine.loading.model_source import longctx_home
    from engine.model.compile_setup import configure
    from engine.model.compiled import CompiledStep
    from engine.model_runner import build_kernels

    loaded = load(**spec.load)
    # The kernels the engine's regions call (the int8 and bf16 linears'): traced without them, a
    # region would call torch's own ops in their place.
    build_kernels(next(loaded.model.parameters()).device)
    configure(longctx_home())
    step = CompiledStep(loaded.model)
    for b in map(int, buckets):
        try:
            step.warm_up(int(page_size), (b,))
            line = f"{'stored' if step.stored(b) else 'unstored'} {b}"
        except Exception as e:  # the engine keeps this bucket eager and logs why
            logging.getLogger("longctx.compile").exception("compiling bucket %d failed", b)
            line = f"failed {b} {type(e).__name__}: {e}".replace("\n", " ")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
