"""The doctor's report: one result per stage (status, time, reasons, a table), printed for a
person and written as JSON for a machine.

A stage's status is the worst of its findings: `fail` (the checkpoint cannot be trusted to
run correctly here), `warn` (runs, but a person should look), `pass`, or `skip` (not run, and
why; never a failure).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

ORDER = {"pass": 0, "skip": 0, "warn": 1, "fail": 2}


@dataclass
class StageResult:
    name: str
    status: str = "pass"
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)  # "fail: ...", "warn: ...", "skip: ...", "note: ..."
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # details for the JSON report

    def _mark(self, status: str, reason: str) -> None:
        self.reasons.append(f"{status}: {reason}")
        if ORDER[status] > ORDER[self.status] or (self.status == "pass" and status == "skip"):
            self.status = status

    def fail(self, reason: str) -> None:
        self._mark("fail", reason)

    def warn(self, reason: str) -> None:
        self._mark("warn", reason)

    def skip(self, reason: str) -> None:
        self._mark("skip", reason)

    def note(self, reason: str) -> None:
        self.reasons.append(f"note: {reason}")

    def table(self, columns: list[str], rows: list[list[Any]]) -> None:
        self.columns = columns
        self.rows = [[_cell(v) for v in r] for r in rows]

    def first(self, status: str) -> str | None:
        """The first reason of `status`, without its prefix."""
        prefix = status + ": "
        return next((r[len(prefix) :] for r in self.reasons if r.startswith(prefix)), None)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if 1e3 <= abs(v) < 1e9:
            return f"{v:,.0f}"
        return f"{v:.3g}" if 1e-3 <= abs(v) < 1e3 else f"{v:.2e}"
    return str(v).replace("\n", "\\n")


@dataclass
class Report:
    model: str
    stages: list[StageResult] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(s.status == "fail" for s in self.stages)

    def stage(self, name: str) -> StageResult:
        return next(s for s in self.stages if s.name == name)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "ok": not self.failed, "stages": [asdict(s) for s in self.stages]}

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")


def format_table(columns: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append(indent + "  ".join("-" * w for w in widths))
    lines += [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def print_stage(s: StageResult, out: TextIO = sys.stdout) -> None:
    out.write(f"\n== {s.name}: {s.status.upper()} ({s.seconds:.1f} s)\n")
    if s.columns:
        out.write(format_table(s.columns, s.rows) + "\n")
    for r in s.reasons:
        out.write(f"  {r}\n")
    out.flush()


def print_summary(report: Report, out: TextIO = sys.stdout) -> None:
    rows = []
    for s in report.stages:
        why = s.first("fail") or s.first("warn") or s.first("skip") or ""
        rows.append([s.name, s.status.upper(), f"{s.seconds:.1f}", why[:100]])
    out.write(f"\n== summary: {report.model}: {'FAIL' if report.failed else 'OK'}\n")
    out.write(format_table(["stage", "status", "seconds", "first reason"], rows) + "\n")
    out.flush()
