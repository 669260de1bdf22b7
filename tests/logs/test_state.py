"""The state machine on small hand-written logs: each rule, each cap, persistence."""

from __future__ import annotations

import json

import pytest

from mps_exporter import contract
from mps_exporter.logs import state as st
from mps_exporter.logs.state import LogState, NegativeCounter

from .helpers import at, replay


def ctl(*rows: str) -> list:
    """rows 'HH:MM:SS.mmm message' -> control.log lines of daemon 100."""
    return [f"[2026-11-21 {r[:12]} Control   100] {r[13:]}" for r in rows]


def srv(pid: int, *rows: str) -> list:
    return [f"[2026-11-21 {r[:12]} Server {pid:5d}] {r[13:]}" for r in rows]


START = ("00:00:00.000 Starting control daemon using socket /tmp/mps/control",)


def test_oldest_wait_leaves_out_pushes_dated_1970_or_in_the_future():
    """A corrupt push line (1970, or a day ahead) does not hold the oldest-wait gauge at
    decades: the plausible waits decide it, and with none it is 0."""
    log = ctl(*START,
              "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list")
    log.insert(1, "[1970-01-01 00:00:01.000 Control   100] NEW CLIENT 11 from user 0: Server is not ready, "
                  "push client to pending list")
    log += ["[2026-11-22 00:00:02.000 Control   100] NEW CLIENT 12 from user 0: Server is not ready, "
            "push client to pending list"]
    snap = replay({"control": log}).snapshot()
    assert snap.queued["server_starting"] == 3  # all three are pending: counted
    assert snap.oldest_queued_wait(at("00:00:04.000")) == pytest.approx(3.0)  # client 10's wait only
    only_corrupt = replay({"control": [log[0], log[1], log[-1]]}).snapshot()
    assert only_corrupt.queued["server_starting"] == 2 and only_corrupt.oldest_queued_wait(at("00:00:04.000")) == 0


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
    assert (snap.count("mps_server_handoffs_total"), snap.count("mps_server_shutdown_deferrals_total")) == (1, 1)
    assert snap.pushes == {"user_switch": 1, "server_starting": 0}
    assert snap.queue_wait["user_switch"].total == pytest.approx(0.6)
    command = ctl(*START,
                  "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
                  "00:00:02.000 NEW UI", "00:00:02.000 Cmd:shutdown_server 20",
                  "00:00:02.000 Try shutting down server 20, backoff is disabled", "00:00:02.000 UI closed",
                  "00:00:02.100 Server 20 exited with status 0")
    assert replay({"control": command}).snapshot().count("mps_server_handoffs_total") == 0


def test_quit_block_still_carries_the_exits():
    # After `Cmd:quit` no `UI closed` comes: the exits inside the block are real events.
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready",
              "00:00:03.000 NEW UI", "00:00:03.000 Cmd:quit",
              "00:00:03.000 Try shutting down server 20, backoff is disabled",
              "00:00:03.100 Server 20 exited with status 0", "00:00:03.101 Exit with status 0")
    snap = replay({"control": log}).snapshot()
    assert snap.server_exits == {"0": 1} and snap.count("mps_server_handoffs_total") == 0


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


def test_pushes_are_one_counter_that_a_reason_fix_up_does_not_lower():
    # Per reason, server_starting went 1 -> 0 above; the exported counter has no reason.
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.logs.render import render_log_metrics

    push = "00:00:05.000 NEW CLIENT 11 from user 7: Server is not ready, push client to pending list"
    values = []
    for lines in ([push], [push, "00:00:05.000 Try shutting down server 20, backoff is disabled"]):
        out = FamilyBuilder()
        render_log_metrics(out, "default", replay({"control": ctl(*lines)}).snapshot(), 0.0)
        (sample,) = [s for f in out.families() for s in f.samples if s.name == "mps_client_queue_pushes_total"]
        values.append(sample.value)
    assert values == [1.0, 1.0]


