"""The order the two pytest workers take the test modules in: longest first (`--dist loadfile`
hands out whole modules; started last, a module of several minutes leaves the other worker idle
at the end). The seconds are each module's test-seconds in a cold run (every cache empty:
kernels, inductor, graph store) on a 2-core AVX-512 machine, 2026-12-04, for every module of 10 s
or more; a module not listed costs `PER_TEST_S` a test. Only the order depends on them: a stale
figure costs time, never a test."""

from __future__ import annotations

import pytest

PER_TEST_S = 0.3
COSTS = {
    "test_served_paths.py": 207, "test_doctor.py": 198, "test_api_chat.py": 197, "test_serve_sharded.py": 171,
    "test_parallel.py": 161, "test_cli.py": 96, "test_pipeline.py": 88, "test_recovery.py": 70,
    "test_serve.py": 67, "test_quantization.py": 65, "test_replicas.py": 64, "test_compaction.py": 52,
    "test_wheel.py": 47, "test_router.py": 43, "test_compile.py": 43, "test_agent_protocol.py": 41,
    "test_session_service.py": 37, "test_replicas_kill_random.py": 29, "test_serve_restart.py": 25,
    "test_scheduler_random.py": 24, "test_kv_lookup_deadline.py": 23, "test_background_compile.py": 23,
    "test_core_process.py": 20, "test_redis_tier.py": 19, "test_grammar.py": 19,
    "test_scheduler_pressure.py": 17, "test_router_ws.py": 17, "test_cluster.py": 16, "test_gguf.py": 15,
    "test_bad_input.py": 15, "test_weights.py": 13, "test_vision_parallel.py": 13, "test_vision_api.py": 12,
    "test_api_responses.py": 12, "test_replicas_random.py": 11, "test_vision_serving.py": 10,
    "test_detokenizer.py": 10,
}  # fmt: skip


def order_longest_first(items: list[pytest.Item]) -> None:
    """Sort `items` in place, module by module, longest module first (a stable sort: the tests
    of a module keep their order)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    cost = {name: COSTS.get(name, n * PER_TEST_S) for name, n in counts.items()}
    items.sort(key=lambda item: (-cost[item.path.name], item.path.name))
