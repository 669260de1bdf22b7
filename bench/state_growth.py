#!/usr/bin/env python3
"""Where the log state's memory goes under hostile input: the soak's line stream
(bench/hostile.py, no long lines) straight into parse_line + LogState, in one
process, with the size of every bounded table and the RSS every 500,000 lines.

Explains a soak's RSS slope: the tables a broken log can fill (connected clients
whose disconnect line was broken, server facts control.log never announced,
remembered exited PIDs, verbs) grow until their caps (4096, 64, 4096, 64), then
memory is flat.

    python3 bench/state_growth.py [--lines 5000000]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from datetime import timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import hostile_lines  # noqa: E402

from mps_exporter.logs.parser import parse_line  # noqa: E402
from mps_exporter.logs.state import LogState  # noqa: E402


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(row.split()[1]) for row in f if row.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=5_000_000)
    ap.add_argument("--every", type=int, default=500_000)
    args = ap.parse_args()
    lines = hostile_lines(seed=7, long_share=0.0)
    state = LogState()
    start = time.perf_counter()
    print("| lines | RSS KiB | clients | orphan facts | exited PIDs | pending | verbs | s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i in range(1, args.lines + 1):
        file, line = next(lines)
        state.apply(parse_line(line.replace(b"\x00", b"").decode("utf-8", "replace"), file, timezone.utc), file)
        if i % args.every == 0:
            state.snapshot()
            gc.collect()
            print(f"| {i:,} | {rss_kib():,} | {len(state._clients)} | {len(state._orphans)} | {len(state._exited)} | "
                  f"{len(state._pending)} | {len(state.s.commands)} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
