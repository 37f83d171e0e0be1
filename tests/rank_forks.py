"""The sharding tests' ranks (`tests/parallel_ranks.py`, `tests/vision_ranks.py`), forked from a
process that imported torch, dynamo and the rank modules once (`engine/distributed/forked.py`)
instead of each importing them again: a dozen launches of two to four ranks in
`tests/test_parallel.py`, `tests/test_pipeline.py` and `tests/test_vision_parallel.py`. What
`longctx generate` and `serve` spawn themselves is tested as users run it, not through here."""

from __future__ import annotations

from pathlib import Path

from engine.distributed import forked

# Dynamo and inductor for the compiled modes: about 2 s a rank otherwise.
PRELOAD = ("torch._dynamo", "torch._inductor.compile_fx", "tests.parallel_ranks", "tests.vision_ranks")


def run_ranks(module: str, argv: list[str], logs: list[Path], env: dict[str, str], timeout_s: float) -> None:
    """`engine.distributed.forked.run_ranks` with these preloads: ranks 0..len(logs)-1 of one
    group, `env` added to their environment, stderr to their logs; fails naming a rank that failed."""
    forked.run_ranks(module, argv, logs, timeout_s, env, preload=PRELOAD)