def test_start_failure_and_exit_status():
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0",
              "00:00:01.010 Server encountered a fatal exception. Shutting down",
              "00:00:01.020 Server 20 exited with status 1")
    snap = replay({"control": log}).snapshot()
    assert snap.count("mps_server_start_failures_total") == 1 and snap.server_exits == {"1": 1} and snap.count("mps_server_starts_total") == 0


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
    assert (snap.count("mps_client_connections_total"), snap.count("mps_client_disconnections_total")) == (1, 1)
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
    assert snap.count("mps_fatal_gpu_errors_total") == 2
    assert [e.clients for e in snap.recent_events if e.kind == "fatal_gpu_error"] == [[30], [30]]



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
    assert snap.count("mps_fatal_gpu_errors_total") == 100 and len(snap.recent_events) == st.MAX_RECENT_EVENTS
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
    for i in range(contract.MAX_COMMAND_VERBS + 10):
        state.apply(parse_line(f"[2026-11-21 00:00:01.000 Control 1] Cmd:verb{i}", "control"), "control")
    snap = state.snapshot()
    assert sum(snap.queued.values()) == st.MAX_PENDING
    assert len(snap.client_start_times) == st.MAX_CLIENTS
    assert len(snap.commands) == contract.MAX_COMMAND_VERBS + 1 and snap.commands["other"] == 10


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
    for broken in ({}, {**good, "counts": None}, {**good, "counts": {"mps_server_starts_total": "x"}}, {**good, "queue_wait": {"user_switch": {"counts": [1], "sum": 0},
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
    far_future = lambda: at("9999-12-31 23:59:59.000") + 86400  # noqa: E731  (every line's time believed)
    hist = replay({"control": log}, state=LogState(clock=far_future)).snapshot().queue_wait["server_starting"]
    assert (hist.count, hist.total, hist.implausible) == (0, 0.0, 1)
    restored = LogState.from_dict(json.loads(json.dumps(replay({"control": log}, state=LogState(clock=far_future))
                                                        .to_dict())), clock=far_future)
    assert restored.snapshot().queue_wait["server_starting"].implausible == 1


@pytest.mark.parametrize("future", ["9999-12-31 23:59:59.000", "2026-11-23 00:00:01.300"])
def test_a_line_dated_more_than_a_day_ahead_moves_no_time(future):
    now = at("2026-11-21 12:00:00.000")
    log = ctl(*START, "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "00:00:01.001 Starting new server 20 for user 0") + [
        f"[{future} Control   100] NEW CLIENT 10 from user 0: Server already exists"]
    state = replay({"control": log}, state=LogState(clock=lambda: now))
    snap = state.snapshot()
    assert snap.last_line_times["control"] == at("00:00:01.001")  # the newest believed time, not the future one
    assert state.implausible_times == 1
    hist = snap.queue_wait["server_starting"]
    assert hist.count == 1 and hist.total < 0.01  # served: at the time of the last believed line
    assert all(e.time <= now for e in snap.recent_events)


def test_a_saved_time_from_the_future_is_dropped_and_negative_counters_refused():
    now = at("2026-11-21 12:00:00.000")
    saved = LogState().to_dict()
    saved["daemon"]["last_line_times"] = {"control": at("9999-12-31 23:59:59.000"), "server": now - 5}
    restored = LogState.from_dict(json.loads(json.dumps(saved)), clock=lambda: now)
    assert restored.snapshot().last_line_times == {"server": now - 5}
    for path in (("counts", "mps_server_starts_total"), ("maps", "lines", "control")):
        broken = json.loads(json.dumps(LogState().to_dict()))
        broken[path[0]][path[1]] = -1e308 if len(path) == 2 else {path[2]: -1}
        with pytest.raises(NegativeCounter):
            LogState.from_dict(broken)


def test_a_long_but_plausible_wait_is_summed():
    log = ctl(*START, "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
              "23:00:01.000 NEW CLIENT 10 from user 0: Server already exists")
    hist = replay({"control": log}).snapshot().queue_wait["server_starting"]
    assert (hist.count, hist.total, hist.implausible) == (1, 23 * 3600.0, 0)


# ---------------------------------------------------------------- MPS at its edges (issue 11)
REFUSAL = "Failed to accept new client. Maximum number of clients (48) reached."  # verbatim, H100, MPS 13000


def _server_with_client(pid: int, client: int, t: str) -> list:
    return srv(pid, f"{t} Active Threads Percentage set to 100.0", f"{t} Server has started",
               f"{t} Client {{PID: {client}, Context ID: 0}} connected")


def test_refusals_are_counted_with_the_limit_the_line_gives():
    server = _server_with_client(20, 30, "00:00:01.100") + srv(20, *(f"00:00:0{i}.000 {REFUSAL}" for i in (2, 3, 4)))
    snap = replay({"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0",
                                  "00:00:01.100 NEW SERVER 20: Ready"), "server": server}).snapshot()
    assert snap.rejections == {"client_limit": 3} and snap.client_limit == 48
    assert snap.unrecognized == {"control": 0, "server": 0}
    assert [e.kind for e in snap.recent_events] == ["client_rejected"] * 3


def test_a_refused_client_is_named_and_its_two_disconnect_lines_count_once():
    """As server.log of the H100 run shows a refusal: the refused client's second context
    connects, the refusal follows, `Client process P disconnected` comes twice."""
    from tests.support.data import EDGES
    lines = [l for l in (EDGES / "server.log").read_text().splitlines()
             if "2786" in l or "Failed to accept" in l and "18:28:45.502" in l or "Server  3617] Active" in l]
    snap = replay({"server": lines}).snapshot()
    assert snap.rejections == {"client_limit": 1}
    assert [(e.kind, e.clients) for e in snap.recent_events] == [("client_rejected", [2786])]
    assert (snap.count("mps_client_connections_total"), snap.count("mps_client_disconnections_total")) == (1, 1)


def _two_exits(killed_first: bool) -> dict:
    """Server 20 is killed under client 30 (no disconnect, control.log says status 0);
    server 21's client 31 leaves, then it shuts down cleanly."""
    control = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.100 NEW SERVER 20: Ready",
                  "00:00:05.000 Server 20 exited with status 0",
                  "00:00:06.000 Starting new server 21 for user 0", "00:00:06.100 NEW SERVER 21: Ready",
                  "00:00:09.000 NEW UI", "00:00:09.000 Cmd:shutdown_server 21", "00:00:09.001 UI closed",
                  "00:00:09.200 Server 21 exited with status 0")
    server = (_server_with_client(20, 30, "00:00:01.100") + _server_with_client(21, 31, "00:00:06.100")
              + srv(21, "00:00:08.000 Client process 31 disconnected", "00:00:09.100 Server has been notified to shutdown",
                    "00:00:09.100 Waiting for current clients to finish", "00:00:09.100 Exiting"))
    return {"control": control, "server": server}


def test_a_server_that_exits_with_a_client_attached_is_told_from_a_clean_exit():
    files = _two_exits(True)
    # As `dump` reads them: all of control.log, then all of server.log, then settle().
    snap = replay(files).snapshot()
    assert snap.count("mps_server_exits_with_clients_total") == 1 and snap.server_exits == {"0": 2}
    assert [(e.kind, e.server_pid, e.clients) for e in snap.recent_events if e.kind == "exit_with_clients"] == [
        ("exit_with_clients", 20, [30])]
    # As the live reader meets them: both files in time order, settled after each line.
    state = LogState()
    lines = sorted([(l[1:24], "control", l) for l in files["control"]] + [(l[1:24], "server", l) for l in files["server"]])
    for _, file, line in lines:
        state.apply(st_parse(line, file), file)
        state.settle()
    assert state.snapshot().count("mps_server_exits_with_clients_total") == 1


def test_an_exit_is_decided_only_once_server_log_is_read_past_it():
    files = _two_exits(True)
    state = replay({"control": files["control"][:4]}, settle=False)  # server 20's exit, server.log not read yet ...
    assert state.snapshot().count("mps_server_exits_with_clients_total") == 0
    for line in files["server"]:  # ... decided at the first server.log line after the exit
        state.apply(st_parse(line, "server"), "server")
        if line_ts(line) > "00:00:05.000":
            break
    assert state.snapshot().count("mps_server_exits_with_clients_total") == 1


def test_client_limits_are_those_in_force_when_it_connected():
    control = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.100 NEW SERVER 20: Ready",
                  "00:00:03.000 NEW UI", "00:00:03.000 Cmd:set_device_pinned_mem_limit 20 0 3G", "00:00:03.001 UI closed",
                  "00:00:03.100 NEW UI", "00:00:03.100 Cmd:set_active_thread_percentage 20 30", "00:00:03.101 UI closed")
    server = srv(20, "00:00:01.100 Active Threads Percentage set to 100.0",
                 "00:00:01.100 Device pinned memory limit for device 0 set to 0x200000000 bytes",
                 "00:00:01.100 Server has started", "00:00:02.000 Client {PID: 30, Context ID: 0} connected",
                 "00:00:04.000 Client {PID: 31, Context ID: 0} connected")
    snap = replay({"control": control, "server": server}).snapshot()
    assert snap.client_limits == {30: (100.0, {0: 8 << 30}), 31: (30.0, {0: 3 << 30})}
    # the server's own limits are the newest
    assert (snap.servers[20].active_thread_percentage, snap.servers[20].pinned_limits) == (30.0, {0: 3 << 30})
    # `0` removes a limit; where the logs do not show the server's start, they give no client limits
    control += ctl("00:00:05.000 NEW UI", "00:00:05.000 Cmd:set_device_pinned_mem_limit 20 0 0", "00:00:05.001 UI closed")
    server += srv(20, "00:00:06.000 Client {PID: 32, Context ID: 0} connected")
    snap = replay({"control": control, "server": server}).snapshot()
    assert snap.client_limits[32] == (30.0, {}) and snap.client_limits[30] == (100.0, {0: 8 << 30})
    snap = replay({"control": control, "server": server[2:]}).snapshot()  # no start lines: logs start later
    assert snap.client_limits == {}


