"""The int4 load caches of a test in a directory of its own, and a count of what a load
computed instead of reading (`engine/loading/calibration_cache.py`, `engine/loading/int4_cache.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine.loading.calibration_cache as calibration_cache
import engine.loading.int4_cache as int4_cache


def caches_in(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Calibrations and int4 codes under `root` instead of `$LONGCTX_HOME`."""
    monkeypatch.setattr(calibration_cache, "longctx_home", lambda: root)
    monkeypatch.setattr(int4_cache, "longctx_home", lambda: root)


def counted(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Replace `owner.name` by a wrapper that appends to the returned list at each call."""
    calls: list[int] = []
    fn = getattr(owner, name)

    def wrapper(*args: Any) -> Any:
        calls.append(1)
        return fn(*args)

    monkeypatch.setattr(owner, name, wrapper)
    return calls
