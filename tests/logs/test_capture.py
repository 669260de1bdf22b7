"""Replaying the real capture (tests/data/captures/h200-driver580-a) gives exact numbers.

Each expected number is derived in a comment from the capture's README (the
scenario table) and from the log lines themselves, not from this code's output.
Two daemon runs appended to the same files: run 1 (daemon 546, 04:19:21-04:20:59)
and run 2 (daemon 1419, from 04:21:26).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from mps_exporter.contract import QUEUE_WAIT_BUCKETS
from mps_exporter.logs.pipeline import LogPipeline

from .helpers import at, replay


@pytest.fixture(scope="module")
def final(capture_lines):
    return replay(capture_lines).snapshot()


def test_every_line_is_read_and_understood(final, capture_lines):
    # `wc -l`: control.log 1071 lines, server.log 935 lines; every line of a real
    # 13.x session must match a rule (command output included), so none is unrecognized.
    assert final.lines == {"control": 1071, "server": 935}
    assert len(capture_lines["control"]) == 1071 and len(capture_lines["server"]) == 935
    assert final.unrecognized == {"control": 0, "server": 0}
    assert final.truncated == {"control": 0, "server": 0}


def test_servers_started_and_exited(final):
    # NEW SERVER ... Ready: run 1 654, 934, 976, 1075, 1149; run 2 1589, 2521, 2563,
    # 2662, 2736 = 10. Each exits with status 0 (`Server N exited with status 0` x10),
    # none before being ready, so no start failure. Both runs end with `quit`, so no
    # server is left running.
    assert final.count("mps_server_starts_total") == 10
    assert final.server_exits == {"0": 10}
    assert final.count("mps_server_start_failures_total") == 0
    assert final.servers == {}
    assert final.daemon_pid == 1419


def test_handoffs_and_deferrals(final):
    # Handoffs (README: "server 1589 ... exits; server 2521 starts for uid 1500" and
    # "server 2521 is shut down, server 2563 starts for uid 0"; run 1 did the same):
    # 654(uid 0)->934(uid 1500), 934->976(uid 0), 1589(uid 0)->2521(uid 1500), 2521->2563(uid 0) = 4.
    # shutdown_server 976/1075/2563/2662 and quit are commands, not handoffs.
    assert final.count("mps_server_handoffs_total") == 4
    # "refuses to shut down while it has clients (backoff 200 ms .. 6400 ms)": 200, 400,
    # 800, 1600, 3200, 6400 -> 6 refusals for 654 in run 1 and 6 for 1589 in run 2.
    assert final.count("mps_server_shutdown_deferrals_total") == 12


def test_pending_pushes_by_reason(final):
    # `push client to pending list` x10. user_switch (another user's server running):
    # 897 (uid 1500, server 654 of uid 0), 959 (uid 0, server 934 of uid 1500),
    # 2483 (uid 1500, 1589 of uid 0), 2546 (uid 0, 2521 of uid 1500) = 4.
    # server_starting (no server at all): 586, 1043, 1131, 1527, 2629, 2718 = 6.
    assert final.pushes == {"user_switch": 4, "server_starting": 6}
    assert final.queued == {"user_switch": 0, "server_starting": 0}
    assert final.oldest_queued_since is None


def test_queue_wait_histogram(final):
    # Push -> the same PID's `Server already exists`:
    # user_switch: 897 04:19:56.944->04:20:09.929 = 12.985; 959 04:20:15.454->15.826 = 0.372;
    #              2483 04:22:16.630->04:22:29.612 = 12.982; 2546 04:22:35.165->35.529 = 0.364
    # server_starting: 586 24.390->24.709 = 0.319; 1043 30.497->30.810 = 0.313;
    #              1131 41.905->42.201 = 0.296; 1527 29.197->29.509; 2629 50.117->50.434 = 0.317;
    #              2718 01.426->01.709 = 0.283
    user = [at("04:20:09.929") - at("04:19:56.944"), at("04:20:15.826") - at("04:20:15.454"),
            at("04:22:29.612") - at("04:22:16.630"), at("04:22:35.529") - at("04:22:35.165")]
    starting = [at("04:19:24.709") - at("04:19:24.390"), at("04:20:30.810") - at("04:20:30.497"),
                at("04:20:42.201") - at("04:20:41.905"), at("04:21:29.509") - at("04:21:29.197"),
                at("04:22:50.434") - at("04:22:50.117"), at("04:23:01.709") - at("04:23:01.426")]
    for reason, waits in (("user_switch", user), ("server_starting", starting)):
        hist = final.queue_wait[reason]
        assert hist.count == len(waits)
        assert hist.total == pytest.approx(sum(waits), abs=1e-6)
        expected = [(b, sum(1 for w in waits if w <= b)) for b in QUEUE_WAIT_BUCKETS] + [(float("inf"), len(waits))]
        assert hist.cumulative() == expected
    # The two slow user switches land in the 10..15 s bucket, everything else under 0.5 s.
    assert dict(final.queue_wait["user_switch"].cumulative())[10.0] == 2
    assert dict(final.queue_wait["user_switch"].cumulative())[15.0] == 4


def test_the_user_switch_wait_of_12_9_seconds(capture_lines):
    # README: uid 1500's client arrives at 04:22:16.630 and is pushed; 1589 exits at
    # 04:22:29.332, 2521 is ready at 29.578 and the client's `Server already exists`
    # follows at 29.612: about 12.9 s (12.982).
    during = replay(capture_lines, until="04:22:20.000").snapshot()
    assert during.queued == {"user_switch": 1, "server_starting": 0}
    assert during.oldest_queued_since == pytest.approx(at("04:22:16.630"))
    assert during.oldest_queued_wait(at("04:22:29.000")) == pytest.approx(29.000 - 16.630)
    before = replay(capture_lines, until="04:22:29.600").snapshot()
    assert before.queued == {"user_switch": 0, "server_starting": 0}  # handed to 2521 at 29.578
    after = replay(capture_lines, until="04:22:29.612").snapshot()
    added = after.queue_wait["user_switch"].total - before.queue_wait["user_switch"].total
    assert added == pytest.approx(12.982, abs=1e-6)
    assert after.queue_wait["user_switch"].count == before.queue_wait["user_switch"].count + 1


def test_fatal_gpu_error_counts_once(final):
    # README 04:23:06 fault: one client (2755) hits `encountered a fatal GPU error` and
    # the server logs `Server is handling a fatal GPU error.`: one error, two lines.
    # The second client's device-side assert (`Worker is in reset`) is no fatal error.
    assert final.count("mps_fatal_gpu_errors_total") == 1


def test_fatal_report_lists_are_read(capture_lines):
    # The report lists device 0 under "will be reset" and PID 2755 under "sticky error".
    snap = replay(capture_lines, until="04:23:08.700").snapshot()
    (event,) = [e for e in snap.recent_events if e.kind == "fatal_gpu_error" and e.server_pid == 2736]
    assert 2755 in event.clients  # the client left with a sticky error: `status` names it


def test_client_processes_count_once(final, capture_lines):
    # Each client logs `Client {PID: P, Context ID: 0} connected` and `... Context ID: 1}
    # connected` and one `Client process P disconnected`: processes = distinct PIDs of
    # context-0 connections (grep, not this code's parser).
    pids = set(re.findall(r"Client \{PID: (\d+), Context ID: 0\} connected", "\n".join(capture_lines["server"])))
    disconnects = re.findall(r"Client process (\d+) disconnected", "\n".join(capture_lines["server"]))
    assert len(pids) == 64 and len(disconnects) == 64
    assert final.count("mps_client_connections_total") == 64
    assert final.count("mps_client_disconnections_total") == 64
    assert final.client_start_times == {}


def test_control_commands_by_verb(final, capture_lines):
    # Every `Cmd:<verb>` line counts under its verb; output lines such as `654`,
    # `ACTIVE`, `Server 713 not found` or the `set_default_device_pinned_mem_limit 0 2G.`
    # echo are not commands. README: run 2 alone issued `quit` and 2 `shutdown_server`.
    verbs = Counter(re.findall(r"\] Cmd:(\w+)", "\n".join(capture_lines["control"])))
    assert sum(verbs.values()) == 114
    assert final.commands == dict(verbs)
    assert final.commands["quit"] == 2 and final.commands["shutdown_server"] == 4
    assert final.commands["get_server_list"] == 43
    assert final.commands["set_default_device_pinned_mem_limit"] == 4  # echo lines not counted


def test_server_facts_while_running(capture_lines):
    # README 04:22:46 limits: with the default at 25 % and 2G, server 2662 starts for
    # uid 0 (`Starting new server 2662 for user 0`), is ready at 04:22:50.386 and logs
    # `Active Threads Percentage set to 25.0` and `... for device 0 set to 0x80000000 bytes`.
    snap = replay(capture_lines, until="04:22:52.000").snapshot()
    assert set(snap.servers) == {2662}
    srv = snap.servers[2662]
    assert srv.uid == 0 and srv.running and srv.ready
    assert srv.start_time == pytest.approx(at("04:22:50.386"))
    assert srv.active_thread_percentage == 25.0
    assert srv.pinned_limits == {0: 0x80000000} == {0: 2 * 1024 ** 3}


def test_client_start_times_while_running(capture_lines):
    # README 04:21:38: 3 clients holding 8, 2 and 1 GiB on server 1589; server.log:
    # 1647 connected 04:21:40.191, 1649 at 40.324, 1648 at 40.348 (context 0).
    snap = replay(capture_lines, until="04:21:46.000").snapshot()
    assert snap.client_start_times == pytest.approx(
        {1647: at("04:21:40.191"), 1649: at("04:21:40.324"), 1648: at("04:21:40.348")})
    assert snap.servers[1589].active_thread_percentage == 100.0 and snap.servers[1589].pinned_limits == {}


def test_pipeline_read_once_on_the_capture(capture_dir):
    snap = LogPipeline("default", str(capture_dir), timezone="UTC").read_once()
    assert snap.count("mps_server_starts_total") == 10 and snap.count("mps_server_handoffs_total") == 4 and snap.count("mps_client_connections_total") == 64
    assert snap.queue_wait["user_switch"].count == 4