def test_set_commands_are_counted_for_the_control_source():
    """Every `Cmd:set_*` counts, even after the verb table is full ("other"); reads do not."""
    state = LogState()
    from mps_exporter.logs.parser import parse_line
    for i in range(contract.MAX_COMMAND_VERBS):
        state.apply(parse_line(f"[2026-11-21 00:00:01.000 Control 1] Cmd:verb{i}", "control"), "control")
    for line in ("Cmd:get_server_list", "Cmd:get_default_device_pinned_mem_limit 0", "Cmd:ps",
                 "Cmd:set_default_device_pinned_mem_limit 0 2G", "Cmd:set_default_active_thread_percentage 25",
                 "Cmd:set_device_pinned_mem_limit 20 0 3G"):
        state.apply(parse_line(f"[2026-11-21 00:00:02.000 Control 1] {line}", "control"), "control")
    snap = state.snapshot()
    assert snap.limit_commands == 3 and snap.commands["other"] == 6


def test_edge_state_survives_the_state_file_and_older_files_load():
    files = _two_exits(True)
    state = replay({"control": files["control"][:4], "server": files["server"][:3] + srv(20, f"00:00:02.000 {REFUSAL}")},
                   settle=False)
    restored = LogState.from_dict(json.loads(json.dumps(state.to_dict())))
    for line in files["server"][3:]:
        restored.apply(st_parse(line, "server"), "server")
    restored.settle()
    snap = restored.snapshot()
    assert (snap.rejections, snap.client_limit) == ({"client_limit": 1}, 48)
    # A version 1 file written before the exits with clients and the refusals were kept.
    old = state.to_dict()
    for key in ("attached", "pending_exits", "client_limit", "unnamed", "counts", "signals"):
        del old[key]
    del old["maps"]["rejections"]
    old["counters"] = {"handoffs": 0, "shutdown_deferrals": 0, "client_connections": 1, "client_disconnections": 0,
                       "server_starts": 1, "server_start_failures": 0, "fatal_gpu_errors": 0}
    loaded = LogState.from_dict(json.loads(json.dumps(old))).snapshot()
    assert loaded.counts == {"mps_client_connections_total": 1, "mps_server_starts_total": 1}
    assert (loaded.rejections, loaded.client_limit, loaded.limit_commands) == ({}, None, 0)


