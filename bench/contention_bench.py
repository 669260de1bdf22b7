"""Scrapes on cores that other processes keep busy, as in a client storm.

`mps-exporter serve` over the fakes (the synthetic 1 GPU x 48 clients scenario, the
capture's logs followed from a copy, every control command a real process start
(/bin/true) plus the daemon's answer after `--control-latency` seconds) runs in a
process of its own; `--hogs` processes spin beside it; one client scrapes it over
HTTP every `--period` seconds, as Prometheus does (OpenMetrics, gzip, a 1 s timeout).
With the default latency (30 ms, over the 10 ms `--collector.control-wait`) the
daemon answers as it does while MPS admits a storm, and scrapes serve its last answer.

Each hand-off from the scrape to another thread waits for a core there: in the live
storms of issue 29 the slowest scrapes came while 52 processes started on 16 cores.

    python3 bench/contention_bench.py [--hogs 8] [--scrapes 150] [--runs 3]

Prints a Markdown table: scrape p50/p90/p99/max and the exporter's CPU per second.
Numbers, not a pass/fail; compare trees on the same machine in one sitting.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
SPIN = "while True: pass"


def serve(port: int, control_latency: float) -> None:
    """The exporter over the synthetic scenario, until killed."""
    from mps_exporter.config import Config, DaemonConfig
    from mps_exporter.service import serve as serve_exporter
    from tests.fakes.fake_control import FakeControlDaemon
    from tests.support import scenarios
    from tests.support.data import CAPTURE

    class SpawningDaemon(FakeControlDaemon):
        """Each command also starts a process, as the real `nvidia-cuda-mps-control` is one."""

        def __call__(self, argv: Any, stdin_text: str, env: Dict[str, str], timeout: float) -> Any:
            subprocess.run(["/bin/true"], start_new_session=True, check=False)
            return super().__call__(argv, stdin_text, env, timeout)

    tmp = Path(tempfile.mkdtemp(prefix="contention-"))
    scen = scenarios.synthetic(tmp, gpus=1, clients_per_gpu=48, latency=True)
    scen.daemon.__class__ = SpawningDaemon
    scen.daemon.latency_seconds = control_latency
    logs = tmp / "logs"
    logs.mkdir()
    for name in ("control.log", "server.log"):
        shutil.copy(CAPTURE / name, logs / name)
    scen.cfg.daemons = [DaemonConfig("default", "/tmp/mps/pipe", str(logs))]
    scen.cfg.collectors["logs"] = True
    scen.cfg.refresh_interval = Config.refresh_interval
    scen.cfg.control_wait = Config.control_wait
    scen.cfg.listen_address = f"127.0.0.1:{port}"
    serve_exporter(scen.cfg, readers=scen.readers())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(port: int, hogs: int, scrapes: int, period: float, control_latency: float) -> Dict[str, float]:
    exporter = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--control-latency", str(control_latency)])
    spinners: List[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                break
            except OSError as e:
                if time.monotonic() > deadline or exporter.poll() is not None:
                    raise RuntimeError("the exporter did not answer") from e
                time.sleep(0.1)
        time.sleep(2)  # the first background rounds and cached facts
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(hogs)]
        time.sleep(0.5)
        walls: List[float] = []
        cpu0, t0 = cpu_seconds(exporter.pid), time.monotonic()
        for i in range(scrapes + 3):
            start = time.perf_counter()
            conn.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip",
                                                     "X-Prometheus-Scrape-Timeout-Seconds": "1"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"scrape answered {response.status}")
            wall = time.perf_counter() - start
            if i >= 3:
                walls.append(wall)
            time.sleep(max(0.0, period - wall))
        cpu = (cpu_seconds(exporter.pid) - cpu0) / (time.monotonic() - t0)
    finally:
        for p in spinners + [exporter]:
            p.kill()
            p.wait()
    walls.sort()

    def pct(p: float) -> float:
        return walls[min(len(walls) - 1, int(p * len(walls)))] * 1000

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": walls[-1] * 1000, "cpu_ms_per_second": cpu * 1000}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hogs", type=int, default=8, help="spinning processes beside the exporter")
    ap.add_argument("--scrapes", type=int, default=150)
    ap.add_argument("--period", type=float, default=0.2, help="seconds between scrapes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--control-latency", type=float, default=0.03, help="seconds the fake daemon takes to answer")
    ap.add_argument("--port", type=int, default=19123)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.control_latency)
        return
    print(f"Scrapes of 1 GPU x 48 clients over HTTP every {args.period:g} s, {args.hogs} spinning processes beside, "
          f"control answering in {args.control_latency * 1000:g} ms ({os.cpu_count()} CPUs)\n")
    print("| run | scrapes | p50 ms | p90 ms | p99 ms | max ms | exporter CPU ms/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in range(1, args.runs + 1):
        r = one_run(args.port, args.hogs, args.scrapes, args.period, args.control_latency)
        print(f"| {run} | {args.scrapes} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} | {r['max']:.1f} | "
              f"{r['cpu_ms_per_second']:.1f} |", flush=True)
    print("\n" + json.dumps({"hogs": args.hogs, "period": args.period, "control_latency": args.control_latency}))


if __name__ == "__main__":
    main()
