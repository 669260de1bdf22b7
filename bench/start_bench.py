#!/usr/bin/env python3
"""Seconds from start to the first complete scrape: `mps-exporter replay` (the shipped
session) beside client_python's own HTTP server in a fresh interpreter (the anchor: what
any Python exporter pays to start) and node_exporter where it is installed.

"Complete" is a 200 on /metrics in which no `mps_exporter_collector_success` is 0 (for
the anchor and node_exporter: the first 200). Each program runs `--runs` times, the
programs taking turns; the median of each is printed with the CPU its process had used
by then (utime + stime, less sensitive than the wall time to a busy machine) and the
load average. Bytecode is compiled first, as `pip install` does (a checkout run with
PYTHONDONTWRITEBYTECODE compiles every module at every start).

    python3 bench/start_bench.py [--runs 5] [--node-exporter PATH]
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = ("import sys, time\nfrom prometheus_client import start_http_server\n"
          "start_http_server(int(sys.argv[1]), addr='127.0.0.1')\ntime.sleep(60)\n")
FAILED = re.compile(rb"mps_exporter_collector_success\{[^}]*\} 0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def command(kind: str, port: int, node_exporter: Optional[str]) -> List[str]:
    if kind == "mps-exporter replay":
        return [sys.executable, "-m", "mps_exporter.cli", "replay", "--web.listen-address", f"127.0.0.1:{port}",
                "--log.level", "warn"]
    if kind == "client_python anchor":
        return [sys.executable, "-c", ANCHOR, str(port)]
    return [str(node_exporter), f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]


def first_complete(kind: str, node_exporter: Optional[str], limit: float = 30.0) -> Tuple[float, float]:
    """(seconds to the first complete scrape, CPU seconds of the process by then)."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(command(kind, port, node_exporter), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < limit:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    body = resp.read()
                if not FAILED.search(body):
                    return time.monotonic() - started, cpu_seconds(proc.pid)
            except (OSError, urllib.error.URLError):
                if proc.poll() is not None:
                    break
            time.sleep(0.005)
        raise SystemExit(f"{kind}: no complete scrape within {limit:g} s")
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--node-exporter", default=shutil.which("prometheus-node-exporter") or shutil.which("node_exporter"))
    ap.add_argument("--record", action="store_true", help="write the medians as issue 44's figure (bench/figures.py)")
    args = ap.parse_args()
    import mps_exporter
    import prometheus_client

    for package in (mps_exporter, prometheus_client):
        compileall.compile_dir(os.path.dirname(package.__file__), quiet=1)
    kinds = ["mps-exporter replay", "client_python anchor"] + (["node_exporter"] if args.node_exporter else [])
    runs: Dict[str, List[Tuple[float, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind in kinds:
            runs[kind].append(first_complete(kind, args.node_exporter))
    print(f"First complete scrape after start, median of {args.runs} runs taking turns ({os.cpu_count()} CPUs)\n")
    print("| program | seconds to the first complete scrape | CPU seconds by then | every run (s) |")
    print("| --- | --- | --- | --- |")
    for kind in kinds:
        walls, cpus = sorted(w for w, _ in runs[kind]), sorted(c for _, c in runs[kind])
        print(f"| {kind} | {walls[len(walls) // 2]:.2f} | {cpus[len(cpus) // 2]:.2f} | "
              + ", ".join(f"{w:.2f}" for w, _ in runs[kind]) + " |")
    print("\nload average %.2f %.2f %.2f" % os.getloadavg())
    if args.record:
        sys.path.insert(0, str(ROOT))
        from bench.figures import record

        def median(kind: str) -> float:  # the printed median: the upper one of an even count
            return statistics.median_high(w for w, _ in runs[kind])

        record("first-scrape", median("mps-exporter replay"), median("client_python anchor"), runs=args.runs,
               every_run=[round(w, 3) for w, _ in runs["mps-exporter replay"]])


if __name__ == "__main__":
    main()