def st_parse(line: str, file: str):
    from mps_exporter.logs.parser import parse_line
    from .helpers import UTC
    return parse_line(line, file, UTC)


def line_ts(line: str) -> str:
    return line[12:24]


def test_recorded_h100_run_limits_as_mps_enforced_them():
    """tests/data/captures/h100-edges: client D (3867) connected to server 3884 under the
    daemon default 8G; `set_device_pinned_mem_limit 3884 0 3G` and `set_active_thread_percentage
    3884 30` followed; E (3907) connected after. MPS let D grow to 3.5 GiB (not 8.5: '3.87 GiB
    free' of 8G) and refused E at 3.5 GiB ('725.45 MiB free' of 3G); E's CUDA saw 38 of 132 SMs."""
    from tests.support.data import EDGES
    files = {f: (EDGES / f"{f}.log").read_text().splitlines() for f in ("control", "server")}
    snap = replay(files, until="2026-11-23 18:29:10.000").snapshot()
    assert snap.client_limits[3867] == (100.0, {0: 8 << 30})
    assert snap.client_limits[3907] == (30.0, {0: 3 << 30})
    assert (snap.servers[3884].active_thread_percentage, snap.servers[3884].pinned_limits) == (30.0, {0: 3 << 30})
    for client, free in ((EDGES / "clients" / "lc_D.txt", "3.87 GiB is free"), (EDGES / "clients" / "lc_E.txt", "725.45 MiB")):
        assert free in client.read_text()


