"""How long the tests take as `make test` runs them: all of them, or only those that existed at an
earlier commit (so that a suite grown since can be held to an old budget).

    python bench/suite_time.py [--at COMMIT] [--workers 2]

With `--at`, the tests are the functions (and `Class::method`s) named `test*` in `tests/test_*.py`
at COMMIT that still exist under the same name in the same module, each with all its
parametrizations of today; the ones gone are listed. pytest runs as `make test` runs it (the same
workers, distribution, environment and plugins: `PYTEST_ENV` and `PYTEST_PLUGINS` in the
Makefile) in this checkout. Prints the wall time, the test-seconds (the sum of every test's
setup, call and teardown over both workers) and the modules that took longest; writes JSON to
bench/results/suite_time.json. Run it on an otherwise idle machine: timings are the point."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def test_names(source: str) -> list[str]:
    """`test*` functions and `Test*::test*` methods at a module's top level."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names += [
                f"{node.name}::{m.name}"
                for m in node.body
                if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and m.name.startswith("test")
            ]
    return names


def tests_at(commit: str) -> tuple[list[str], list[str]]:
    """(node ids of the tests at `commit` that exist today, those that do not)."""
    listed = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", commit, "tests"], cwd=ROOT, text=True)
    kept: list[str] = []
    gone: list[str] = []
    for path in listed.split():
        if not (Path(path).name.startswith("test_") and path.endswith(".py")):
            continue
        old = test_names(subprocess.check_output(["git", "show", f"{commit}:{path}"], cwd=ROOT, text=True))
        now_file = ROOT / path
        now = set(test_names(now_file.read_text())) if now_file.exists() else set()
        for name in old:
            (kept if name in now else gone).append(f"{path}::{name}")
    return kept, gone


def make_variable(name: str) -> str:
    """A variable of the Makefile, as `make` expands it."""
    out = subprocess.check_output(["make", "-s", "--no-print-directory", f"print-{name}"], cwd=ROOT, text=True)
    return out.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--at", help="only the tests that existed at this commit")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    ids, gone = tests_at(args.at) if args.at else (["tests"], [])
    env = dict(os.environ)
    for assignment in make_variable("PYTEST_ENV").split():
        key, _, value = assignment.partition("=")
        env[key] = value
    cmd = [sys.executable, "-m", "pytest", *make_variable("PYTEST_PLUGINS").split(), "-q", "-n", str(args.workers)]
    cmd += ["--dist", "loadfile", "--no-loadscope-reorder", "--durations=0", *ids]
    start = time.monotonic()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    by_module: dict[str, float] = {}
    for line in run.stdout.splitlines():
        if m := DURATION.match(line):
            module = m.group(3).split("::")[0]
            by_module[module] = by_module.get(module, 0.0) + float(m.group(1))
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    test_seconds = sum(by_module.values())
    print(f"tests: {'those at ' + args.at if args.at else 'all'} ({len(ids) if args.at else 'tests/'}"
          f"{' functions' if args.at else ''}); gone since: {len(gone)}")  # fmt: skip
    for name in gone:
        print(f"  gone: {name}")
    print(f"pytest: {summary}")
    print(f"| wall | test-seconds | workers |\n|---|---|---|\n| {wall:.0f} s | {test_seconds:.0f} s | {args.workers} |")
    print("\n| module | test-seconds |\n|---|---|")
    for module, seconds in sorted(by_module.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {module} | {seconds:.1f} |")
    out = ROOT / "bench" / "results" / "suite_time.json"
    out.parent.mkdir(exist_ok=True)
    record = {
        "at": args.at, "functions": len(ids) if args.at else None, "gone": gone, "wall_s": wall,
        "test_seconds": test_seconds, "summary": summary, "modules": by_module, "returncode": run.returncode,
        "commit": subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip(),
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    if run.returncode != 0:
        print(run.stdout[-4000:], run.stderr[-2000:], sep="\n")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
