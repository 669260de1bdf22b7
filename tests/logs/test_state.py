"""The state machine on small hand-written logs: each rule, each cap, persistence."""

from __future__ import annotations

import json

import pytest

from mps_exporter import bounds
from mps_exporter.logs import state as st
from mps_exporter.logs.state import LogState

from .helpers import at, replay


def ctl(*rows: str) -> list:
    """rows 'HH:MM:SS.mmm message' -> control.log lines of daemon 100."""
    return [f"[2026-11-21 {r[:12]} Control   100] {r[13:]}" for r in rows]


def srv(pid: int, *rows: str) -> list:
    return [f"[2026-11-21 {r[:12]} Server {pid:5d}] {r[13:]}" for r in rows]


START = ("00:00:00.000 Starting control daemon using socket /tmp/mps/control",)


def test_cold_start_queue_then_admission():
    log = ctl(*START,
              "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "00:00:01.001 Starting new server 20 for user 0")
    snap = replay({"control": log}).snapshot()
    assert snap.queued == {"server_starting": 1, "user_switch": 0}
    assert snap.oldest_queued_wait(at("00:00:03.000")) == pytest.approx(2.0)
    log += ctl("00:00:01.250 NEW SERVER 20: Ready", "00:00:01.300 NEW CLIENT 10 from user 0: Server already exists")
    snap = replay({"control": log}).snapshot()
    assert snap.queued == {"server_starting": 0, "user_switch": 0} and snap.oldest_queued_wait(at("00:00:09.0")) == 0
    assert snap.queue_wait["server_starting"].count == 1
    assert snap.queue_wait["server_starting"].total == pytest.approx(0.3)
    assert snap.servers[20].uid == 0 and snap.servers[20].start_time == pytest.approx(at("00:00:01.250"))


def test_single_context_client_is_observed_when_its_server_exits():
    # No `Server already exists` ever follows: the wait up to the handover (Ready) counts.
    log = ctl(*START,
              "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "00:00:01.001 Starting new server 20 for user 0",
              "00:00:01.400 NEW SERVER 20: Ready")
    snap = replay({"control": log}).snapshot()
    assert snap.queued["server_starting"] == 0 and snap.queue_wait["server_starting"].count == 0
    snap = replay({"control": log + ctl("00:00:09.000 Server 20 exited with status 0")}).snapshot()
    assert snap.queue_wait["server_starting"].count == 1
    assert snap.queue_wait["server_starting"].total == pytest.approx(0.4)


def test_handoff_only_when_the_daemon_itself_shuts_a_server_down():
    user_switch = ctl(*START,
                      "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
                      "00:00:05.000 NEW CLIENT 11 from user 7: Server is not ready, push client to pending list",
                      "00:00:05.000 Try shutting down server 20, backoff is disabled",
                      "00:00:05.001 Server 20 has 1 active worker threads. Server will not shutdown.",
                      "00:00:05.200 Try shutting down server 20, backoff is enabled",
                      "00:00:05.300 Server 20 exited with status 0",
                      "00:00:05.301 Starting new server 21 for user 7", "00:00:05.500 NEW SERVER 21: Ready",
                      "00:00:05.600 NEW CLIENT 11 from user 7: Server already exists")
    snap = replay({"control": user_switch}).snapshot()
    assert (snap.handoffs, snap.shutdown_deferrals) == (1, 1)
    assert snap.pushes == {"user_switch": 1, "server_starting": 0}
    assert snap.queue_wait["user_switch"].total == pytest.approx(0.6)
    command = ctl(*START,
                  "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
                  "00:00:02.000 NEW UI", "00:00:02.000 Cmd:shutdown_server 20",
                  "00:00:02.000 Try shutting down server 20, backoff is disabled", "00:00:02.000 UI closed",
                  "00:00:02.100 Server 20 exited with status 0")
    assert replay({"control": command}).snapshot().handoffs == 0


def test_quit_block_still_carries_the_exits():
    # After `Cmd:quit` no `UI closed` comes: the exits inside the block are real events.
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
              "00:00:03.000 NEW UI", "00:00:03.000 Cmd:quit",
              "00:00:03.000 Try shutting down server 20, backoff is disabled",
              "00:00:03.100 Server 20 exited with status 0", "00:00:03.101 Exit with status 0")
    snap = replay({"control": log}).snapshot()
    assert snap.server_exits == {"0": 1} and snap.handoffs == 0 and snap.daemon_running is False


def test_unknown_lines_inside_a_command_are_output_not_unrecognized():
    log = ctl(*START, "00:00:01.000 NEW UI", "00:00:01.000 Cmd:lspart",
              "00:00:01.000 GPU Partition ID    SMs  whatever a new table looks like", "00:00:01.000 UI closed",
              "00:00:02.000 something outside any command")
    snap = replay({"control": log}).snapshot()
    assert snap.unrecognized["control"] == 1 and snap.commands == {"lspart": 1}