def test_start_failures_server_log_alone_shows_are_counted_once():
    """NVIDIA/k8s-device-plugin#685's server.log (roles `Other` and `Legacy Server`, `Failed
    to start : invalid argument`) with no control.log beside it: each failure counts. With
    control.log too (`Starting new server` ... `exited with status 1`), each counts once."""
    from pathlib import Path
    legacy = Path(__file__).parent / "fixtures" / "legacy"
    files = {f: (legacy / f"{f}.log").read_text().splitlines() for f in ("control", "server")}
    alone = replay({"server": files["server"]}).snapshot()
    assert alone.count("mps_server_start_failures_total") == 2 and alone.unrecognized["server"] == 0
    assert [(e.kind, e.server_pid, e.detail) for e in alone.recent_events] == [
        ("start_failure", 95, "Failed to start : invalid argument"), ("start_failure", 98, "Failed to start : invalid argument")]
    both = replay(files).snapshot()
    assert both.count("mps_server_start_failures_total") == 2
    # server.log read first (a live reader between two polls), then control.log: still once each
    state = LogState()
    for file in ("server", "control"):
        for line in files[file]:
            state.apply(st_parse(line, file), file)
    assert state.snapshot().count("mps_server_start_failures_total") == 2


def test_terminate_client_counts_each_process_once_and_is_an_event():
    # terminate_client 20 10: one `requesting` line per context of the client.
    log = srv(20, "00:00:05.000 MPS server requesting client {PID: 10, Context ID: 1} to exit",
              "00:00:05.001 MPS server requesting client {PID: 10, Context ID: 2} to exit",
              "00:00:05.010 Client termination succeeded.",
              "00:00:07.000 MPS server requesting client {PID: 11, Context ID: 1} to exit",
              "00:00:07.010 Client termination succeeded.")
    state = replay({"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0"), "server": log})
    snap = state.snapshot()
    assert snap.count("mps_clients_terminated_total") == 2 and snap.unrecognized == {"control": 0, "server": 0}
    assert [(e.kind, e.server_pid, e.clients) for e in snap.recent_events] == \
        [("client_terminated", 20, [10]), ("client_terminated", 20, [11])]
    again = LogState.from_dict(json.loads(json.dumps(state.to_dict()))).snapshot()
    assert again.count("mps_clients_terminated_total") == 2


