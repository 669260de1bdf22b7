"""Scrape time with 1, 4 and 16 MPS control daemons on the node (the DRA driver starts
one per resource claim), each found by discovery under a DRA root, read side by side
(the exporter) and one after the other (the reference: how it read before).

The daemons are the test fakes at the subprocess boundary: each control command sleeps
1.9 ms (the capture's ctl_latency.txt); every daemon runs one server with 4 clients, and
its log directory holds a short control.log. NVML and /proc are left out: this measures
what the daemons add. Each row prints the machine's load average beside it (other work on
the machine skews the times).

    python3 bench/daemons_bench.py [--daemons 1 4 16] [--scrapes 50] [--procs 2000]

Prints a Markdown table; numbers, not a pass/fail. `--procs N` instead times one scan of
discovery by process (`--mps.discover-processes`) over a fake /proc of N processes, two of
them control daemons and two MPS servers, and over this machine's /proc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.exposition import generate_latest  # noqa: E402

from mps_exporter.collector import build_registry  # noqa: E402
from mps_exporter.config import DRA, Config, DiscoveryRoot  # noqa: E402
from mps_exporter.discovery import scan_processes  # noqa: E402
from mps_exporter.sources import control as mps_control  # noqa: E402
from mps_exporter.sources.base import Backends  # noqa: E402
from mps_exporter.wiring import build_collector, build_readers  # noqa: E402
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer  # noqa: E402

COMMAND_SECONDS = 0.0019  # one control command, measured (tests/data/captures/.../ctl_latency.txt)
SIDE_BY_SIDE = mps_control.MAX_PARALLEL_DAEMONS
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"


def node(root: Path, daemons: int) -> FakeDaemons:
    fakes = FakeDaemons()
    for i in range(daemons):
        directory = root / "gpu.nvidia.com" / "mps" / f"{i:08x}-0000-4000-8000-{i:012x}-a1b2c"
        (directory / "pipe").mkdir(parents=True)
        (directory / "pipe" / "control").touch()
        (directory / "log").mkdir()
        (directory / "log" / "control.log").write_text(
            "[2026-11-25 10:00:00.000 Control  1000] Starting control daemon using socket "
            f"{directory}/pipe/control\n")
        (directory / "log" / "server.log").write_text("")
        server = 5000 + i * 10
        fakes.by_pipe[str(directory / "pipe")] = FakeControlDaemon(
            servers=[FakeServer(server)], clients=[FakeClient(server + c, server, UUID, c) for c in range(1, 5)],
            latency_seconds=COMMAND_SECONDS)
    return fakes


def scrape_times(daemons: int, scrapes: int, parallel: int) -> List[float]:
    mps_control.MAX_PARALLEL_DAEMONS = parallel
    with tempfile.TemporaryDirectory(prefix="daemons-bench-") as tmp:
        root = Path(tmp) / "plugins"
        fakes = node(root, daemons)
        cfg = Config()
        cfg.discover = [DiscoveryRoot(DRA, str(root))]
        cfg.collectors.update(nvml=False, dcgm=False, proc=False)
        cfg.log_timezone = "UTC"
        cfg.procfs = str(Path(tmp) / "proc")  # empty: no /proc lookups
        readers = build_readers(cfg, Backends(control_runner=fakes))
        for reader in readers.values():
            reader.start()
        registry = build_registry(build_collector(cfg, readers), process=False)
        try:
            text = generate_latest(registry).decode()  # first scrape: versions, limits, caches
            assert text.count("mps_control_daemon_up{") == daemons, text
            times = []
            for _ in range(scrapes):
                start = time.perf_counter()
                generate_latest(registry)
                times.append(time.perf_counter() - start)
            return times
        finally:
            for reader in readers.values():
                reader.close()


def fake_proc(root: Path, processes: int) -> Path:
    """A /proc of `processes` processes: 2 control daemons, 2 servers, the rest python3."""
    proc = root / "proc"
    for pid in range(1, processes + 1):
        d = proc / str(pid)
        d.mkdir(parents=True)
        kind = pid % (processes // 4 or 1) == 0 and pid // (processes // 4 or 1)  # 1..4: MPS processes
        comm, argv = ("nvidia-cuda-mps", [b"nvidia-cuda-mps-control", b"-d"]) if kind in (1, 2) else \
            ("nvidia-cuda-mps", [b"nvidia-cuda-mps-server"]) if kind in (3, 4) else ("python3", [b"python3", b"x.py"])
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
        (d / "environ").write_bytes(b"PATH=/usr/bin\0HOME=/root\0" +
                                    (f"CUDA_MPS_PIPE_DIRECTORY={root}/pipe-{pid}\0".encode() if kind else b""))
        (d / "root").symlink_to("/")
        (root / f"pipe-{pid}").mkdir()
    return proc


def scan_times(processes: int, scans: int) -> None:
    with tempfile.TemporaryDirectory(prefix="procs-bench-") as tmp:
        proc = fake_proc(Path(tmp), processes)
        for label, where in ((f"fake, {processes} processes", str(proc)),
                             (f"this machine, {sum(p.isdigit() for p in os.listdir('/proc'))} processes", "/proc")):
            found = len(scan_processes(where))
            wall, cpu = [], []
            for _ in range(scans):
                w, c = time.perf_counter(), time.process_time()
                scan_processes(where)
                wall.append(time.perf_counter() - w)
                cpu.append(time.process_time() - c)
            print(f"| {label} | {found} | {statistics.median(wall) * 1000:.2f} | {max(wall) * 1000:.2f} | "
                  f"{statistics.median(cpu) * 1000:.2f} | {os.getloadavg()[0]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--daemons", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--procs", type=int, default=0, help="time discovery by process over this many processes")
    args = ap.parse_args()
    if args.procs:
        print(f"{args.scrapes} scans each; {os.cpu_count()} CPUs\n")
        print("| /proc | daemons found | median ms | max ms | CPU ms (median) | load avg (1 min) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        scan_times(args.procs, args.scrapes)
        return
    print(f"{args.scrapes} scrapes each; control command {COMMAND_SECONDS * 1000:.1f} ms; "
          f"{os.cpu_count()} CPUs\n")
    print("| daemons | read | median ms | p95 ms | max ms | load avg (1 min) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in args.daemons:
        for label, parallel in (("side by side", SIDE_BY_SIDE), ("one by one", 1)):
            times = sorted(scrape_times(n, args.scrapes, parallel))
            p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
            print(f"| {n} | {label} | {statistics.median(times) * 1000:.1f} | {p95 * 1000:.1f} | "
                  f"{times[-1] * 1000:.1f} | {os.getloadavg()[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
