"""`engine/distributed/forked.py`: ranks forked from a process that imported torch once get their
own environment, stderr and exit status, and a rank that fails or hangs is named while the
others are killed, not waited for."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.distributed.forked import run_ranks, start_ranks, wait_ranks

MODULE = "tests.forked_rank_main"


def _logs(tmp_path: Path, n: int) -> list[Path]:
    return [tmp_path / f"rank{r}.log" for r in range(n)]


def test_each_rank_gets_its_environment_argv_and_log(tmp_path: Path) -> None:
    logs = _logs(tmp_path, 3)
    argv = [str(tmp_path), "ok", "ok", "ok"]
    run_ranks(MODULE, argv, logs, timeout_s=120, env={"MARK": "m1"})
    for r in range(3):
        assert (tmp_path / f"rank{r}.txt").read_text() == f"{r} 3 m1 {argv}"
        assert logs[r].read_text().strip().endswith(f"rank {r} to its log")
    assert "MARK" not in os.environ  # the parent's environment is not touched


def test_a_failed_rank_is_named_and_a_hung_one_killed(tmp_path: Path) -> None:
    logs = _logs(tmp_path, 2)
    procs = start_ranks(MODULE, [str(tmp_path), "hang", "fail"], logs)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with 3: .*rank 1 fails on purpose"):
        wait_ranks(procs, logs, timeout_s=300)
    assert time.monotonic() - t0 < 60  # not the hung rank 0's timeout
    assert procs[0].exitcode is not None and procs[0].exitcode < 0  # killed


def test_a_rank_past_the_deadline_is_named(tmp_path: Path) -> None:
    logs = _logs(tmp_path, 2)
    procs = start_ranks(MODULE, [str(tmp_path), "ok", "hang"], logs)
    with pytest.raises(RuntimeError, match=r"rank 1 did not finish within 5 s"):
        wait_ranks(procs, logs, timeout_s=5)
    assert procs[0].exitcode == 0 and procs[1].exitcode is not None and procs[1].exitcode < 0
