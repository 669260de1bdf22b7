"""A control binary that misbehaves: what each read of the control source costs.

Stand-ins for `nvidia-cuda-mps-control` (shell scripts in a temporary directory) are
read through the real runner and DaemonReader, 10 times each, as scrapes would:

- orphan: answers one server, then leaves a detached child holding its stdout open
  (issue 26: every later scrape waited its full 5 s deadline);
- giant: answers `get_server_list` with 10 MB (1.43 M PIDs), then a normal daemon;
- normal: answers one server at once (the baseline).

Prints per case: reads that succeeded, p50/max seconds per read, and this process's
RSS before, at the worst and after (the giant answer must be one failed read and
leave memory within 10 % of before).

    python3 bench/control_bench.py [--reads 10] [--timeout 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from exporter.config import DaemonConfig  # noqa: E402
from report import load_average, print_rows  # noqa: E402
from exporter.sources import control as mc  # noqa: E402

# A daemon with one server and no clients, as the real one answers each command.
DAEMON = """read cmd
case "$cmd" in
  get_server_list) echo 713 ;;
  ps) echo "PID ID SERVER DEVICE NAMESPACE COMMAND" ;;
  get_server_status*) echo ACTIVE ;;
  *percentage*) echo 100.0 ;;
  get_default_client_priority) echo 0 ;;
  *) ;;
esac
"""
SCRIPTS = {
    "normal": DAEMON,
    "orphan": "setsid sh -c 'echo $$ >> {tmp}/orphans; exec sleep 60' &\n" + DAEMON,
    "giant": ("if [ ! -e {tmp}/giant-done ]; then touch {tmp}/giant-done; read cmd\n"
              "exec " + sys.executable + " -c \"import sys; sys.stdout.write('1234567\\\\n' * 1_430_000)\"\nfi\n"
              + DAEMON),
}


def rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def run_case(name: str, reads: int, timeout: float) -> Dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="mps-control-bench-") as tmp:
        binary = os.path.join(tmp, "nvidia-cuda-mps-control")
        with open(binary, "w", encoding="utf-8") as f:
            f.write("#!/bin/sh\n" + SCRIPTS[name].format(tmp=tmp))
        os.chmod(binary, 0o755)
        source = mc.DaemonReader(DaemonConfig("default", tmp, tmp), mc.ControlClient(tmp, binary, timeout))
        gc.collect()
        before = worst = rss_kib()
        took: List[float] = []
        ok = 0
        errors: List[str] = []
        for _ in range(reads):
            started = time.monotonic()
            reading = source.read(devices=[])
            took.append(time.monotonic() - started)
            ok += reading.up
            if reading.error:
                errors.append(reading.error.replace(binary, "the binary")[:70])
            worst = max(worst, rss_kib())
        gc.collect()
        after = rss_kib()
        orphans = os.path.join(tmp, "orphans")
        if os.path.exists(orphans):
            with open(orphans, encoding="ascii") as f:
                for pid in f.read().split():
                    subprocess.run(["kill", "-9", pid], capture_output=True)
    return {"case": name, "reads up": f"{ok}/{reads}", "read p50 / max, s":
            f"{statistics.median(took):.3f} / {max(took):.3f}",
            "RSS before / worst / after, MB": f"{before / 1024:.1f} / {worst / 1024:.1f} / {after / 1024:.1f}",
            "errors": "; ".join(sorted(set(errors))) or "-"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=5.0, help="the command deadline (--mps.command-timeout)")
    args = ap.parse_args()
    print(f"load average before: {load_average()}; cores: {os.cpu_count()}\n")
    rows = [run_case(name, args.reads, args.timeout) for name in ("normal", "orphan", "giant")]
    print_rows(rows)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
