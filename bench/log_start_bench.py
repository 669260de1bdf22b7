#!/usr/bin/env python3
"""Seconds from an exporter's start to its first complete scrape, on a long log without
a state file: `--mps.log-start beginning` (the history read first, the logs not served
until then) against `--mps.log-start end` (the history skipped).

The logs are bench/steady_log.py's busy node (8 GPUs x 48 clients, months of 15 s
scrapes). The exporter runs as a program with the logs collector alone; "complete" is
a scrape with `mps_exporter_collector_success{collector="logs"} 1`.

    python3 bench/log_start_bench.py [--lines 5000000]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from steady_log import steady_history  # noqa: E402

EXPORTER = [sys.executable, "-m", "mps_exporter.cli", "--no-collector.nvml", "--no-collector.dcgm",
            "--no-collector.control", "--no-collector.proc", "--mps.log-timezone", "UTC"]
COMPLETE = 'mps_exporter_collector_success{collector="logs"} 1.0'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_complete_scrape(directory: Path, start: str, limit: float = 1800.0) -> float:
    port = free_port()
    launched = time.monotonic()
    proc = subprocess.Popen(EXPORTER + ["--mps.log-directory", str(directory), "--mps.log-start", start,
                                        "--web.listen-address", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        while time.monotonic() - launched < limit:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    if COMPLETE in r.read().decode():
                        return time.monotonic() - launched
            except OSError:
                pass
            time.sleep(0.02)
        raise SystemExit(f"no complete scrape within {limit} s")
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=5_000_000)
    args = ap.parse_args()
    with steady_history(args.lines) as (directory, written, size):
        print(f"# {written:,} lines ({size / 1e6:.0f} MB) of history, no state file\n")
        print("| --mps.log-start | first complete scrape after start | load average |")
        print("| --- | --- | --- |")
        for start in ("end", "beginning"):
            seconds = first_complete_scrape(directory, start)
            print(f"| {start} | {seconds:.2f} s | {os.getloadavg()[0]:.1f} |")


if __name__ == "__main__":
    main()
