"""Issue 44's figures, each beside its reference from the same run: the benches record them
(`--record`) and docs/performance.md's table is generated from the records
(`docs/generate.py`, block `figures`), never typed in.

A record is one JSON file per figure in bench/results/figures/: the figure's value and its
reference's, both measured in the one run, and what ran them (commit, date, CPUs, load
average, the command). The ratio and whether the goal holds are computed here from the
two values, not stored. A new run of a bench replaces its figure's record (git keeps the
old ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RECORDS = Path("bench") / "results" / "figures"


@dataclass(frozen=True)
class Figure:
    key: str
    what: str
    unit: str
    reference: str  # what the value is measured beside, in the same run
    goal: str  # issue 44's done-when, as the table says it
    met: Callable[[float, float], bool]  # (value, reference) -> whether the goal holds
    bench: str  # the command that records it
    higher_is_better: bool = False  # the ratio is reference / value (a speed), not value / reference

    def ratio(self, value: float, reference: float) -> float:
        return reference / value if self.higher_is_better else value / reference


_COST = ("python3 bench/cost_bench.py --intervals 15,1 --seconds 120 --readings still --pacing paced "
         "--record")
FIGURES: Dict[str, Figure] = {f.key: f for f in (
    Figure("cpu-15s", "exporter CPU, scraped every 15 s (synthetic 8 GPU x 48 clients, nothing moving; its simulated node "
           "left out)", "ms/s",
           "node_exporter 1.5.0 (default collectors), scraped alike", "at most 0.5x",
           lambda v, r: v <= 0.5 * r, _COST),
    Figure("cpu-1s", "exporter CPU, scraped every second (synthetic 8 GPU x 48 clients, nothing moving; its simulated node "
           "left out)", "ms/s",
           "node_exporter 1.5.0 (default collectors), scraped alike", "at most 1.0x",
           lambda v, r: v <= r, _COST),
    Figure("storm-p99", "scrape p99 through the recorded client storm (8 GPU x 48 clients, refresh 1 s, timeout 10 s)",
           "ms", "the same storm by c5fc7fc (the tree issue 44 was filed against), rounds taking turns",
           "unchanged or better", lambda v, r: v <= r,
           "python3 bench/storm_against.py --against c5fc7fc --rounds 5 --record"),
    Figure("moved-scrape", "CPU of a scrape whose readings all moved (8 GPU x 48 clients, OpenMetrics + gzip)", "ms",
           "the same scrape by c5fc7fc (the tree issue 44 was filed against), rounds taking turns", "at most 0.5x",
           lambda v, r: v <= 0.5 * r, "python3 bench/moved_bench.py --scrapes 30 --rounds 5 --against c5fc7fc --record"),
    Figure("heavy-group", "the heavy rule group, one evaluation per node (100 replay exporters, quiet copy)", "ms",
           "c5fc7fc's rules (the issue filed) on the same data, same Prometheus", "at most 12 ms",
           lambda v, r: v <= 12.0, "python3 bench/fleet_bench.py --nodes 100 --pod-nodes --server-nodes "
           "--baseline-rules <c5fc7fc's alerts/prometheus/mps-exporter.rules.yml> --record"),
    Figure("catch-up", "catch-up of 1 M log lines without a state file", "s",
           "reading the same files and matching one compiled regex per line", "at least 0.4x as fast",
           lambda v, r: r / v >= 0.4, "python3 bench/logs_bench.py --catch-up --sizes 1000000 --record",
           higher_is_better=True),
    Figure("first-scrape", "start to the first complete scrape of the replay node", "s",
           "client_python's start_http_server in a fresh interpreter", "at most 0.5 s",
           lambda v, r: v <= 0.5, "python3 bench/start_bench.py --runs 5 --record"),
)}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def record(key: str, value: float, reference: float, root: Path = ROOT, **details: object) -> Path:
    """Write figure `key`'s record: its value and its reference's from this run."""
    if key not in FIGURES:
        raise KeyError(f"no figure {key!r} in bench/figures.py FIGURES")
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "exporter", "bench",
                      ":(exclude)bench/results"))  # the code measured differs from the commit: "+"
    path = root / RECORDS / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"figure": key, "value": value, "reference": reference,
           "commit": commit + ("+" if dirty else ""), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpus": os.cpu_count(), "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
           "python": sys.version.split()[0], "details": details}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"recorded {key}: {value:.4g} beside {reference:.4g} -> {path.relative_to(root)}")
    return path


def load(root: Path = ROOT) -> Dict[str, dict]:
    """Every figure's record. A figure without one is an error (run its bench with --record)."""
    records: Dict[str, dict] = {}
    missing: List[str] = []
    for key in FIGURES:
        path = root / RECORDS / f"{key}.json"
        if not path.exists():
            missing.append(f"{key} ({FIGURES[key].bench})")
            continue
        records[key] = json.loads(path.read_text(encoding="utf-8"))
        if records[key].get("figure") != key:
            raise ValueError(f"{path}: records figure {records[key].get('figure')!r}, not {key!r}")
    if missing:
        raise FileNotFoundError("no record of " + "; ".join(missing))
    return records


def _number(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def markdown(root: Optional[Path] = None) -> str:
    """docs/performance.md's table of the figures, from their records."""
    records = load(root or ROOT)
    lines = ["| figure | exporter | reference, same run | ratio | goal | met | measured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, fig in FIGURES.items():
        r = records[key]
        value, reference = float(r["value"]), float(r["reference"])
        lines.append(f"| {fig.what} | {_number(value)} {fig.unit} | {fig.reference}: {_number(reference)} {fig.unit} | "
                     f"{fig.ratio(value, reference):.2f}x | {fig.goal} | {'yes' if fig.met(value, reference) else 'no'} | "
                     f"{r['commit']}, {r['date']}, {r['cpus']} CPUs, load {r['load']} |")
    benches: Dict[str, List[str]] = {}  # command -> the figures it records, in table order
    for key, fig in FIGURES.items():
        benches.setdefault(fig.bench, []).append(key)
    lines += ["", "The benches that record them:", ""]
    lines += [f"- {', '.join(keys)}: `{command}`" for command, keys in benches.items()]
    return "\n".join(lines) + "\n"
