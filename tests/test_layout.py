"""The import rules of the layout (docs/layout.md), checked over every module's imports.

Every `import` and `from ... import` is read from the source (also those inside functions and
under `TYPE_CHECKING`), mapped to the project's package it names, and checked against an
explicit table of what may import what. A failure names the importing module and the import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.server import ROOT

PACKAGES = ("api", "sessions", "tools", "engine", "kvstore")

# Top-level packages: who may import whom (a package may always import itself).
ALLOWED = {
    "api": {"sessions", "tools", "engine", "kvstore"},  # the CLI drives the engine directly
    "sessions": {"tools", "engine", "kvstore"},
    "tools": {"engine"},
    "engine": {"kvstore"},
    "kvstore": set(),
}

# Inside engine/: the serving loop (modules at the top of engine/) may use every layer below it;
# the layers below never import the serving loop.
ENGINE_LAYERS = {
    "engine.model": {"engine.model", "engine.distributed.parallel", "engine.attention"},
    # (attention: int4's calibration pass runs the loaded model over a scratch KV cache)
    "engine.loading": {"engine.loading", "engine.model", "engine.distributed.parallel", "engine.attention"},
    "engine.distributed": {"engine.distributed"},
    "engine.attention": {"engine.attention"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of one of our packages."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] in PACKAGES]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import the module `imported`, or None when it may."""
    a, b = importer.split(".")[0], imported.split(".")[0]
    if a != b and b not in ALLOWED[a]:
        return f"{a} may not import {b}"
    for layer, allowed in ENGINE_LAYERS.items():
        if _under(importer, layer) and b == "engine" and not any(_under(imported, ok) for ok in allowed):
            return f"{layer} may import only {', '.join(sorted(allowed))}"
    return None


def test_imports_follow_the_layout() -> None:
    known = _modules()
    problems = []
    for module, path in known.items():
        for imported, line in _imports(module, path):
            target = imported if imported in known else imported.rsplit(".", 1)[0]
            if target not in known:
                continue  # a name imported from a module (`from engine.x import Name`)
            why = _violation(module, target)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target} ({why})")
    assert not problems, "\n".join(problems)


def test_no_import_circle() -> None:
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for imported, _ in _imports(module, path):
            target = imported if imported in known else imported.rsplit(".", 1)[0]
            # Packages' __init__ files hold only docstrings: an edge to one is no circle.
            if target in known and target != module and known[target].name != "__init__.py":
                graph[module].add(target)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = [*stack[stack.index(n) :], n]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_rules_catch_a_bad_import() -> None:
    """The checker itself: each kind of forbidden import is named, allowed ones pass."""
    assert _violation("engine.model.model", "engine.scheduling.scheduler") == (
        "engine.model may import only engine.attention, engine.distributed.parallel, engine.model"
    )
    assert _violation("engine.model.rope", "engine.distributed.launch")
    assert _violation("engine.loading.loader", "engine.engine")
    assert _violation("engine.attention.base", "engine.model.model")
    assert _violation("kvstore.tiers", "engine.engine") == "kvstore may not import engine"
    assert _violation("engine.engine", "sessions.store") == "engine may not import sessions"
    assert _violation("tools.grammar", "api.cli") == "tools may not import api"
    assert _violation("engine.model.moe", "engine.model.layers") is None
    assert _violation("engine.loading.weights", "engine.distributed.parallel") is None
    assert _violation("engine.engine", "engine.model.model") is None
    assert _violation("api.cli", "engine.engine") is None


def test_no_module_shadows_the_standard_library() -> None:
    """`python bench/x.py` puts bench/ first on the import path, so a `bench/http.py` there once hid
    the standard library's `http` from torch's imports; no script folder may use such a name."""
    root = Path(__file__).resolve().parent.parent
    clashes = [
        str(f.relative_to(root))
        for folder in ("bench", "tests", "api", "sessions", "engine", "kvstore", "tools")
        for f in (root / folder).rglob("*.py")
        if f.stem in sys.stdlib_module_names
    ]
    assert not clashes, f"these files shadow standard-library modules: {clashes}"


def test_engine_top_level_stays_small() -> None:
    """The serving loop's top level holds its few nouns; the scheduler's parts live in
    `engine/scheduling/`, the sampler's in `engine/sampling/`, the engine process in `engine/process/`."""
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(top) <= 16, f"engine/ has {len(top)} top-level files: {top}"
