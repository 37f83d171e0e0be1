"""What the ranks of tests/test_forked_ranks.py run (`main(argv)`, as a rank module does)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    """argv: OUT and, per rank, what it does: `ok` (writes its environment's RANK, WORLD_SIZE and
    MARK to OUT/rank{r}.txt and a line to stderr), `fail` (exits 3), `hang` (sleeps)."""
    out, actions = Path(argv[0]), argv[1:]
    rank = int(os.environ["RANK"])
    action = actions[rank]
    if action == "hang":
        time.sleep(600)
    if action == "fail":
        print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
        raise SystemExit(3)
    (out / f"rank{rank}.txt").write_text(f"{rank} {os.environ['WORLD_SIZE']} {os.environ.get('MARK')} {sys.argv[1:]}")
    print(f"rank {rank} to its log", file=sys.stderr, flush=True)
