"""CPU of a scrape whose readings moved: every client's memory changes between scrapes
(what a 15 s scrape of a busy node sees), at 8 GPUs x 48 clients, beside a scrape whose
readings did not move, and beside the same figures of another revision in the same run.

The synthetic node over the test fakes (tests/support/scenarios.py); one collection is
taken, then each scrape serves a copy of it with every client's memory (NVML's MPS and
compute lists) and the GPUs' used memory moved by a MiB, as a new NVML reading would. The
scrape is what the web server does for Prometheus: OpenMetrics, gzip, through
`Exposition.encode`. CPU is the process' CPU time of that call alone (the copy is made
before), median of the scrapes. Each round is a fresh child process; rounds of this tree
and of `--against REV` (git archive of that revision, its own code) alternate, so that
the machine's load hits both alike.

    python3 bench/moved_bench.py [--gpus 8] [--clients 48] [--scrapes 40] [--rounds 3] [--against main]

Prints a Markdown table; numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
# In the child process of --against: the revision's tree, importing its exporter/ as mps_exporter.
_TREE = os.environ.get("MOVED_BENCH_TREE")
if _TREE:
    sys.path[:0] = [str(Path(_TREE) / "_pkg"), _TREE]
else:
    sys.path.insert(0, str(ROOT))

OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def measure(gpus: int, per_gpu: int, scrapes: int) -> Dict[str, float]:
    """Median CPU ms of a scrape with every client's memory moved, and of one with nothing moved."""
    import logging

    from prometheus_client.exposition import choose_encoder

    from mps_exporter.collector import build_registry
    from mps_exporter.model import ProcessMemory
    from tests.support import scenarios

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        scen = scenarios.synthetic(Path(tmp), gpus=gpus, clients_per_gpu=per_gpu)
        collector = scen.collector()
        registry = build_registry(collector, process=False)
        encoder, content_type = choose_encoder(OPENMETRICS)
        base = collector.snapshot()
        served = [base]
        collector.collection = lambda: served[0]

        def moved(step: int) -> Any:
            snap = copy.copy(base)
            snap.nvml = copy.deepcopy(base.nvml)
            for gpu in snap.nvml.gpus:
                gpu.mps_clients = [ProcessMemory(p.pid, (p.used_bytes or 0) + (step << 20)) for p in gpu.mps_clients]
                gpu.compute_processes = [ProcessMemory(p.pid, (p.used_bytes or 0) + (step << 20))
                                         for p in gpu.compute_processes]
                gpu.memory_used_bytes = (gpu.memory_used_bytes or 0) + (step << 20) * len(gpu.mps_clients)
            return snap

        gc.freeze()
        cpus: Dict[str, List[float]] = {"moved": [], "unmoved": []}
        for step in range(scrapes + 3):
            served[0] = moved(step + 1)
            c0 = time.process_time()
            registry.encode(encoder, content_type, True)
            moved_cpu = time.process_time() - c0
            c0 = time.process_time()
            registry.encode(encoder, content_type, True)  # the same readings again
            unmoved_cpu = time.process_time() - c0
            if step >= 3:  # the first ones fill the caches
                cpus["moved"].append(moved_cpu)
                cpus["unmoved"].append(unmoved_cpu)
        gc.unfreeze()
    return {k: sorted(v)[len(v) // 2] * 1000 for k, v in cpus.items()}


def revision_tree(rev: str, into: Path) -> Path:
    """REV's exporter/, tests/ and bench/ under `into`, exporter/ importable as mps_exporter."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "exporter", "tests", "bench"],
                             check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into)
    (into / "_pkg").mkdir()
    (into / "_pkg" / "mps_exporter").symlink_to(into / "exporter")
    return into


def _child(tree: Optional[Path], args: argparse.Namespace) -> Dict[str, float]:
    """One round in a fresh process: of `tree` (a revision's), else of this tree."""
    env = {k: v for k, v in os.environ.items() if k != "MOVED_BENCH_TREE"}
    if tree is not None:
        env["MOVED_BENCH_TREE"] = str(tree)
    out = subprocess.run([sys.executable, __file__, "--child", "--gpus", str(args.gpus), "--clients", str(args.clients),
                          "--scrapes", str(args.scrapes)], env=env, check=True, capture_output=True, text=True)
    result: Dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--clients", type=int, default=48, help="clients per GPU")
    ap.add_argument("--scrapes", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", default="", help="a git revision measured beside this tree (e.g. main)")
    ap.add_argument("--record", action="store_true",
                    help="write the medians as issue 44's figure (bench/figures.py; needs --against c5fc7fc)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record and not args.against.startswith("c5fc7fc"):
        ap.error("--record: the figure's reference is c5fc7fc (--against c5fc7fc)")
    if args.child:
        print(json.dumps(measure(args.gpus, args.clients, args.scrapes)))
        return
    rows: Dict[str, List[Dict[str, float]]] = {"this tree": [], args.against: []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = revision_tree(args.against, Path(tmp)) if args.against else None
        for _ in range(args.rounds):
            if tree is not None:
                rows[args.against].append(_child(tree, args))
            rows["this tree"].append(_child(None, args))
    print(f"Scrape CPU at {args.gpus} GPU x {args.clients} clients each, OpenMetrics + gzip, median of "
          f"{args.scrapes} scrapes, each of {args.rounds} rounds ({os.cpu_count()} CPUs, "
          "load average %.2f %.2f %.2f)\n" % os.getloadavg())
    print("| code | every client's memory moved: CPU ms per scrape (rounds) | nothing moved: CPU ms per scrape |")
    print("| --- | --- | --- |")
    for name, results in rows.items():
        if results:
            moved = " / ".join(f"{r['moved']:.1f}" for r in results)
            unmoved = " / ".join(f"{r['unmoved']:.2f}" for r in results)
            print(f"| {name} | {moved} | {unmoved} |")
    if rows.get(args.against) and args.against:
        ratio = min(r["moved"] for r in rows["this tree"]) / min(r["moved"] for r in rows[args.against])
        print(f"\nmoved readings, this tree / {args.against} (best rounds): {ratio:.2f}")
    if args.record:
        from bench.figures import record

        def median(name: str) -> float:  # the upper one of an even count of rounds
            return statistics.median_high(r["moved"] for r in rows[name])

        record("moved-scrape", median("this tree"), median(args.against), rounds=args.rounds, scrapes=args.scrapes,
               this_tree=[round(r["moved"], 2) for r in rows["this tree"]],
               against=[round(r["moved"], 2) for r in rows[args.against]])


if __name__ == "__main__":
    main()