def test_server_priority_is_kept_per_server_and_survives_a_restart():
    state = replay({"control": ctl(*START, "00:00:01.000 Starting new server 20 for user 0",
                                   "00:00:01.500 NEW SERVER 20: Ready"),
                    "server": srv(20, "00:00:01.200 Server Priority set to 1")})
    assert state.snapshot().servers[20].priority == 1
    again = LogState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again.snapshot().servers[20].priority == 1


def test_the_issue_24_run_server_priority_and_terminated_client():
    """The H100 run's logs (tests/data/captures/h100-limits24): server 1332 started after
    `set_default_client_priority 1`; client 1478 of server 1515 ended by terminate_client."""
    from tests.support.data import LIMITS24

    files = {f: (LIMITS24 / f"{f}.log").read_text().splitlines() for f in ("control", "server")}
    snap = replay(files, until="2026-11-25 13:26:18.000").snapshot()
    assert snap.servers[1332].priority == 1
    snap = replay(files).snapshot()
    assert snap.count("mps_clients_terminated_total") == 1 and snap.unrecognized == {"control": 0, "server": 0}
    assert [(e.server_pid, e.clients) for e in snap.recent_events if e.kind == "client_terminated"] == [(1515, [1478])]


def test_a_state_file_with_the_state_nothing_read_still_loads():
    # Written before the daemon's version and running flag and the per-server fatal error
    # lists were dropped: those keys are ignored, the rest resumes.
    log = ctl(*START, "00:00:01.000 Starting new server 20 for user 0", "00:00:01.200 NEW SERVER 20: Ready")
    d = replay({"control": log}).to_dict()
    d["daemon"].update(version="13000", running=True)
    for server in d["servers"]:
        server.update(fatal_errors=1, sticky=[30], reset=[0])
    resumed = LogState.from_dict(json.loads(json.dumps(d))).snapshot()
    assert resumed.count("mps_server_starts_total") == 1 and set(resumed.servers) == {20}
    assert "version" not in LogState.from_dict(d).to_dict()["daemon"]


def test_the_ceiling_mps_showed_when_clients_raised_their_device_connections():
    """2 x H200 (tests/data/captures/h200x2-ceiling, issue 38): 20 clients with
    CUDA_DEVICE_MAX_CONNECTIONS=8 at once. MPS made 16 of them ACTIVE and refused 4 with
    `Reached maximum number of device connections.` (no number), each after its context
    connected: the ceiling is 16 at every refusal, not the 17-20 processes connected."""
    from tests.support.data import CEILING

    files = {f: (CEILING / f"{f}.log").read_text().splitlines() for f in ("control", "server")}
    snap = replay(files, until="2026-11-28 04:08:21.300").snapshot()  # after the second refusal
    assert snap.client_limit == 16 and snap.rejections["client_limit"] == 2
    snap = replay(files).snapshot()
    assert snap.client_limit == 16 and snap.rejections == {"client_limit": 4}
    assert snap.unrecognized == {"control": 0, "server": 0}
    again = LogState.from_dict(json.loads(json.dumps(replay(files, until="2026-11-28 04:08:21.250").to_dict())))
    assert again.to_dict()["active"] == replay(files, until="2026-11-28 04:08:21.250").to_dict()["active"]


