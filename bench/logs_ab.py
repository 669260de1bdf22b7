#!/usr/bin/env python3
"""Per-line cost of the log parser and state machine against a reference checkout, in one
process: both implementations parse and apply the same lines (bench/logs_bench.py's
build of the H200 capture), alternating round by round, so that the load of a shared
machine falls on both alike. Prints best and median lines/s of each and their ratios.

    git worktree add /tmp/ref <commit>          # or: git archive <commit> | tar -x -C /tmp/ref
    python3 bench/logs_ab.py /tmp/ref --lines 100000 --rounds 25
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import logs_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="a checkout of the reference commit (its exporter/ is imported)")
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        site = Path(d) / "site"
        site.mkdir()
        (site / "mps_exporter_reference").symlink_to(Path(args.reference).resolve() / "exporter")
        sys.path.insert(0, str(site))
        impl = {}
        for label, package in (("reference", "mps_exporter_reference"), ("this tree", "mps_exporter")):
            parser = importlib.import_module(package + ".logs.parser")
            state = importlib.import_module(package + ".logs.state")
            impl[label] = (parser.parse_line, state.LogState, parser.resolve_timezone("UTC"))
        logs_bench.build(logs_bench.CAPTURE, Path(d), args.lines)
        files = {f: (Path(d) / f"{f}.log").read_text(encoding="utf-8").splitlines() for f in ("control", "server")}
    n = sum(len(v) for v in files.values())
    times: Dict[str, List[float]] = {label: [] for label in impl}
    for _ in range(args.rounds):
        for label, (parse_line, log_state, tz) in impl.items():
            st = log_state()
            t = time.perf_counter()
            for f in ("control", "server"):
                for line in files[f]:
                    st.apply(parse_line(line, f, tz), f)
            times[label].append(time.perf_counter() - t)
    mid = args.rounds // 2
    for label, ts in times.items():
        ts.sort()
        print(f"{label:10} {n:,} lines: best {n / ts[0]:,.0f} lines/s, median {n / ts[mid]:,.0f} lines/s")
    ref, new = times["reference"], times["this tree"]
    print(f"this tree / reference: {ref[0] / new[0]:.3f} (best), {ref[mid] / new[mid]:.3f} (median)")


if __name__ == "__main__":
    main()
