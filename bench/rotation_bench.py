"""Log rotation under load: is every line read once, none lost, none twice?

A writer appends numbered control.log lines at a steady rate through one descriptor
that it keeps (O_APPEND, as MPS never reopens its logs), while the real `logrotate`
rotates the file every PERIOD seconds, and the exporter's FileFollower polls it every
POLL_SECONDS (the pipeline's 250 ms) in another thread. At the end it prints, per mode:
lines written, read, read twice, and the lines lost, split in two: lost by the
follower (in some file at the end, never read) and lost by the rotation itself (in no
file: copytruncate's window between logrotate's copy, with its fsync, and its
truncate, documented by logrotate), and the rotations the follower could not recover
from (`rotation_gaps`). Rotated files are kept (rotate 10000) so that the files say
what was there to read.

Modes: `copytruncate` uses the shipped deploy/systemd/nvidia-mps.logrotate (paths
changed); `rename` is create-style rotation (`create`, no compression), which tools
that reopen their logs use. In rename mode the writer reopens the name after each
rotation, as such a program does on its signal.

    python3 bench/rotation_bench.py [--seconds 60] [--rate 500] [--modes copytruncate:1 rename:0.1 ...]

Numbers, not a pass/fail; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from exporter.logs.follower import FileFollower  # noqa: E402
from report import load_average, print_rows  # noqa: E402
from exporter.logs.pipeline import POLL_SECONDS  # noqa: E402

RENAME_CONFIG = """{path} {{
    size 1
    rotate 1000
    missingok
    create
    nocompress
}}
"""
LINE = re.compile(r"NEW UI (\d+)$")


def shipped_config(log_dir: str) -> str:
    with open(ROOT / "deploy" / "systemd" / "nvidia-mps.logrotate", encoding="utf-8") as f:
        config = f.read().replace("/var/log/nvidia-mps/", f"{log_dir}/")
    config = re.sub(r"\brotate \d+", "rotate 10000", config)
    if os.geteuid() != 0:
        config = re.sub(r"^\s*su .*$", "", config, flags=re.M)
    return config


def run(mode: str, period: float, seconds: float, rate: int) -> Dict[str, object]:
    logrotate = shutil.which("logrotate") or "/usr/sbin/logrotate"
    if not os.path.exists(logrotate):
        sys.exit("logrotate is not installed: apt-get install logrotate")
    with tempfile.TemporaryDirectory(prefix="mps-rotation-") as tmp:
        log_dir = os.path.join(tmp, "log")
        os.mkdir(log_dir)
        path = os.path.join(log_dir, "control.log")
        conf = os.path.join(tmp, "rotate.conf")
        with open(conf, "w", encoding="utf-8") as f:
            f.write(shipped_config(log_dir) if mode == "copytruncate" else RENAME_CONFIG.format(path=path))
        state = os.path.join(tmp, "state")
        stop = threading.Event()
        written = [0]
        reopen = threading.Event()
        fd_box = [os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)]

        def writer() -> None:
            start = time.monotonic()
            n = 0
            while not stop.is_set():
                due = int((time.monotonic() - start) * rate)
                while n < due:
                    if reopen.is_set():  # rename mode: the program reopens its log
                        reopen.clear()
                        os.close(fd_box[0])
                        fd_box[0] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    os.write(fd_box[0], f"[{stamp}.000 Control  1419] NEW UI {n}\n".encode())
                    n += 1
                written[0] = n
                time.sleep(0.002)

        def rotator() -> None:
            while not stop.wait(period):
                subprocess.run([logrotate, "--force", "--state", state, conf], capture_output=True, timeout=30)
                rotations[0] += 1
                if mode == "rename":
                    reopen.set()

        rotations = [0]
        seen: List[int] = []
        follower = FileFollower(path)
        threads = [threading.Thread(target=writer), threading.Thread(target=rotator)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            _poll_all(follower, seen)
            time.sleep(POLL_SECONDS)
        stop.set()
        for t in threads:
            t.join()
        time.sleep(POLL_SECONDS)
        _poll_all(follower, seen)
        os.close(fd_box[0])
        counts = Counter(seen)
        in_files = numbers_in_files(log_dir)
        twice = sum(c - 1 for c in counts.values() if c > 1)
        return {"mode": mode, "rotate every, s": period, "rotations": rotations[0], "lines written": written[0],
                "lines read": len(seen), "read twice": twice,
                "lost by the follower": len(in_files - set(counts)),
                "lost by the rotation (in no file)": len(set(range(written[0])) - in_files - set(counts)),
                "rotation gaps": follower.rotation_gaps}


def numbers_in_files(log_dir: str) -> Set[int]:
    """Every line number found in the log directory's files, compressed ones included."""
    found: Set[int] = set()
    for name in os.listdir(log_dir):
        path = os.path.join(log_dir, name)
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:  # type: ignore[operator]
            for line in f:
                m = LINE.search(line.rstrip("\n"))
                if m:
                    found.add(int(m.group(1)))
    return found


def _poll_all(follower: FileFollower, seen: List[int]) -> None:
    while True:
        lines, _ = follower.poll()
        for line in lines:
            m = LINE.search(line)
            if m:
                seen.append(int(m.group(1)))
        if not lines and not follower.more:
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rate", type=int, default=500, help="lines written per second")
    ap.add_argument("--modes", nargs="+", default=["copytruncate:1", "copytruncate:0.1", "rename:1", "rename:0.1"],
                    help="MODE:PERIOD, MODE copytruncate or rename, PERIOD seconds between rotations")
    args = ap.parse_args()
    print(f"load average before: {load_average()}; cores: {os.cpu_count()}; "
          f"{args.rate} lines/s for {args.seconds:g} s; the follower polls every {POLL_SECONDS} s\n")
    rows = []
    for spec in args.modes:
        mode, _, period = spec.partition(":")
        rows.append(run(mode, float(period or 1), args.seconds, args.rate))
    print_rows(rows)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
