"""The sharding tests' ranks (`tests/parallel_ranks.py`, `tests/vision_ranks.py`), forked from a
process that imported torch, dynamo and the rank modules once (`engine/distributed/forked.py`)
instead of each importing them again: a dozen launches of two to four ranks in
`tests/test_parallel.py`, `tests/test_pipeline.py` and `tests/test_vision_parallel.py`. What
`longctx generate` and `serve` spawn themselves is tested as users run it, not through here."""

from __future__ import annotations

from pathlib import Path

from engine.distributed.forked import start_ranks, wait_ranks

# Dynamo and inductor for the compiled modes: about 2 s a rank otherwise.
PRELOAD = ("torch._dynamo", "torch._inductor.compile_fx", "tests.parallel_ranks", "tests.vision_ranks")


def run_ranks(module: str, argv: list[str], env: dict[str, str], logs: list[Path], timeout_s: float) -> None:
    """Ranks 0..len(logs)-1 running `module.main(argv)` with `env` (plus each one's RANK and
    LOCAL_RANK) as their whole environment, stderr to their logs; fails naming a rank that failed."""
    procs = start_ranks(module, argv, env, logs, preload=PRELOAD)
    try:
        wait_ranks(procs, logs, timeout_s)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None
