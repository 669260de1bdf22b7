"""A client killed while it waits on the pending list: the logs never say that it left,
so the log pipeline asks /proc (exporter/logs/liveness.py), and only where /proc shows
the daemon that wrote the log. On the real H100 lines (tests/data/captures/
h100-queuedeath) and on real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple

import pytest

from mps_exporter.families import FamilyBuilder
from mps_exporter.logs.liveness import ProcLiveness
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.render import render_log_metrics
from tests.support.data import QUEUE_DEATH

from .helpers import at, replay

CONTROL = (QUEUE_DEATH / "control.log").read_text().splitlines()
SERVER = (QUEUE_DEATH / "server.log").read_text().splitlines()
DAEMON, KILLED = 497, 547  # the control daemon and the uid 1500 client killed while queued
WHILE_QUEUED = "2026-11-24 16:12:05.000"  # after the kill, before the uid 0 server drained


class FakeLiveness:
    def __init__(self, daemon_visible: bool = True, alive: Iterable[int] = ()) -> None:
        self.daemon_visible, self.alive = daemon_visible, set(alive)
        self.asked: List[int] = []

    def sees_daemon(self, pid: int) -> bool:
        return self.daemon_visible and pid == DAEMON

    def gone(self, pid: int) -> bool:
        self.asked.append(pid)
        return pid not in self.alive


def test_the_logs_alone_keep_the_killed_client_queued():
    snap = replay({"control": CONTROL, "server": SERVER}, until=WHILE_QUEUED).snapshot()
    assert snap.queued["user_switch"] == 1 and [p.pid for p in snap.pending] == [KILLED]


def test_a_queued_client_whose_process_is_gone_stops_counting():
    state = replay({"control": CONTROL, "server": SERVER}, until=WHILE_QUEUED)
    waits_before = state.snapshot().queue_wait["user_switch"].counts
    now = at(WHILE_QUEUED)
    liveness = FakeLiveness()
    assert state.forget_gone(liveness, now) == 1 and liveness.asked == [KILLED]
    snap = state.snapshot()
    assert snap.queued == {"server_starting": 0, "user_switch": 0} and snap.oldest_queued_wait(now) == 0
    assert snap.count("mps_queued_clients_gone_total") == 1
    assert snap.queue_wait["user_switch"].counts == waits_before  # never admitted: no wait observed
    event = snap.recent_events[-1]
    assert (event.kind, event.clients, event.time) == ("left_queue", [KILLED], now)
    assert "uid 1500, user_switch, queued 6 s" in event.detail
    assert state.forget_gone(liveness, now + 2) == 0  # once
    out = FamilyBuilder()
    render_log_metrics(out, "default", snap, now)
    served = {s.name: s.value for fam in out.families() for s in fam.samples}
    assert served["mps_queued_clients_gone_total"] == 1 and served["mps_queued_client_oldest_wait_seconds"] == 0


def test_a_live_queued_client_stays():
    state = replay({"control": CONTROL, "server": SERVER}, until=WHILE_QUEUED)
    assert state.forget_gone(FakeLiveness(alive={KILLED}), at(WHILE_QUEUED)) == 0
    assert state.snapshot().queued["user_switch"] == 1


def test_nothing_is_dropped_unless_proc_shows_the_daemon_that_wrote_the_log():
    """Logs from another machine, another PID namespace or a bundle: their PIDs are not ours."""
    state = replay({"control": CONTROL, "server": SERVER}, until=WHILE_QUEUED)
    liveness = FakeLiveness(daemon_visible=False)
    assert state.forget_gone(liveness, at(WHILE_QUEUED)) == 0 and liveness.asked == []
    assert state.snapshot().queued["user_switch"] == 1


def test_the_dead_clients_connection_refused_by_its_users_server_is_counted():
    """The daemon handed the dead client's connection to uid 1500's new server, which
    refused it; the daemon then stopped answering (the log ends there)."""
    snap = replay({"control": CONTROL, "server": SERVER}).snapshot()
    assert snap.rejections == {"invalid_credentials": 1}
    assert snap.unrecognized == {"control": 0, "server": 0}
    refused = [e for e in snap.recent_events if e.kind == "client_rejected"]
    assert [(e.server_pid, e.time) for e in refused] == [(594, at("2026-11-24 16:12:11.819"))]


def test_the_queued_client_survives_the_state_file():
    state = replay({"control": CONTROL, "server": SERVER}, until=WHILE_QUEUED)
    state.forget_gone(FakeLiveness(), at(WHILE_QUEUED))
    again = type(state).from_dict(state.to_dict())
    assert again.snapshot() == state.snapshot() and again.snapshot().count("mps_queued_clients_gone_total") == 1


# --------------------------------------------------------------- real processes
@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Tuple[subprocess.Popen, subprocess.Popen]]:
    """A stand-in control daemon (sleep under the daemon's name: /proc/PID/cmdline is what
    counts) and a client process, killed on the way out."""
    daemon_binary = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", daemon_binary)
    daemon = subprocess.Popen([str(daemon_binary), "120"])
    client = subprocess.Popen(["sleep", "120"])
    _wait_for_arguments(daemon.pid)
    try:
        yield daemon, client
    finally:
        for p in (daemon, client):
            p.kill()
            p.wait()


def _wait_for_arguments(pid: int, timeout: float = 5.0) -> None:
    """Popen returns once exec() has begun, before the kernel has set up the new program's
    arguments: until then /proc/PID/cmdline reads empty (CI saw the daemon so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never showed its arguments")


def test_a_daemon_pid_read_while_its_arguments_are_empty_is_asked_again(tmp_path: Path):
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cmdline").write_bytes(b"")  # in exec(), or a zombie
    live = ProcLiveness(str(proc))
    assert not live.sees_daemon(42)
    (proc / "42" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\x00-d\x00")
    assert live.sees_daemon(42)
    (proc / "42" / "cmdline").write_bytes(b"")  # an answer once given is kept for that PID
    assert live.sees_daemon(42)


def _wait_for_state(pid: int, state: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == state:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {state}")


def test_proc_liveness_on_real_processes(processes):
    daemon, client = processes
    live = ProcLiveness("/proc")
    assert live.sees_daemon(daemon.pid) and not live.sees_daemon(client.pid) and not live.sees_daemon(os.getpid())
    assert not live.gone(client.pid) and not live.gone(daemon.pid)
    client.kill()
    client.wait()  # reaped: no /proc/PID
    assert live.gone(client.pid)
    zombie = subprocess.Popen(["true"])  # exits; not reaped until wait(): a zombie
    try:
        _wait_for_state(zombie.pid, "Z")
        assert live.gone(zombie.pid)
    finally:
        zombie.wait()


def _control_log(daemon: int, client: int) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return (f"[{now} Control {daemon:5d}] Starting control daemon using socket /tmp/mps/pipe/control\n"
            f"[{now} Control {daemon:5d}] NEW CLIENT {client} from user 1500: Server is not ready, "
            "push client to pending list\n")


def test_the_pipeline_thread_drops_a_queued_client_that_was_killed(processes, tmp_path):
    daemon, client = processes
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "control.log").write_text(_control_log(daemon.pid, client.pid))
    (logs / "server.log").write_text("")
    watched = LogPipeline("default", str(logs), timezone="UTC", proc_root="/proc")
    blind = LogPipeline("default", str(logs), timezone="UTC")  # proc_root None: as in replay
    assert sum(watched.read_once().queued.values()) == 1
    watched.start()
    try:
        client.kill()
        client.wait()
        deadline = time.monotonic() + 10
        while sum(watched.snapshot().queued.values()) != 0:
            assert time.monotonic() < deadline, "the killed client still counts as queued"
            time.sleep(0.1)
        assert watched.snapshot().count("mps_queued_clients_gone_total") == 1
    finally:
        watched.stop()
    assert sum(blind.read_once().queued.values()) == 1