# ------------------------------------------------ indexes instead of scans (issue 42)
def _apply(state: LogState, file: str, *rows: str) -> LogState:
    return replay({file: ctl(*rows) if file == "control" else srv(20, *rows)}, state=state, settle=False)


def test_a_client_that_moved_servers_stays_when_its_old_server_exits():
    state = LogState()
    _apply(state, "control", *START, "00:00:01.000 Starting new server 20 for user 0",
           "00:00:01.100 NEW SERVER 20: Ready")
    replay({"server": srv(20, "00:00:02.000 Client {PID: 50, Context ID: 0} connected")
            + srv(30, "00:00:03.000 Client {PID: 50, Context ID: 0} connected",
                  "00:00:03.000 Client {PID: 51, Context ID: 0} connected")}, state=state, settle=False)
    _apply(state, "control", "00:00:04.000 Server 20 exited with status 0")
    state.settle()
    assert set(state.snapshot().client_start_times) == {50, 51}  # both are server 30's now
    _apply(state, "control", "00:00:05.000 Starting new server 30 for user 0", "00:00:05.100 Server 30 exited with status 0")
    assert state.snapshot().client_start_times == {}


def test_an_admitted_client_leaves_the_queue_by_its_oldest_push():
    state = _apply(LogState(), "control", *START,
                   "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
                   "00:00:02.000 NEW CLIENT 11 from user 0: Server is not ready, push client to pending list",
                   "00:00:03.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
                   "00:00:05.000 NEW CLIENT 10 from user 0: Server already exists")
    snap = state.snapshot()
    assert [(p.pid, p.pushed_at) for p in snap.pending] == [(11, at("00:00:02.000")), (10, at("00:00:03.000"))]
    assert snap.queue_wait["server_starting"].total == pytest.approx(4.0)  # from the first push


def test_the_queue_cap_drops_the_oldest_from_every_index(monkeypatch):
    monkeypatch.setattr(st, "MAX_PENDING", 3)
    state = _apply(LogState(), "control", *START, *(
        f"00:00:0{i}.000 NEW CLIENT {10 + i} from user 0: Server is not ready, push client to pending list"
        for i in range(4)))
    assert [p.pid for p in state.snapshot().pending] == [11, 12, 13]
    _apply(state, "control", "00:00:05.000 NEW CLIENT 10 from user 0: Server already exists",
           "00:00:06.000 NEW CLIENT 11 from user 0: Server already exists")
    snap = state.snapshot()
    assert sum(snap.queue_wait["server_starting"].counts) == 1  # 10 had left: only 11's wait
    assert [p.pid for p in snap.pending] == [12, 13]


def test_the_queue_s_indexes_survive_the_state_file():
    state = _apply(LogState(), "control", *START,
                   "00:00:01.000 NEW CLIENT 10 from user 0: Server is not ready, push client to pending list",
                   "00:00:01.500 NEW CLIENT 11 from user 1500: Server is not ready, push client to pending list",
                   "00:00:02.000 Starting new server 20 for user 0", "00:00:03.000 NEW SERVER 20: Ready")
    state = LogState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert state.waiting() and [p.pid for p in state.snapshot().pending] == [11]  # 10 was handed over
    _apply(state, "control", "00:00:04.000 Server 20 exited with status 0")  # 10's wait: push to handover
    assert state.snapshot().queue_wait["server_starting"].total == pytest.approx(2.0)
    _apply(state, "control", "00:00:05.000 NEW CLIENT 11 from user 1500: Server already exists")
    assert not state.waiting() and state.snapshot().pending == []
    assert state.to_dict()["pending"] == []


