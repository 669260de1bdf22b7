#!/usr/bin/env python3
"""Write the MPS logs of a node that has run for a long time, monitored every 15 s.

MPS echoes every control command into control.log and never rotates it, so on a
monitored node that file is mostly the monitoring's own commands. This writes what a
busy node's logs hold after the exporter's scrapes of the time before commands were
sent only on change: per 15 s scrape `get_server_list`, `ps` (one row per client) and
`get_server_status`, and every 4th scrape (60 s) the limits and defaults (one command
per GPU each); the format is driver 580's (tests/data/captures/h200-driver580-a).
Beside them, the events that matter: every `churn_every` scrapes a client leaves and
another connects (`NEW CLIENT` in control.log, its connection and a disconnection in
server.log). With the defaults (8 GPUs x 48 clients, one server) a scrape writes
421.5 lines on average, as bench/control_log_bench.py measures.

    python3 bench/steady_log.py DIR [--lines 5000000]      # control.log + server.log in DIR

Used by bench/log_skip_bench.py and the catch-up test (tests/logs/test_catch_up.py).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Tuple

DAEMON_PID = 546
SERVER_PID = 4000
START = 1_764_000_000  # 2025-11-24 16:00:00 UTC: a year before the capture
UUID_PREFIX = "GPU-a20825ef-ef8f-4f37"
PS_HEADING = "PID       ID        SERVER         DEVICE                    NAMESPACE      COMMAND        "


def _command(line: str, answer: List[str]) -> List[str]:
    return ["Accepting connection...", "NEW UI", f"Cmd:{line}", *answer, "UI closed"]


def _ps_row(pid: int, client_id: int, gpu: int) -> str:
    device = f"{UUID_PREFIX[:-2]}{gpu:02d}"
    return f"{pid:<10}{client_id:<10}{SERVER_PID:<15}{device:<26}{'4026531836':<15}{'python3':<15}"


def scrape_messages(clients: List[Tuple[int, int, int]], gpus: int, facts: bool) -> List[str]:
    """The control.log messages of one scrape of the exporter before it sent commands on change."""
    out = _command("get_server_list", [str(SERVER_PID)])
    out += _command("ps", [PS_HEADING] + [_ps_row(*c) for c in clients])
    out += _command(f"get_server_status {SERVER_PID}", ["ACTIVE"])
    if facts:
        out += _command("get_default_active_thread_percentage", ["100.0"])
        for gpu in range(gpus):
            out += _command(f"get_default_device_pinned_mem_limit {gpu}",
                            ["No default pinned memory limit set for the device!"])
        out += _command(f"get_active_thread_percentage {SERVER_PID}", ["100.0"])
        for gpu in range(gpus):
            out += _command(f"get_device_pinned_mem_limit {SERVER_PID} {gpu}", [])
    return out


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(t))) + f".{int(t * 1000) % 1000:03d}"


@contextlib.contextmanager
def steady_history(lines: int) -> Iterator[Tuple[Path, int, int]]:
    """A temporary directory with about `lines` lines of steady-state logs (8 GPUs x 48
    clients): (the directory, lines written, bytes of the two files); removed after."""
    with tempfile.TemporaryDirectory(prefix="mps-steady-") as d:
        directory = Path(d)
        written = write_steady_logs(directory, lines)
        yield directory, written, sum((directory / f"{f}.log").stat().st_size for f in ("control", "server"))


def write_steady_logs(directory: Path, lines: int, gpus: int = 8, clients_per_gpu: int = 48,
                      churn_every: int = 40, start: float = START, incidents_every: int = 0) -> int:
    """Write control.log and server.log into `directory` until about `lines` lines
    (whole scrapes) are written; the number written. `incidents_every` scrapes (0: never),
    server.log also reports a fatal GPU error and a refused client: what the alerts count."""
    clients = [(10000 + g * clients_per_gpu + k, g * clients_per_gpu + k, g)
               for g in range(gpus) for k in range(clients_per_gpu)]
    next_pid, next_id = 10000 + gpus * clients_per_gpu, gpus * clients_per_gpu
    written = 0
    with open(directory / "control.log", "w", encoding="utf-8") as control, \
            open(directory / "server.log", "w", encoding="utf-8") as server:
        control.write(f"[{_stamp(start)} Control {DAEMON_PID:>5}] Starting control daemon using socket "
                      "/tmp/nvidia-mps/control\n"
                      f"[{_stamp(start)} Control {DAEMON_PID:>5}] Starting new server {SERVER_PID} for user 0\n"
                      f"[{_stamp(start)} Control {DAEMON_PID:>5}] NEW SERVER {SERVER_PID}: Ready\n")
        written += 3
        for pid, _, _ in clients:  # the clients running when the logs begin
            server.write(f"[{_stamp(start)} Server {SERVER_PID:>6}] Client {{PID: {pid}, Context ID: 1}} connected\n")
        written += len(clients)
        scrape = 0
        while written < lines:
            t = start + 15.0 * (scrape + 1)
            if scrape % churn_every == churn_every - 1:  # one client leaves, another comes
                gone = clients.pop(0)
                clients.append((next_pid, next_id, gone[2]))
                server.write(f"[{_stamp(t - 5)} Server {SERVER_PID:>6}] Client process {gone[0]} disconnected\n"
                             f"[{_stamp(t - 4)} Server {SERVER_PID:>6}] Client {{PID: {next_pid}, Context ID: 1}} "
                             "connected\n")
                control.write(f"[{_stamp(t - 4)} Control {DAEMON_PID:>5}] Accepting connection...\n"
                              f"[{_stamp(t - 4)} Control {DAEMON_PID:>5}] NEW CLIENT {next_pid} from user 0: "
                              "Server already exists\n")
                written += 4
                next_pid, next_id = next_pid + 1, next_id + 1
            if incidents_every and scrape % incidents_every == incidents_every - 1:
                victim = clients[0][0]
                server.write(f"[{_stamp(t - 3)} Server {SERVER_PID:>6}] Client {{PID: {victim}, Context ID: 1}} "
                             "encountered a fatal GPU error.\n"
                             f"[{_stamp(t - 3)} Server {SERVER_PID:>6}] Server is handling a fatal GPU error.\n"
                             f"[{_stamp(t - 2)} Server {SERVER_PID:>6}] Failed to accept new client. Maximum number "
                             "of clients (48) reached.\n")
                written += 3
            head = f"[{_stamp(t)} Control {DAEMON_PID:>5}] "
            messages = scrape_messages(clients, gpus, facts=scrape % 4 == 0)
            control.write("".join(head + m + "\n" for m in messages))
            written += len(messages)
            scrape += 1
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--lines", type=int, default=5_000_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--clients", type=int, default=48, help="clients per GPU")
    ap.add_argument("--incidents-every", type=int, default=0, help="scrapes between fatal errors and refusals")
    args = ap.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    n = write_steady_logs(args.directory, args.lines, args.gpus, args.clients, incidents_every=args.incidents_every)
    print(f"{n:,} lines in {args.directory} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
