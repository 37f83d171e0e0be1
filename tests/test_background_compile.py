"""The compiled step's buckets compiled in the background (`engine/process/background_compile.py`):
the engine process answers at once from the eager step, a low-priority child process compiles the
buckets into the graph store, and the engine switches each in after its self-check; a bucket
whose graphs do not reach the store stays eager with why; a second start binds every bucket from
the store without the child. The engine process runs on the tiny model in a `LONGCTX_HOME` of
its own (its graph store empty at first), inductor's cache and the kernels kept in the pytest
cache across sessions."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine_config import EngineConfig
from engine.loading.model_source import longctx_home
from engine.model.compile_setup import compile_available
from engine.process.client import EngineClient
from engine.process.main import LoadSpec
from engine.sampling_params import SamplingParams
from tests.compile_cache import INDUCTOR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(compile_available() is not None, reason=f"cannot compile: {compile_available()}"),
]
CONFIG = EngineConfig(kv_cache_bytes=4 << 20, threads=1, compile=True)
WAIT_S = 600.0  # a cold compile of three graphs on 2 busy cores


@pytest.fixture(scope="module")
def home(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh LONGCTX_HOME: an empty graph store; the tests' one inductor cache
    (`tests.compile_cache`), the kernels of the run."""
    home = tmp_path_factory.mktemp("home")
    (home / "compile").mkdir()
    INDUCTOR.mkdir(parents=True, exist_ok=True)
    (home / "compile" / "inductor").symlink_to(INDUCTOR)
    (home / "kernels").symlink_to(longctx_home() / "kernels")  # the run's one build (tests/conftest.py)
    before = os.environ.get("LONGCTX_HOME")
    os.environ["LONGCTX_HOME"] = str(home)  # the engine process inherits it, and its compiler
    yield home
    if before is None:
        os.environ.pop("LONGCTX_HOME", None)
    else:
        os.environ["LONGCTX_HOME"] = before


def _start(model: Path, buckets: list[int]) -> tuple[EngineClient, object]:
    spec = LoadSpec(load=dict(spec=str(model), dtype="float32", progress=False), config=CONFIG, threads=1)
    client = EngineClient(spec)
    loaded = client.wait_phase("loaded", timeout_s=120)
    client.tokenizer = loaded.tokenizer
    client.build(None, "t:kv", check_buckets=buckets, background=True)
    return client, loaded


def _graphs(home: Path) -> dict[str, int]:
    """The stored graphs' libraries and their change times (a graph stored again is a new file)."""
    return {p.name: p.stat().st_mtime_ns for p in (home / "compile" / "graphs").glob("*.so")}


def test_serves_eager_at_once_then_switches_buckets_in(tiny_model: Path, home: Path) -> None:
    client, loaded = _start(tiny_model, [1, 2, 3])
    try:
        report = client.wait_phase("compiled", timeout_s=60)
        assert report.pending == [1, 2, 3] and report.checks == [] and not report.done  # nothing waited for
        ids = loaded.tokenizer.encode("Hello there")  # type: ignore[attr-defined]
        outs = list(client.add_request(ids, SamplingParams(max_tokens=4, temperature=0)))
        # the child process has not even imported torch yet: the request ran on the eager step
        assert outs[-1].finish_reason is not None and not outs[-1].error and not client.compiled.is_set()
        assert client.compiled.wait(WAIT_S), "the background compile never settled"
        report = client.compile_report
        assert report.done and report.compiled_buckets == [1, 2], report
        # 3 is no bucket: the child compiles a padded step of bucket 4, so no graph of 3 tokens is stored
        assert list(report.eager) == [3] and "graph store" in report.eager[3], report.eager
        assert all(c.ok for c in report.checks if c.bucket in (1, 2))
        again = list(client.add_request(ids, SamplingParams(max_tokens=4, temperature=0)))
        assert again[-1].token_ids and not again[-1].error  # served by the compiled buckets now
    finally:
        client.shutdown()
    stored = _graphs(home)
    assert stored, "the child stored no graph"
    client, _ = _start(tiny_model, [1, 2])  # a warm start: every graph in the store, no child
    try:
        assert client.compiled.wait(WAIT_S)
        assert client.compile_report.compiled_buckets == [1, 2] and not client.compile_report.eager
    finally:
        client.shutdown()
    assert _graphs(home) == stored  # bound from the store: nothing compiled or stored again
