"""The order the two pytest workers take the test modules in: longest first (`--dist loadfile`
hands out whole modules; started last, a module of several minutes leaves the other worker idle
at the end). The seconds are each module's share of a cold run (every cache empty: kernels,
inductor, graph store) on the 2-core development machine, 2026-12-02; a module not listed costs
`PER_TEST_S` a test. Only the order depends on them: a stale figure costs time, never a test."""

from __future__ import annotations

import pytest

PER_TEST_S = 0.3
COSTS = {
    "test_served_paths.py": 480, "test_api_chat.py": 300, "test_doctor.py": 230, "test_serve_sharded.py": 130,
    "test_cli.py": 130, "test_parallel.py": 125, "test_quantization.py": 70, "test_replicas.py": 65,
    "test_background_compile.py": 65, "test_recovery.py": 60, "test_serve.py": 60, "test_compaction.py": 55,
    "test_agent_protocol.py": 55, "test_bad_input.py": 50, "test_wheel.py": 46, "test_router.py": 40,
    "test_gguf.py": 36, "test_replicas_kill_random.py": 32, "test_pipeline.py": 30, "test_grammar.py": 30,
}  # fmt: skip


def order_longest_first(items: list[pytest.Item]) -> None:
    """Sort `items` in place, module by module, longest module first (a stable sort: the tests
    of a module keep their order)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    cost = {name: COSTS.get(name, n * PER_TEST_S) for name, n in counts.items()}
    items.sort(key=lambda item: (-cost[item.path.name], item.path.name))
