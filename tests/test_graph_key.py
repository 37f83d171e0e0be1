"""The graph store's key names the linear kernels the tracing process had loaded: a region traced
without them calls torch's own ops in their place (`_weight_int8pack_mm` for int8, where ours
multiply by VNNI), so such a graph must never be bound by a process that has them. The
background compiler loads them before tracing (`tests/test_background_compile.py`: its graphs
are found by the engine process, which has them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.attention import cpu_kernel
from engine.model import regions
from engine.model.graph_store import GraphStore


@pytest.mark.parametrize("op", ["_linear_bf16", "_linear_int8", "_int8_vnni"])
def test_the_key_changes_with_the_kernels_loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, op: str) -> None:
    store = GraphStore(tmp_path)
    signature = ("x", (1, 64), "torch.bfloat16")
    key = store.key(regions.pre_attention, signature)
    assert store.key(regions.pre_attention, signature) == key
    loaded = bool(getattr(cpu_kernel, op))
    # the other state: loaded where this process has it, missing where it has not
    other: object = (not loaded) if op == "_int8_vnni" else (None if loaded else cpu_kernel.loaded)
    monkeypatch.setattr(cpu_kernel, op, other)
    assert store.key(regions.pre_attention, signature) != key
