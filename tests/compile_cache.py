"""The tests' one inductor cache: `$LONGCTX_HOME/compile/inductor` of the default home, where the
servers, `generate` runs and doctors the tests start keep theirs. Every module that compiles in
the worker (tests/test_compile.py, tests/test_served_paths.py, ...), the tensor-parallel ranks
and the engine processes of temporary homes use it, so a graph compiled once, by any of them, in
this run or an earlier one on this machine, is found by the others (inductor's cache is keyed by
the graph, its inputs' shapes, the compile options, torch and the CPU; concurrent writers are
safe). Each keeps its own graph store (`engine.model.graph_store`): what a test binds is what it
compiled or stored itself."""

from __future__ import annotations

from pathlib import Path

from engine.loading.model_source import longctx_home
from engine.model.compile_setup import configure

INDUCTOR = longctx_home() / "compile" / "inductor"


def configure_compile(graphs: Path) -> Path:
    """`engine.model.compile_setup.configure` with the shared inductor cache and this graph store."""
    return configure(longctx_home(), graphs)
