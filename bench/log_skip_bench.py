#!/usr/bin/env python3
"""How fast the log pipeline reads a monitored node's steady-state logs, against one
compiled regex per line, in the same run.

The logs are bench/steady_log.py's: a busy node (8 GPUs x 48 clients) after months
of 15 s scrapes, where control.log is mostly command echoes. Three readers, taken in
turns (each round runs all three; other processes' load moves all of them):

- regex: the lines already in memory, the parser's header regex matched on each (one
  compiled regex per line, no file reading: the cheapest reader that looks at each line);
- pipeline: `LogPipeline.read_once()` from the files on disk (read, decode, split,
  echoes counted without the parser, everything else parsed and applied);
- parse every line: the same pipeline with every line through `parse_line` and
  `LogState.apply`, as before echoes were skipped.

    python3 bench/log_skip_bench.py [--lines 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steady_log import steady_history  # noqa: E402

from mps_exporter.logs import pipeline as pipeline_mod  # noqa: E402
from mps_exporter.logs.parser import _HEADER  # noqa: E402


def regex(directory: Path) -> int:
    lines: List[str] = []
    for f in ("control", "server"):
        lines += (directory / f"{f}.log").read_text(encoding="utf-8").split("\n")[:-1]
    start = time.perf_counter()
    match = _HEADER
    for line in lines:
        match(line)
    regex.seconds = time.perf_counter() - start  # type: ignore[attr-defined]
    return len(lines)


def pipeline(directory: Path) -> int:
    start = time.perf_counter()
    snap = pipeline_mod.LogPipeline("bench", str(directory), timezone="UTC").read_once()
    pipeline.seconds = time.perf_counter() - start  # type: ignore[attr-defined]
    return sum(snap.lines.values())


def parse_every_line(directory: Path) -> int:
    def apply_each(state, text, parse, on_error) -> int:  # type: ignore[no-untyped-def]
        lines = text.split("\n")[:-1]
        for line in lines:
            state.apply(parse(line), "control")
        return len(lines)

    saved = pipeline_mod.apply_control_text
    pipeline_mod.apply_control_text = apply_each
    try:
        n = pipeline(directory)
    finally:
        pipeline_mod.apply_control_text = saved
    parse_every_line.seconds = pipeline.seconds  # type: ignore[attr-defined]
    return n


READERS: Dict[str, Callable[[Path], int]] = {"regex": regex, "pipeline": pipeline,
                                             "parse every line": parse_every_line}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with steady_history(args.lines) as (directory, written, size):
        print(f"# steady-state logs: {written:,} lines, {size / 1e6:.0f} MB (bench/steady_log.py, 8 GPUs x 48 "
              f"clients); load average before: {os.getloadavg()[0]:.2f}\n")
        print("| round | regex lines/s | pipeline lines/s | parse every line lines/s | pipeline / regex | "
              "parse every line / regex |")
        print("| --- | --- | --- | --- | --- | --- |")
        ratios: List[float] = []
        for r in range(args.rounds):
            rates = {}
            for name, reader in READERS.items():
                n = reader(directory)
                rates[name] = n / reader.seconds  # type: ignore[attr-defined]
            ratios.append(rates["pipeline"] / rates["regex"])
            print(f"| {r + 1} | {rates['regex']:,.0f} | {rates['pipeline']:,.0f} | {rates['parse every line']:,.0f} "
                  f"| {ratios[-1]:.2f} | {rates['parse every line'] / rates['regex']:.2f} |")
        print(f"\npipeline / regex, median of {args.rounds} rounds: {statistics.median(ratios):.2f} "
              f"(load average after: {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