def test_reason_fixed_up_when_the_daemon_shuts_down_another_users_server():
    # The exporter started after the server did (its history rotated away): the push
    # looks like a cold start until the daemon shuts the unknown server down for it.
    log = ctl("00:00:05.000 NEW CLIENT 11 from user 7: Server is not ready, push client to pending list",
              "00:00:05.000 Try shutting down server 20, backoff is disabled")
    snap = replay({"control": log}).snapshot()
    assert snap.queued == {"user_switch": 1, "server_starting": 0}
    assert snap.pushes == {"user_switch": 1, "server_starting": 0}


def test_start_failure_and_exit_status():
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0",
              "00:00:01.010 Server encountered a fatal exception. Shutting down",
              "00:00:01.020 Server 20 exited with status 1")
    snap = replay({"control": log}).snapshot()
    assert snap.server_start_failures == 1 and snap.server_exits == {"1": 1} and snap.server_starts == 0


def test_daemon_restart_forgets_the_old_daemons_servers_and_queue():
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
              "00:00:02.000 NEW CLIENT 11 from user 7: Server is not ready, push client to pending list",
              "00:01:00.000 Starting control daemon using socket /tmp/mps/control")
    snap = replay({"control": log}).snapshot()
    assert snap.servers == {} and snap.queued == {"user_switch": 0, "server_starting": 0}
    assert snap.queue_wait["user_switch"].count == 0  # never admitted: no made-up wait


def test_client_process_counts_once_and_late_server_lines_do_not_revive_servers():
    log = {"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
                          "00:00:09.000 Server 20 exited with status 0"),
           "server": srv(20, "00:00:01.100 Active Threads Percentage set to 50.0",
                         "00:00:02.000 Client {PID: 30, Context ID: 0} connected",
                         "00:00:02.100 Client {PID: 30, Context ID: 1} connected",
                         "00:00:02.200 Client {PID: 30, Context ID: 2} connected",
                         "00:00:03.000 Client process 30 disconnected")}
    snap = replay(log).snapshot()  # control first: 20 has exited before its server.log is read
    assert (snap.client_connections, snap.client_disconnections) == (1, 1)
    assert snap.servers == {} and snap.client_start_times == {}


def test_server_facts_before_control_announces_the_server():
    # Live, server.log may be read before control.log's `Starting new server`.
    state = replay({"server": srv(20, "00:00:01.100 Active Threads Percentage set to 50.0",
                                  "00:00:01.100 Device pinned memory limit for device 1 set to 1024 bytes")})
    assert state.snapshot().servers == {}
    replay({"control": ctl("00:00:01.000 Starting new server 20 for user 3")}, state=state)
    server = state.snapshot().servers[20]
    assert (server.uid, server.active_thread_percentage, server.pinned_limits) == (3, 50.0, {1: 1024})


def test_fatal_error_report_counts_once_per_report():
    report = ("Client {PID: 30, Context: 1} encountered a fatal GPU error.", "Server is handling a fatal GPU error.",
              "Client {PID: 30, Context ID: 1} on device 0 to be torn down", "The following devices will be reset:",
              "0", "The following client process have a sticky error set:", "30")
    rows = [f"00:00:02.000 {m}" for m in report] + ["00:00:03.000 Client process 30 disconnected"]
    rows += [f"00:00:04.000 {m}" for m in report]
    log = {"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready"),
           "server": srv(20, *rows)}
    snap = replay(log).snapshot()
    assert snap.fatal_gpu_errors == 2 and snap.servers[20].fatal_errors == 2
    assert (snap.servers[20].reset_devices, snap.servers[20].sticky_clients) == ([0], [30])



def test_pending_clients_and_recent_events_with_their_times():
    # What `status` lists: who waits since when, and what went wrong when.
    log = {"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
                          "00:00:05.000 NEW CLIENT 11 from user 7: Server is not ready, push client to pending list",
                          "00:00:05.000 Try shutting down server 20, backoff is disabled",
                          "00:00:05.300 Server 20 exited with status 0",
                          "00:00:05.301 Starting new server 21 for user 7",
                          "00:00:05.400 Server 21 exited with status 1"),
           "server": srv(20, "00:00:02.000 Client {PID: 30, Context: 1} encountered a fatal GPU error.",
                         "00:00:02.000 Server is handling a fatal GPU error.",
                         "00:00:02.000 The following client process have a sticky error set:", "00:00:02.000 30",
                         "00:00:02.000 31")}
    waiting = replay(log, until="00:00:05.100").snapshot()
    assert [(p.pid, p.uid, p.reason, p.pushed_at) for p in waiting.pending] == [(11, 7, "user_switch", at("00:00:05.000"))]
    snap = replay(log).snapshot()
    events = sorted((e.time, e.kind, e.server_pid, e.clients, e.detail) for e in snap.recent_events)
    assert events == [(at("00:00:02.000"), "fatal_gpu_error", 20, [30, 31], ""),
                      (at("00:00:05.300"), "handoff", 20, [], "uid 0"),
                      (at("00:00:05.400"), "start_failure", 21, [], "")]
    assert [p.pid for p in snap.pending] == [11]  # the server that would take it never became ready
    snap.recent_events[0].clients.append(99)  # a snapshot is a copy
    assert 99 not in replay(log).snapshot().recent_events[0].clients


