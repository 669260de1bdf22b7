"""The truth check's report: one entry per comparison, JSON and Markdown."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List


@dataclass
class Check:
    name: str
    expected: Any
    actual: Any
    passed: bool
    note: str = ""
    phase: str = ""


@dataclass
class Report:
    title: str
    checks: List[Check] = field(default_factory=list)
    facts: Dict[str, Any] = field(default_factory=dict)  # what the run learnt (exact texts), machine, timings
    phase: str = ""

    def check(self, name: str, expected: Any, actual: Any, tolerance: float = 0.0, note: str = "") -> bool:
        """Equal, or within `tolerance` when both are numbers."""
        if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) \
                and not isinstance(expected, bool) and not isinstance(actual, bool):
            passed = math.isfinite(actual) and abs(expected - actual) <= tolerance
        else:
            passed = expected == actual
        return self._add(name, expected, actual, passed, note)

    def check_true(self, name: str, expected: Any, actual: Any, passed: bool, note: str = "") -> bool:
        """For comparisons that are not plain equality (a bound, a subset)."""
        return self._add(name, expected, actual, bool(passed), note)

    def _add(self, name, expected, actual, passed, note) -> bool:
        self.checks.append(Check(name, _plain(expected), _plain(actual), passed, note, self.phase))
        print(f"{'PASS' if passed else 'FAIL'} [{self.phase}] {name}: expected={_short(expected)} actual={_short(actual)}"
              + (f" ({note})" if note else ""), flush=True)
        return passed

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({"title": self.title, "passed": self.passed, "total": len(self.checks),
                           "failed": sum(not c.passed for c in self.checks),
                           "checks": [asdict(c) for c in self.checks], "facts": self.facts}, indent=1, default=str)

    def to_markdown(self, extra: str = "") -> str:
        failed = [c for c in self.checks if not c.passed]
        rows = [f"# {self.title}", "",
                f"{len(self.checks) - len(failed)} of {len(self.checks)} comparisons passed.", ""]
        phases: Dict[str, List[Check]] = {}
        for c in self.checks:
            phases.setdefault(c.phase, []).append(c)
        rows += ["| phase | comparisons | passed |", "| --- | --- | --- |"]
        rows += [f"| {p} | {len(cs)} | {sum(c.passed for c in cs)} |" for p, cs in phases.items()]
        if failed:
            rows += ["", "## Failed", "", "| phase | name | expected | actual | note |", "| --- | --- | --- | --- | --- |"]
            rows += [f"| {c.phase} | {c.name} | {_short(c.expected)} | {_short(c.actual)} | {c.note} |" for c in failed]
        return "\n".join(rows) + ("\n\n" + extra if extra else "") + "\n"


def _plain(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return sorted(v, key=str)
    if isinstance(v, tuple):
        return list(v)
    return v


def _short(v: Any, width: int = 120) -> str:
    text = json.dumps(_plain(v), default=str)
    return text if len(text) <= width else text[: width - 3] + "..."
