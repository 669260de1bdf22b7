#!/usr/bin/env python3
"""On a lent GPU machine (issue 44): the Xid thread's CPU and the exporter's stop with
NVML's event wait at the old 1 s and at the current WAIT_MS, on the real driver.

For each wait, `mps-exporter serve` runs (no MPS daemon needed) with the watcher's wait set
before the sources are built; once /metrics answers with every GPU's Xid events
registered, the Xid thread's schedstat is read over --seconds, then SIGTERM and the
seconds until the process ended and its exit status. Prints one JSON line per wait.

    PYTHONPATH=/tmp/pkg python3 tests/gpu/xid_wait.py [--seconds 30] [--waits 1000,10000]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cost_bench import threads_cpu  # noqa: E402
from tests.gpu.node_cost import NAMED_THREADS  # noqa: E402
from tests.support.prometheus import free_port  # noqa: E402

# The watcher's default wait (bound when XidWatcher was defined) replaced before serve builds
# it; then serve as node_cost starts it, each thread named for its schedstat.
SERVE = ("import sys\nfrom mps_exporter.sources import xid\n"
         "d = list(xid.XidWatcher.__init__.__defaults__); d[2] = int(sys.argv.pop(1))\n"
         "xid.XidWatcher.__init__.__defaults__ = tuple(d)\n") + NAMED_THREADS


def xid_thread_ns(pid: int) -> Optional[int]:
    return next((ns for name, ns in (threads_cpu(pid) or {}).values() if name == "mps-xid-events"), None)


def metrics(port: int) -> Optional[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return None


def one(wait_ms: int, seconds: float) -> Dict[str, object]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(wait_ms), "serve", "--web.listen-address",
                             f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: Dict[str, object] = {"wait_ms": wait_ms}
    try:
        deadline = time.monotonic() + 60
        text = None
        while time.monotonic() < deadline:
            text = metrics(port)
            if text and "mps_gpu_xid_events_registered" in text:
                break
            time.sleep(0.2)
        registered = re.findall(r'mps_gpu_xid_events_registered\{[^}]*\} (\S+)', text or "")
        out["registered"] = registered
        time.sleep(2)
        before = xid_thread_ns(proc.pid)
        time.sleep(seconds)
        after = xid_thread_ns(proc.pid)
        out["xid_thread_ms_per_s"] = (None if before is None or after is None
                                      else round((after - before) / 1e6 / seconds, 4))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        out["stop_seconds"] = round(time.monotonic() - t0, 3)
        out["exit_status"] = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    out["stderr_tail"] = err[-600:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--waits", default="1000,10000")
    args = ap.parse_args()
    for wait in (int(w) for w in args.waits.split(",")):
        print(json.dumps(one(wait, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
