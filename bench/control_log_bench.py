#!/usr/bin/env python3
"""What the exporter writes into control.log: lines per scrape at a steady state.

MPS echoes every control command and its answer into control.log and never rotates
it. This replays a node of 8 GPUs x 48 clients (one server; NVML, the control daemon
and /proc faked at their library boundaries, as in tests/support/scenarios.py) and
scrapes it every 15 simulated seconds for 10 simulated minutes (no waiting: the
clock is the benchmark's). The fake daemon echoes each command into a real
control.log the way driver 580 does (`Accepting connection...`, `NEW UI`, `Cmd:...`,
the answer's lines, `UI closed`), and the exporter's real log pipeline reads it
before each scrape, as its thread would have in the 15 s between two.

Two policies on the same node:
- change-driven (the exporter now): commands only when the logs, NVML's MPS process
  lists or the server list say an answer can have changed;
- no signals (what every scrape sent before, and still sends where neither the logs
  nor NVML are read): get_server_list, ps, get_server_status every scrape, limits
  and defaults every 60 s.

Then a client arrives (its `NEW CLIENT` line in control.log, its process in NVML's
list) and the next scrape must list it.

    python3 bench/control_log_bench.py [--gpus 8] [--clients 48] [--minutes 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mps_exporter.render import render  # noqa: E402
from mps_exporter.sources.control import DaemonReader  # noqa: E402
from mps_exporter.wiring import build_collector, build_readers  # noqa: E402
from tests.fakes.fake_control import FakeClient  # noqa: E402
from tests.fakes.fake_pynvml import FakeProcess  # noqa: E402
from tests.support import scenarios  # noqa: E402

SCRAPE_SECONDS = 15.0
START = 1_795_000_000.0  # simulated unix time of the first scrape
NEW_CLIENT = 20000


def run(tmp: Path, gpus: int, clients: int, minutes: float, signals: bool) -> Tuple[List[int], int, bool]:
    """Lines added to control.log by each scrape at a steady state; the commands of the
    scrape after a client arrived; whether that scrape listed it."""
    sc = scenarios.synthetic(tmp, gpus=gpus, clients_per_gpu=clients)
    logs = tmp / "logs"
    logs.mkdir()
    (logs / "server.log").write_text("")
    now = [START]
    sc.daemon.control_log, sc.daemon.clock = logs / "control.log", lambda: now[0]
    sc.daemon.echo(["Starting control daemon using socket /tmp/mps/pipe/control",
                    "CUDA MPS Control binary version: 13000", "Starting new server 4000 for user 0",
                    "NEW SERVER 4000: Ready"])
    sc.cfg.daemons[0].log_directory = str(logs)
    sc.cfg.collectors["logs"] = True
    readers = build_readers(sc.cfg, sc.backends())
    collector = build_collector(sc.cfg, readers, clock=lambda: now[0])

    def scrape() -> Tuple[int, int, object]:
        if "logs" in readers:
            readers["logs"].catch_up()  # what the pipeline's thread read since the last scrape
        lines, commands = sc.daemon.log_lines, len(sc.daemon.received)
        snap = collector.snapshot()
        control = snap.outcomes["control"]
        if not control.success:  # a policy that fails reads nothing: its row would say nothing
            sys.exit(f"the control read failed: {control.error}")
        now[0] += SCRAPE_SECONDS
        return sc.daemon.log_lines - lines, len(sc.daemon.received) - commands, snap

    scrape()  # the first read: every command once; the daemon's DaemonReader exists from here
    source = readers["control"].source["default"]
    source.clock = lambda: now[0]
    if not signals:  # the same node, the signals not passed on
        source.read = lambda devices, _signals, uuids=None: DaemonReader.read(source, devices, uuids=uuids)
    scrape()  # the ps that confirms the first
    per_scrape = [scrape()[0] for _ in range(int(minutes * 60 / SCRAPE_SECONDS))]

    sc.daemon.echo(["Accepting connection...", f"NEW CLIENT {NEW_CLIENT} from user 0: Server already exists"])
    sc.daemon.clients.append(FakeClient(NEW_CLIENT, 4000, sc.nvml.gpus[0].uuid, 999))
    sc.nvml.gpus[0].mps_processes.append(FakeProcess(NEW_CLIENT, 1 << 30))
    _, commands, snap = scrape()
    shown = any(s.labels.get("pid") == str(NEW_CLIENT) for f in render(snap).families() if f.name == "mps_client_info"
                for s in f.samples)
    for reader in readers.values():
        reader.close()
    return per_scrape, commands, shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--clients", type=int, default=48, help="clients per GPU")
    ap.add_argument("--minutes", type=float, default=10.0, help="simulated minutes of 15 s scrapes")
    args = ap.parse_args()
    print(f"# control.log lines the exporter adds: {args.gpus} GPUs x {args.clients} clients, one server, "
          f"15 s scrapes over {args.minutes:g} simulated minutes (load average {os.getloadavg()[0]:.2f})\n")
    print("| policy | scrapes | lines per scrape: mean | max | per day | commands in the scrape after "
          "a client arrived | that scrape lists it |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, signals in (("change-driven", True), ("no signals (every command every scrape)", False)):
        with tempfile.TemporaryDirectory() as d:
            per_scrape, commands, shown = run(Path(d), args.gpus, args.clients, args.minutes, signals)
        mean = sum(per_scrape) / len(per_scrape)
        print(f"| {name} | {len(per_scrape)} | {mean:.1f} | {max(per_scrape)} | "
              f"{mean * 86400 / SCRAPE_SECONDS / 1000:.1f} k | {commands} | {'yes' if shown else 'NO'} |")


if __name__ == "__main__":
    main()
