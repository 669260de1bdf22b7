"""parse_line: formats across MPS versions, command output, time zones, bad input."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone

import pytest

from mps_exporter.logs import events as ev
from mps_exporter.logs.parser import PARSER_ERROR, parse_line, resolve_timezone
from mps_exporter.logs.pipeline import LogPipeline

from tests.support.data import CAPTURE

from .conftest import FIXTURES
from .helpers import UTC

T = "[2026-11-21 04:22:16.630 Control  1419] "
S = "[2026-11-21 04:23:08.506 Server  2736] "
TS = datetime(2026, 11, 21, 4, 22, 16, 630000, tzinfo=UTC).timestamp()


def c(msg: str):
    return parse_line(T + msg, "control", UTC)


def s(msg: str):
    return parse_line(S + msg, "server", UTC)


def test_control_events_of_13x():
    assert c("NEW CLIENT 2483 from user 1500: Server is not ready, push client to pending list") == \
        ev.ClientPushed(TS, 1419, 2483, 1500)
    assert c("NEW CLIENT 2483 from user 1500: Server already exists") == ev.ClientAccepted(TS, 1419, 2483, 1500)
    assert c("Starting new server 2521 for user 1500") == ev.ServerStarting(TS, 1419, 2521, 1500)
    assert c("NEW SERVER 2521: Ready") == ev.ServerReady(TS, 1419, 2521)
    assert c("Server 1589 exited with status 0") == ev.ServerExited(TS, 1419, 1589, 0)
    assert c("Server 1589 has 2 active worker threads. Server will not shutdown.") == ev.ShutdownDeferred(TS, 1419, 1589, 2)
    assert c("Try shutting down server 1589, backoff is enabled") == ev.ShutdownAttempt(TS, 1419, 1589)
    assert c("Cmd:get_device_pinned_mem_limit 713 0") == ev.Command(TS, 1419, "get_device_pinned_mem_limit", "713 0")
    assert c("Cmd:quit") == ev.Command(TS, 1419, "quit", "")
    assert c("Exit with status 0") == ev.DaemonExited(TS, 1419, 0)
    assert c("CUDA MPS Control binary version: 13000") == ev.DaemonVersion(TS, 1419, "13000")
    assert type(c("Starting control daemon using socket /tmp/mps/pipe/control")) is ev.DaemonStarted


@pytest.mark.parametrize("output", [
    "654", "713.1", "100.0", "25.0", "2G", "ACTIVE", "INITIALIZING", "FAULT", "Server 713 not found",
    "set_default_device_pinned_mem_limit 0 2G.", 'Unknown command "get_client_priority"',
    "No default pinned memory limit set for the device!", "[0] 00:00.0, NVIDIA H200",
    "PID       ID        SERVER         DEVICE                    NAMESPACE      COMMAND        ",
    "713       8         654            GPU-a20825ef-ef8f-4f37    4026531836     python3        ",
])
def test_command_output_is_never_an_event(output):
    # What nvidia-cuda-mps-control prints into control.log after `Cmd:` (all from the capture).
    assert type(c(output)) is ev.CommandOutput


def test_a_bare_number_in_server_log_is_a_report_item():
    # The fatal error report lists device ordinals and PIDs as bare lines.
    assert s("2755") == ev.ReportItem(parse_line(S + "0", "server", UTC).ts, 2736, 2755)
    assert type(s("The following devices will be reset:")) is ev.ReportHeading
    assert s("Client {PID: 2755, Context: 1} encountered a fatal GPU error.").client_pid == 2755
    assert s("Server is handling a fatal GPU error.").client_pid is None


def test_server_events_of_13x():
    assert s("Client {PID: 586, Context ID: 1} connected").client_pid == 586
    assert s("Client process 586 disconnected").client_pid == 586
    assert s("Active Threads Percentage set to 25.0").percentage == 25.0
    assert s("Device pinned memory limit for device 0 set to 0x80000000 bytes").limit_bytes == 2 * 1024 ** 3
    assert type(s("Exiting")) is ev.ServerExiting
    # Noise: understood, carries nothing (and is not a connection).
    for msg in ("Received new client request for {PID: -1333654781, Context ID: 0}",
                "Server failed to recevie command with status 806, assuming client {PID: 586, Context ID: 1} exit",
                "Client {PID: 2777, Context ID: 1} exiting. Worker is in reset. Number of active client contexts is 0.",
                "Device NVIDIA H200 (uuid GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70) is associated"):
        assert type(s(msg)) is ev.Noise, msg


def test_formats_of_11x_and_12x():
    # Role `Other`, `Volta MPS` prefixes, no client PIDs.
    other = "[2021-06-27 07:30:26.852 Other    17] "
    assert type(parse_line(other + "Volta MPS: Device Tesla T4 (uuid 0xafc3ccca-0x1) is associated", "server")) \
        is ev.ClientProcessConnected
    assert parse_line(other + "Volta MPS: Client process disconnected", "server").client_pid is None
    assert parse_line(other + "activeThreadsPercentage set to 33.000000", "server").percentage == 33.0
    assert type(parse_line(other + "Volta MPS: Client disconnected. Number of active client contexts is 2", "server")) \
        is ev.Noise
    assert type(parse_line("[2021-06-27 07:30:24.637 Control     6] Start", "control")) is ev.DaemonStarted


def test_pre_volta_and_legacy_formats():
    assert parse_line("[2013-08-05 13:00:09.269 Server 13929] New client 14781 connected", "server") \
        .client_pid == 14781
    assert parse_line("[2013-08-05 13:00:09.270 Server 13929] Client 14777 disconnected", "server").client_pid == 14777
    assert type(parse_line("[2013-08-06 10:51:31.706 Server 29489] MPS server failed to start", "server")) \
        is ev.ServerStartFailed
    legacy = parse_line("[2024-04-29 11:22:10.440 Legacy Server    95] Failed to start : invalid argument", "server")
    assert type(legacy) is ev.ServerStartFailed and legacy.pid == 95


@pytest.mark.parametrize("directory, expect", [
    # cuda11: 2 pushes of PID 0 (containers) -> admitted first-in first-out by the next two
    # `Server already exists` of PID 0: 26.838-26.216 + 26.852-26.300 = 1.174 s; 3 processes
    # (3x `Volta MPS: Device ... is associated`), 3x `Client process disconnected`; the
    # server logs activeThreadsPercentage 33.
    ("cuda11", dict(starts=1, exits={}, failures=0, connections=3, disconnections=3, waits=(2, 1.174),
                    queued=0, atp={17: 33.0})),
    # prevolta: 2 `New client N connected`, 1 `Client N disconnected`; 29489 exits with
    # status 1 without ever being ready: a start failure.
    ("prevolta", dict(starts=1, exits={"0": 1, "1": 1}, failures=1, connections=2, disconnections=1,
                      waits=(0, 0.0), queued=0, atp={})),
    # legacy: servers 95 and 98 fail to start (status 1); the client pushed at 11:22:10.421
    # is still waiting.
    ("legacy", dict(starts=0, exits={"1": 2}, failures=2, connections=0, disconnections=0, waits=(0, 0.0),
                    queued=1, atp={})),
])
def test_old_format_directories_replay(directory, expect):
    snap = LogPipeline("default", str(FIXTURES / directory), timezone="UTC").read_once()
    assert snap.unrecognized == {"control": 0, "server": 0}
    assert snap.count("mps_server_starts_total") == expect["starts"]
    assert snap.server_exits == expect["exits"]
    assert snap.count("mps_server_start_failures_total") == expect["failures"]
    assert snap.count("mps_client_connections_total") == expect["connections"]
    assert snap.count("mps_client_disconnections_total") == expect["disconnections"]
    hist = snap.queue_wait["server_starting"]
    assert (hist.count, round(hist.total, 3)) == expect["waits"]
    assert snap.queued["server_starting"] == expect["queued"]
    assert {pid: srv.active_thread_percentage for pid, srv in snap.servers.items()} == expect["atp"]


def test_timestamps_carry_no_zone():
    line = "[2026-11-21 04:22:16.630 Control  1419] NEW UI"
    assert parse_line(line, "control", UTC).ts == TS
    tokyo = parse_line(line, "control", resolve_timezone("Asia/Tokyo")).ts
    assert TS - tokyo == 9 * 3600  # 04:22 in Tokyo happened 9 h before 04:22 UTC
    local = parse_line(line, "control").ts  # default: the machine's local time
    assert local == datetime(2026, 11, 21, 4, 22, 16, 630000).timestamp()
    assert resolve_timezone("local") is None and resolve_timezone("UTC") is timezone.utc
    with pytest.raises(ValueError, match="unknown time zone"):
        resolve_timezone("Mars/Olympus_Mons")


@pytest.mark.parametrize("line", [
    "", "[", "no header at all", "[2026-11-21 04:22:16.630 Control  1419", "[2026-11-21 04:22:16.630 Control  x] NEW UI",
    "[0000-00-00 00:00:00.000 Control 1] NEW UI", "[2026-13-45 99:99:99.999 Control 1] NEW UI",
    "[2026-11-21 04:22:16.630   1419] NEW UI", "[2026-11-21 04:22:16.6x0 Control 1] NEW UI",
    "[2026-11-21 04:22:16.630 Control  1419] something MPS never wrote",
    "[2026-11-21 04:22:16.630 Control  1419] NEW CLIENT 1 from user 2: a new outcome",
])
def test_garbage_is_unrecognized(line):
    for file in ("control", "server"):
        assert type(parse_line(line, file)) is ev.Unrecognized


HUGE = "9" * 5000  # past int()'s 4300-digit limit


@pytest.mark.parametrize("file,message", [
    ("control", f"Server 1 exited with status {HUGE}"),
    ("control", f"Server {HUGE} exited with status 0"),
    ("control", f"NEW CLIENT {HUGE} from user 1000: Server already exists"),
    ("control", f"Starting new server 5 for user {HUGE}"),
    ("control", f"Exit with status -{HUGE}"),
    ("control", f"Try shutting down server {HUGE}, backoff is enabled"),
    ("server", HUGE),
    ("server", f"Client process {HUGE} disconnected"),
    ("server", f"Client {{PID: {HUGE}, Context ID: 1}} connected"),
    ("server", f"Device pinned memory limit for device 0 set to {HUGE} bytes"),
    ("server", f"Device pinned memory limit for device {HUGE} set to 0x10 bytes"),
    ("server", f"Active Threads Percentage set to {HUGE}.5"),
])
def test_a_number_past_the_digit_limit_is_one_unrecognized_line(file, message):
    result = parse_line(f"[2026-11-21 04:22:16.630 Control  1419] {message}", file, UTC)
    assert type(result) is ev.Unrecognized and result.reason != PARSER_ERROR
    assert type(parse_line(f"[2026-11-21 04:22:16.630 Control  {HUGE}] NEW UI", file, UTC)) is ev.Unrecognized


def test_the_issues_repro_loses_no_line(tmp_path):
    # 5,000 lines, one exit status of 5,000 nines, 5,000 more: every line counted, one unrecognized.
    ok = "[2026-11-21 04:22:16.630 Control  1419] Accepting connection..."
    bad = f"[2026-11-21 04:22:16.631 Control  1419] Server 1 exited with status {HUGE}"
    (tmp_path / "control.log").write_text("\n".join([ok] * 5000 + [bad] + [ok] * 5000) + "\n")
    snap = LogPipeline("default", str(tmp_path), timezone="UTC").read_once()
    assert snap.lines["control"] == 10_001 and snap.unrecognized["control"] == 1


def _known_lines():
    """Every line the parser is known to meet: the capture and the fixtures of older MPS."""
    for path in [CAPTURE / "control.log", CAPTURE / "server.log"] + sorted(FIXTURES.rglob("*.log")):
        file = "control" if path.name.startswith("control") else "server"
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            yield file, line


def test_every_number_of_every_known_line_made_huge_is_never_a_parser_error():
    # A rule that converts an unbounded digit run (int() refuses over 4300 digits) fails
    # here for any shape the capture or a fixture holds, whoever adds the rule.
    checked = 0
    for file, line in _known_lines():
        close = line.find("]")
        for m in re.finditer(r"\d+", line[close + 1:]):
            start, end = close + 1 + m.start(), close + 1 + m.end()
            result = parse_line(line[:start] + HUGE + line[end:], file, UTC)
            assert not (type(result) is ev.Unrecognized and result.reason == PARSER_ERROR), line
            checked += 1
    assert checked > 1000


def test_priority_and_terminate_client_lines():
    # Verbatim from MPS 13000 on an H100 (issue 24) and the capture (`Server Priority set to 0`).
    assert s("Server Priority set to 1") == ev.ServerPriority(s("Exiting").ts, 2736, 1)
    assert s("MPS server requesting client {PID: 675, Context ID: 1} to exit") == \
        ev.ClientTerminated(s("Exiting").ts, 2736, 675)
    assert s("Client termination succeeded.") == ev.Noise(s("Exiting").ts, 2736, "client_terminated")


def test_fatal_error_report_of_11x_and_12x():
    # The 13.x report's lines behind `Volta MPS: `, role `Other`.
    other = "[2022-03-14 09:13:41.503 Other    17] Volta MPS: "
    assert parse_line(other + "Server is handling a fatal GPU error.", "server").client_pid is None
    assert parse_line(other + "The following devices will be reset:", "server").topic == "reset_devices"
    assert parse_line(other + "The following client process have a sticky error set:", "server").topic == \
        "sticky_clients"
    assert parse_line(other + "4121", "server").value == 4121
    assert parse_line(other + "Client {PID: 4121, Context: 1} encountered a fatal GPU error.", "server").client_pid \
        == 4121
    assert type(parse_line(other + "Something new", "server")) is ev.Unrecognized


@pytest.mark.parametrize("zone", ["UTC", "local", "local:America/New_York", "America/New_York", "Australia/Lord_Howe",
                                  "Asia/Kolkata"])
def test_each_second_reads_as_datetime_does_across_zone_changes(zone, monkeypatch):
    """The seconds of a minute share its conversion: every second around the changes of a zone
    with DST (repeated and skipped hours, Lord Howe's half hour), read in order and out of it,
    gives datetime's own value; a 60th second is no time even in a minute already read."""
    if zone.startswith("local:"):  # the machine's zone, set to one with DST
        monkeypatch.setenv("TZ", zone[len("local:"):])
        time.tzset()
        zone = "local"
    try:
        _read_each_second(resolve_timezone(zone))
    finally:
        monkeypatch.undo()
        time.tzset()


def _read_each_second(tz) -> None:
    seconds = []
    for day, hour in ((8, 1), (8, 2), (1, 0), (1, 1), (5, 1), (5, 2), (4, 1), (4, 2)):
        for minute in (28, 29, 30, 31, 58, 59):
            for month in (3, 11, 4, 10):
                seconds += [(2026, month, day, hour, minute, s) for s in range(0, 60, 7)]
    for order in (seconds, sorted(seconds, key=lambda t: (t[5], t))):
        for y, mo, d, h, mi, s in order:
            line = f"[{y:04d}-{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d}.250 Server 7] Startup"
            want = datetime(y, mo, d, h, mi, s, 250000, tzinfo=tz).timestamp()
            utc = datetime(y, mo, d, h, mi, s, 250000, tzinfo=timezone.utc).timestamp()
            assert parse_line(line, "server", timezone.utc).ts == utc, line  # the same minute in UTC first
            assert parse_line(line, "server", tz).ts == want, line
    for s in ("59", "60", "99", "59"):
        ts = parse_line(f"[2026-11-01 01:30:{s}.000 Server 7] Startup", "server", tz).ts
        assert (ts is None) == (s != "59")


@pytest.mark.parametrize("file, message", [
    ("server", "Client {PID: 586, Context ID: 0} connected"), ("server", "Received new client request for x"),
    ("server", "Server Priority set to 3"), ("control", "NEW CLIENT 586 from user 0: Server already exists"),
    ("control", "Cmd:get_server_list"), ("control", "713       8         654      GPU-0"), ("control", "NEW UI"),
])
def test_a_header_in_other_digits_reads_as_in_ascii(file, message):
    """The line regexes try the header in ASCII digits first; one dated in Arabic-Indic digits
    (as `\\d` and int() read them) gives the same event."""
    arabic = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
    head = "[2026-11-21 04:19:42.120 Control   546] "
    ascii_event = parse_line(head + message, file, UTC)
    assert type(ascii_event) is not ev.Unrecognized
    assert parse_line(head.translate(arabic) + message, file, UTC) == ascii_event
