#!/usr/bin/env python3
"""The log reader's CPU while the exporter's own control command writes its lines into
control.log once per scrape, the only lines of a quiet node (issue 44): the reader's
thread CPU (its CPU-time clock) as the module is, beside two references, in turns, each
in a fresh process: quiet waits fixed at QUIET_SECONDS (before they doubled up to
QUIET_MAX_SECONDS), and that with 8 looks after each read (before QUIET_ROUNDS 2).

Each command writes 6 lines at once (a connection, the UI, `Cmd:get_server_list`, as a
scrape's `get_server_list` does); the reader follows a temporary directory with inotify,
as on a node.

    python3 bench/follower_bench.py [--intervals 15,1] [--seconds 60] [--turns 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (name, QUIET_ROUNDS or 0 for the module's, whether quiet waits stay QUIET_SECONDS)
VARIANTS = (("as is", 0, False), ("fixed quiet waits", 0, True), ("fixed, 8 looks", 8, True))


def child(rounds: int, fixed: bool, interval: float, seconds: float) -> float:
    sys.path.insert(0, str(ROOT))
    from mps_exporter.logs import pipeline

    if rounds:
        pipeline.QUIET_ROUNDS = rounds
    if fixed:
        pipeline.QUIET_MAX_SECONDS = pipeline.QUIET_SECONDS
    directory = tempfile.mkdtemp(prefix="follower-bench-")
    Path(directory, "server.log").touch()
    with open(os.path.join(directory, "control.log"), "a", encoding="utf-8") as control:
        def command() -> None:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            control.write("".join(f"[{at}.000 Control 1234] {m}\n" for m in (
                "Accepting connection...", "User did not send valid credentials", "Accepting connection...",
                "NEW UI", "Cmd:get_server_list", "UI closed")))
            control.flush()

        reader = pipeline.LogPipeline("bench", directory, timezone="UTC")
        reader.start()
        assert reader._thread is not None and reader._thread.ident is not None
        clock = time.pthread_getcpuclockid(reader._thread.ident)  # the reader thread's CPU, as rotation_bench
        command()
        time.sleep(3)  # read, published, quiet
        before, started = time.clock_gettime(clock), time.monotonic()
        while time.monotonic() - started < seconds:
            command()
            time.sleep(interval)
        used = (time.clock_gettime(clock) - before) * 1000 / (time.monotonic() - started)
        reader.stop()
    return used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="15,1", help="seconds between two commands (scrapes), comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rounds, fixed, interval, seconds = args.child
        print(json.dumps(child(int(rounds), fixed == "1", float(interval), float(seconds))))
        return
    sys.path.insert(0, str(ROOT))
    from mps_exporter.logs.pipeline import QUIET_MAX_SECONDS, QUIET_ROUNDS, QUIET_SECONDS

    print(f"The log reader's thread CPU (ms/s), one command's 6 lines every interval, {args.seconds:g} s a run, "
          f"runs taking turns ({os.cpu_count()} CPUs); as is: {QUIET_ROUNDS} looks, quiet waits "
          f"{QUIET_SECONDS:g} s doubling to {QUIET_MAX_SECONDS:g} s\n")
    print("| interval | " + " | ".join(name for name, _, _ in VARIANTS) + " | as is / fixed | as is / 8 looks | load |")
    print("| --- " * (len(VARIANTS) + 4) + "|")
    for interval in (float(x) for x in args.intervals.split(",")):
        for _ in range(args.turns):
            ran = []
            for _, rounds, fixed in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--child", str(rounds), "1" if fixed else "0",
                                      str(interval), str(args.seconds)], check=True, capture_output=True, text=True)
                ran.append(float(out.stdout.strip().splitlines()[-1]))
            print(f"| {interval:g} s | " + " | ".join(f"{v:.3f}" for v in ran) +
                  f" | {ran[0] / ran[1]:.2f} | {ran[0] / ran[2]:.2f} | " + "%.2f %.2f %.2f |" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