def test_a_push_s_reason_follows_the_users_of_the_servers_kept(monkeypatch):
    monkeypatch.setattr(st, "MAX_SERVERS", 1)
    push = "NEW CLIENT {} from user {}: Server is not ready, push client to pending list"
    state = _apply(LogState(), "control", *START, "00:00:01.000 Starting new server 20 for user 0",
                   "00:00:01.100 " + push.format(10, 0), "00:00:01.200 " + push.format(11, 1500))
    assert state.snapshot().pushes == {"server_starting": 1, "user_switch": 1}
    _apply(state, "control", "00:00:02.000 Starting new server 20 for user 1500",  # the same PID, another user
           "00:00:02.100 " + push.format(12, 1500), "00:00:02.200 " + push.format(13, 0))
    assert state.snapshot().pushes == {"server_starting": 2, "user_switch": 2}
    _apply(state, "control", "00:00:03.000 Starting new server 21 for user 7",  # 20's record leaves (the cap)
           "00:00:03.100 " + push.format(14, 7), "00:00:03.200 Server 21 exited with status 0",
           "00:00:03.300 " + push.format(15, 1500))
    assert state.snapshot().pushes == {"server_starting": 4, "user_switch": 2}


def test_a_shutdown_for_a_waiting_client_switches_only_other_users_waits():
    push = "NEW CLIENT {} from user {}: Server is not ready, push client to pending list"
    state = _apply(LogState(), "control", *START, "00:00:01.000 " + push.format(10, 0),
                   "00:00:01.100 " + push.format(11, 1500), "00:00:01.200 " + push.format(12, 1500),
                   "00:00:02.000 Starting new server 20 for user 0",
                   "00:00:03.000 Try shutting down server 20, backoff is enabled")
    snap = state.snapshot()
    assert snap.pushes == {"server_starting": 1, "user_switch": 2}
    assert {p.pid: p.reason for p in snap.pending} == {10: "server_starting", 11: "user_switch", 12: "user_switch"}


def test_every_event_the_state_machine_counts_is_a_declared_counted_event():
    """A misspelt name in a handler would count into a key no metric publishes."""
    import ast
    import inspect

    from mps_exporter.logs import state
    from mps_exporter.logs.render import COUNTED_EVENTS
    names = {n.value for n in ast.walk(ast.parse(inspect.getsource(state)))
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("mps_")}
    assert len(names) >= 10 and names <= set(COUNTED_EVENTS)


def test_a_saved_map_of_counted_events_is_bounded():
    saved = LogState().to_dict()
    saved["counts"] = {f"mps_x{i}_total": 1 for i in range(st.MAX_COUNTED_EVENTS + 1)}
    with pytest.raises(ValueError):
        LogState.from_dict(json.loads(json.dumps(saved)))
    saved["counts"] = {"mps_counted_by_a_newer_exporter_total": 2, "mps_server_starts_total": 0}
    assert LogState.from_dict(saved).snapshot().counts == {"mps_counted_by_a_newer_exporter_total": 2}


def test_connections_the_control_daemon_could_not_accept_are_counted_not_unrecognized():
    # control.log as 208 clients arrived at once on 4 x H200 (driver 580): accept() failed
    # between the accepted clients (reports/2026-11-28-h200x4, run 3).
    log = ctl(*START,
              "00:00:01.000 Accepting connection...",
              "00:00:01.000 NEW CLIENT 1226 from user 0: Server already exists",
              "00:00:01.000 Accepting connection...", "00:00:01.000 Unable to accept connection",
              "00:00:01.000 Accepting connection...", "00:00:01.000 Unable to accept connection",
              "00:00:01.000 Accepting connection...", "00:00:01.000 NEW UI")
    snap = replay({"control": log}).snapshot()
    assert snap.count("mps_control_accept_failures_total") == 2
    assert snap.unrecognized["control"] == 0
