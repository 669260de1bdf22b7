#!/usr/bin/env python3
"""The log reader's CPU while the exporter's own control command writes its lines into
control.log once per scrape, the only lines of a quiet node (issue 44): the reader's
thread CPU (its CPU-time clock) at QUIET_ROUNDS as it is, beside the 8 rounds before it (the
reference), in turns, each in a fresh process.

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
REFERENCE_ROUNDS = 8  # before issue 44


def child(rounds: int, interval: float, seconds: float) -> float:
    sys.path.insert(0, str(ROOT))
    from mps_exporter.logs import pipeline

    if rounds:
        pipeline.QUIET_ROUNDS = rounds
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
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), float(args.child[1]), float(args.child[2]))))
        return
    sys.path.insert(0, str(ROOT))
    from mps_exporter.logs.pipeline import QUIET_ROUNDS

    print(f"The log reader's thread CPU, one command's 6 lines every interval, {args.seconds:g} s a run, "
          f"runs taking turns ({os.cpu_count()} CPUs)\n")
    print(f"| interval | QUIET_ROUNDS {QUIET_ROUNDS} ms/s | reference: {REFERENCE_ROUNDS} rounds ms/s | ratio | load |")
    print("| --- | --- | --- | --- | --- |")
    for interval in (float(x) for x in args.intervals.split(",")):
        for _ in range(args.turns):
            ran = {}
            for rounds in (REFERENCE_ROUNDS, 0):  # 0: the module's own
                out = subprocess.run([sys.executable, __file__, "--child", str(rounds), str(interval),
                                      str(args.seconds)], check=True, capture_output=True, text=True)
                ran[rounds] = float(out.stdout.strip().splitlines()[-1])
            print(f"| {interval:g} s | {ran[0]:.3f} | {ran[REFERENCE_ROUNDS]:.3f} | "
                  f"{ran[0] / ran[REFERENCE_ROUNDS]:.2f} | " + "%.2f %.2f %.2f |" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
