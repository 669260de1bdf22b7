#!/usr/bin/env python3
"""Scrape latency through the recorded client storm, this tree beside another revision's
(issue 44, done-when 1: storm p99 unchanged or better), rounds taking turns.

Each round is a fresh process running a revision's own `bench/scrape_bench.py` storm
(8 simulated GPUs each replaying the H100 storm of 48 clients, scraped once a second from
10 s into it, the default refresh and Prometheus' default 10 s timeout): REV's from a
`git archive` of its exporter/, tests/ and bench/, this tree's from the checkout. A
round's p99 of 20 scrapes is its slowest; the median of the rounds is printed, and
recorded with --record (bench/figures.py).

    python3 bench/storm_against.py [--against c5fc7fc] [--rounds 3] [--seconds 20] [--record]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
GPUS, CLIENTS, TIMEOUT, MAX_SECONDS, REFRESH = 8, 48, "10", 5.0, 1.0


def child(tree: Optional[str], seconds: float) -> Dict[str, float]:
    """One storm in this process, by `tree`'s scrape_bench (its own exporter), else this one's."""
    import logging

    logging.disable(logging.WARNING)
    base = Path(tree) if tree else ROOT
    if tree:
        sys.path[:0] = [str(base / "_pkg"), str(base)]
    spec = importlib.util.spec_from_file_location("scrape_bench_of_tree", base / "bench" / "scrape_bench.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.storm(GPUS, CLIENTS, TIMEOUT, MAX_SECONDS, seconds, REFRESH)
    walls = sorted(r["walls"])
    return {"p50": bench.pct(walls, 50), "p99": bench.pct(walls, 99), "scrapes": len(walls)}


def run_round(tree: Optional[Path], seconds: float) -> Dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(tree or ""), "--seconds", str(seconds)],
                         check=True, capture_output=True, text=True, cwd=str(tree or ROOT))
    result: Dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="c5fc7fc", help="the revision measured beside this tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of storm scrapes per round")
    ap.add_argument("--record", action="store_true",
                    help="write the medians as issue 44's figure (bench/figures.py; needs --against c5fc7fc)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child or None, args.seconds)))
        return
    if args.record and not args.against.startswith("c5fc7fc"):
        ap.error("--record: the figure's reference is c5fc7fc (--against c5fc7fc)")
    sys.path.insert(0, str(ROOT))
    from bench.moved_bench import revision_tree

    rows: Dict[str, List[Dict[str, float]]] = {"this tree": [], args.against: []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = revision_tree(args.against, Path(tmp))
        for _ in range(args.rounds):
            rows[args.against].append(run_round(tree, args.seconds))
            rows["this tree"].append(run_round(None, args.seconds))
    print(f"Storm scrapes at {GPUS} GPU x {CLIENTS} clients each, refresh {REFRESH:g} s, Prometheus timeout "
          f"{TIMEOUT} s, {args.seconds:g} s of scrapes a round, {args.rounds} rounds taking turns "
          f"({os.cpu_count()} CPUs, load average %.2f %.2f %.2f)\n" % os.getloadavg())
    print("| code | scrape p50 ms (rounds) | scrape p99 ms (rounds) | median p99 ms |")
    print("| --- | --- | --- | --- |")
    medians = {}
    for name, results in rows.items():
        medians[name] = statistics.median_high(r["p99"] for r in results)
        p50s = " / ".join(f"{r['p50']:.0f}" for r in results)
        print(f"| {name} | {p50s} | {' / '.join(f'{r:.0f}' for r in (x['p99'] for x in results))} | "
              f"{medians[name]:.0f} |")
    if args.record:
        from bench.figures import record

        record("storm-p99", medians["this tree"], medians[args.against], rounds=args.rounds, seconds=args.seconds,
               this_tree=[round(r["p99"], 1) for r in rows["this tree"]],
               against=[round(r["p99"], 1) for r in rows[args.against]])


if __name__ == "__main__":
    main()
