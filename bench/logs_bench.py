#!/usr/bin/env python3
"""Benchmark of the MPS log pipeline: lines per second and peak memory.

Builds MPS log directories of growing length from the real capture
(tests/data/captures/h200-driver580-a: control.log + server.log, repeated; every
repetition gets its own PIDs and uids so nothing can be cached by PID), then
measures in a fresh process for each size:

- parser + state machine alone: lines/s over lines already in memory (one core);
- end to end: `LogPipeline.read_once()` (file reads, decoding, line splitting,
  parsing, state) from the files on disk;
- peak RSS of that process and the size of the saved state (to_dict as JSON),
  which must stay flat as the log grows: state follows running clients, not history.

    python3 bench/logs_bench.py                # 250k, 500k, 1M, 2M lines
    python3 bench/logs_bench.py --sizes 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "data" / "captures" / "h200-driver580-a"
_NUMBER = re.compile(r"(?<![\w.])(\d{3,5})(?![\w.])")  # PIDs, uids; not `25.0`, `0x8000`, `200ms`


def _shift(line: str, delta: int) -> str:
    """The same line for another run: header PID and standalone numbers moved by delta."""
    close = line.find("]")
    head, msg = line[:close], line[close:]
    role, _, pid = head.rpartition(" ")
    return f"{role} {int(pid) + delta}" + _NUMBER.sub(lambda m: str(int(m.group(1)) + delta), msg)


def build(capture: Path, directory: Path, total_lines: int) -> int:
    """Write control.log + server.log with about total_lines lines together."""
    sources = {f: (capture / f"{f}.log").read_text(encoding="utf-8").splitlines() for f in ("control", "server")}
    per_round = sum(len(v) for v in sources.values())
    rounds = max(1, -(-total_lines // per_round))
    written = 0
    for f, lines in sources.items():
        with open(directory / f"{f}.log", "w", encoding="utf-8") as out:
            for r in range(rounds):
                delta = (r % 5000) * 10000  # keeps PIDs below 2^31 and distinct per round
                out.write("\n".join(_shift(line, delta) for line in lines) + "\n")
                written += len(lines)
    return written


def child(directory: str) -> Dict[str, float]:
    """Run in a fresh process: measure one directory."""
    from mps_exporter.logs.parser import parse_line
    from mps_exporter.logs.pipeline import LogPipeline
    from mps_exporter.logs.state import LogState

    rss_start_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # interpreter + imports
    start = time.perf_counter()
    pipe = LogPipeline("bench", directory, timezone="UTC")
    snap = pipe.read_once()
    end_to_end = time.perf_counter() - start
    rss_pipeline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = sum(snap.lines.values())

    # Parser + state machine alone, on the first 1M lines held in memory (outside the RSS figure).
    batch: List[str] = []
    for f in ("control", "server"):
        with open(os.path.join(directory, f"{f}.log"), encoding="utf-8") as fh:
            batch += [(line.rstrip("\n"), f) for line in fh][: 500_000]  # type: ignore[misc]
    state = LogState()
    start = time.perf_counter()
    for line, f in batch:  # type: ignore[misc]
        state.apply(parse_line(line, f), f)
    core = time.perf_counter() - start
    return {"lines": lines, "end_to_end_s": end_to_end, "end_to_end_lps": lines / end_to_end,
            "core_lines": len(batch), "core_lps": len(batch) / core, "peak_rss_mib": rss_pipeline_kib / 1024,
            "start_rss_mib": rss_start_kib / 1024,
            "state_json_bytes": len(json.dumps(pipe.state_entry())),
            "server_starts": snap.server_starts, "unrecognized": sum(snap.unrecognized.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="250000,500000,1000000,2000000", help="comma-separated line counts")
    ap.add_argument("--capture", default=str(CAPTURE), help="the capture directory (default: %(default)s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    capture = Path(args.capture)
    if not (capture / "control.log").is_file():
        sys.exit(f"capture not found: {capture}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="mps-logs-bench-") as d:
            build(capture, Path(d), size)
            out = subprocess.run([sys.executable, __file__, "--child", d], check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout))
    print(f"{'lines':>10} {'parse+state lines/s':>20} {'end-to-end lines/s':>19} {'RSS at start MiB':>17} "
          f"{'peak RSS MiB':>13} {'state JSON bytes':>17} {'unrecognized':>12}")
    for r in rows:
        print(f"{r['lines']:>10,} {r['core_lps']:>20,.0f} {r['end_to_end_lps']:>19,.0f} {r['start_rss_mib']:>17.1f} "
              f"{r['peak_rss_mib']:>13.1f} {r['state_json_bytes']:>17,} {r['unrecognized']:>12}")
    print(f"python {sys.version.split()[0]}, one thread. parse+state: parse_line + LogState.apply over up to 1M "
          "lines held in memory; end-to-end: LogPipeline.read_once() from the files (read, decode, split, "
          "parse, state); peak RSS: of the end-to-end run, before the in-memory lines are loaded")


if __name__ == "__main__":
    main()