def test_recent_events_are_capped():
    rows = []
    for i in range(100):  # 100 reports, each closed by an ordinary line
        rows += [f"00:01:{i // 10:02d}.{i % 10}00 Client {{PID: {i}, Context: 1}} encountered a fatal GPU error.",
                 f"00:01:{i // 10:02d}.{i % 10}00 Client process {i} disconnected"]
    snap = replay({"server": srv(20, *rows)}).snapshot()
    assert snap.fatal_gpu_errors == 100 and len(snap.recent_events) == st.MAX_RECENT_EVENTS
    assert [e.clients for e in snap.recent_events[-2:]] == [[98], [99]]


def test_caps_keep_memory_flat():
    state = LogState()
    from mps_exporter.logs.parser import parse_line
    for i in range(st.MAX_PENDING + 50):
        state.apply(parse_line(f"[2026-11-21 00:00:01.000 Control 1] NEW CLIENT {i} from user 0: "
                               "Server is not ready, push client to pending list", "control"), "control")
    for i in range(st.MAX_CLIENTS + 50):
        state.apply(parse_line(f"[2026-11-21 00:00:01.000 Server 2] Client {{PID: {i}, Context ID: 0}} connected",
                               "server"), "server")
    for i in range(bounds.MAX_COMMAND_VERBS + 10):
        state.apply(parse_line(f"[2026-11-21 00:00:01.000 Control 1] Cmd:verb{i}", "control"), "control")
    snap = state.snapshot()
    assert sum(snap.queued.values()) == st.MAX_PENDING
    assert len(snap.client_start_times) == st.MAX_CLIENTS
    assert len(snap.commands) == bounds.MAX_COMMAND_VERBS + 1 and snap.commands["other"] == 10


def test_snapshot_is_a_copy():
    state = replay({"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0")})
    snap = state.snapshot()
    snap.servers[20].uid = 99
    snap.commands["x"] = 1
    assert state.snapshot().servers[20].uid == 0 and "x" not in state.snapshot().commands


def test_to_dict_round_trip_on_the_capture(capture_lines):
    for until in ("04:21:46.000", "04:22:20.000", None):  # running clients, a queued client, the end
        state = replay(capture_lines, until=until)
        blob = json.dumps(state.to_dict())
        again = LogState.from_dict(json.loads(blob))
        assert again.snapshot() == state.snapshot()
        assert json.dumps(again.to_dict()) == blob


def test_from_dict_rejects_malformed():
    good = LogState().to_dict()
    for broken in ({}, {**good, "counters": None}, {**good, "queue_wait": {"user_switch": {"counts": [1], "sum": 0},
                                                                           "server_starting": {"counts": [1], "sum": 0}}}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            LogState.from_dict(broken)


@pytest.mark.parametrize("admitted", [
    "[9999-12-31 23:59:59.000 Control   100] NEW CLIENT 10 from user 0: Server already exists",  # a line dated 9999
    "[2026-11-20 00:00:01.300 Control   100] NEW CLIENT 10 from user 0: Server already exists",  # clock stepped back
    "[2026-12-21 00:00:01.300 Control   100] NEW CLIENT 10 from user 0: Server already exists",  # a month later
])
def test_implausible_wait_is_counted_apart_not_summed(admitted):
    log = ctl(*START, "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "00:00:01.001 Starting new server 20 for user 0") + [admitted]
    hist = replay({"control": log}).snapshot().queue_wait["server_starting"]
    assert (hist.count, hist.total, hist.implausible) == (0, 0.0, 1)
    restored = LogState.from_dict(json.loads(json.dumps(replay({"control": log}).to_dict())))
    assert restored.snapshot().queue_wait["server_starting"].implausible == 1


def test_a_long_but_plausible_wait_is_summed():
    log = ctl(*START, "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "23:00:01.000 NEW CLIENT 10 from user 0: Server already exists")
    hist = replay({"control": log}).snapshot().queue_wait["server_starting"]
    assert (hist.count, hist.total, hist.implausible) == (1, 23 * 3600.0, 0)
