"""A verdict row (a figure, its measurement, its target and whether it is met), shared by every benchmark's rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.report.data import MISSING, fmt, number


@dataclass
class Row:
    figure: str
    measured: Any
    target: str
    ok: bool | None  # None: cannot tell (missing figure)
    paper: str = ""
    unit: str = ""

    def cells(self) -> list[str]:
        verdict = MISSING if self.ok is None else ("met" if self.ok else "**missed**")
        return [self.figure, fmt(self.measured, self.unit), self.target, verdict, self.paper]


def check(value: Any, op: str, limit: float) -> bool | None:
    v = number(value)
    if v is None:
        return None
    return {"<": v < limit, "<=": v <= limit, ">=": v >= limit}[op]
