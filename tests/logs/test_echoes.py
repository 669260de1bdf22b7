"""control.log's command echoes are counted without the parser (exporter/logs/echoes.py):
the pipeline must end in the same state as parsing and applying every line."""

from __future__ import annotations

import sys
from datetime import timezone
from pathlib import Path
from typing import List

import pytest

from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.parser import parse_line
from mps_exporter.logs.state import LogState
from tests.support.data import CAPTURE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from steady_log import write_steady_logs  # noqa: E402

CAPTURES = CAPTURE.parent
H = "[2026-11-21 04:19:42.120 Control   546] "


def parsed_line_by_line(directory: Path):
    state = LogState()
    for f in ("control", "server"):
        path = directory / f"{f}.log"
        if path.exists():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                state.apply(parse_line(line, f, timezone.utc), f)
    state.settle()
    return state.snapshot()


def applied_in_runs(lines: List[str]):
    """The lines through echoes.apply_control on a fresh state: the lines it parsed, and the state."""
    from mps_exporter.logs.echoes import apply_control

    parsed: List[str] = []

    def parse(line: str):
        parsed.append(line)
        return parse_line(line, "control", timezone.utc)

    state = LogState()
    apply_control(state, lines, parse, lambda line: None)
    return parsed, state


def through_the_pipeline(directory: Path):
    snap = LogPipeline("default", str(directory), timezone="UTC").read_once()
    snap.read_errors, snap.caught_up, snap.backlog_bytes = {}, True, 0
    return snap


@pytest.mark.parametrize("capture", ["h200-driver580-a", "h100-edges", "h100-queuedeath"])
def test_recorded_logs_end_in_the_same_state(capture):
    directory = CAPTURES / capture
    assert (directory / "control.log").is_file(), f"recorded log {directory} is missing"
    assert through_the_pipeline(directory) == parsed_line_by_line(directory)


def test_a_steady_state_log_ends_in_the_same_state(tmp_path):
    write_steady_logs(tmp_path, 60_000, gpus=2, clients_per_gpu=10, churn_every=3)
    snap = through_the_pipeline(tmp_path)
    assert snap == parsed_line_by_line(tmp_path)
    assert snap.commands["ps"] > 1000 and snap.count("mps_client_connections_total") > 100 and sum(snap.unrecognized.values()) == 0


def test_events_and_odd_lines_among_echoes_are_still_parsed(tmp_path):
    rows: List[str] = [
        "Accepting connection...", "NEW UI", "Cmd:ps", "PID       ID        SERVER         DEVICE", "713       8         654",
        # an event in the middle of a command's answer, and lines that look almost like echoes
        "NEW CLIENT 900 from user 0: Server already exists", "714       7         654",
        "UI closed   ", " UI closed", "Accepting connection...", "123 outside a command", "ACTIVE",
        "NEW UI", "Cmd:get_server_status 654", "ACTIVE", "UI closed", "Accepting connection...",
        "NEW CLIENT 901 from user 0: Server is not ready, push client to pending list", "Starting new server 655 for user 0",
        "NEW SERVER 655: Ready", "NEW UI", "Cmd:get_server_list", "654", "655", "Server 654 exited with status 0",
        "Server 999 not found", "garbage inside a command", "UI closed", "Cmd:set_default_active_thread_percentage 50",
        "set_default_active_thread_percentage 50.", "UI closed",
    ]
    lines = [H + r for r in rows]
    lines[6] = lines[6].replace("Control   546", "Control  1419")  # another PID's answer line
    lines += ["[2026-11-21 04:19:42.121 Control   546]123 no space", "not a log line at all", "",
              "[2026-11-21 04:19:43.000 Other   546] 42"]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    snap = through_the_pipeline(tmp_path)
    reference = parsed_line_by_line(tmp_path)
    assert snap == reference
    assert snap.pushes["server_starting"] == 1 and snap.count("mps_server_starts_total") == 1 and snap.unrecognized["control"] >= 2
    assert snap.commands == {"ps": 1, "get_server_status": 1, "get_server_list": 1,
                             "set_default_active_thread_percentage": 1}


def test_batches_cut_anywhere_end_in_the_same_state(tmp_path, monkeypatch):
    from mps_exporter.logs import follower

    write_steady_logs(tmp_path, 5_000, gpus=1, clients_per_gpu=5, churn_every=2)
    reference = parsed_line_by_line(tmp_path)
    monkeypatch.setattr(follower, "READ_SIZE", 997)  # batches end inside commands and inside lines
    assert through_the_pipeline(tmp_path) == reference


def test_refused_connections_not_found_and_unknown_commands_are_echoes(tmp_path):

    rows = [
        "Accepting connection...", "User did not send valid credentials", "Accepting connection...",
        "User did not send valid credentials", "Accepting connection...", "NEW UI", "Cmd:get_active_thread_percentage 713",
        "Server 713 not found", "UI closed", "Accepting connection...", "NEW UI", "Cmd:get_client_priority 713",
        'Unknown command "get_client_priority"', "UI closed",
        # A refused connection inside a command, after no framing line: parsed (it ends no command).
        "Accepting connection...", "NEW UI", "Cmd:get_server_list", "User did not send valid credentials", "654",
        "Server -1 not found   ", "UI closed",
    ]
    lines = [H + r for r in rows]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    assert through_the_pipeline(tmp_path) == parsed_line_by_line(tmp_path)
    parsed, state = applied_in_runs(lines)
    # the one refused connection after no framing line, then the echoes' newest time
    assert parsed == [lines[17], lines[-1]]
    assert state.snapshot().lines["control"] == len(lines) and not state.in_command


def test_answers_holding_what_a_header_ends_with_are_not_counted(tmp_path):
    """Runs count commands, admitted contexts and deferred shutdowns by `] Cmd:`, `] NEW CLIENT `
    and `] Server S has ` in their text: an answer line holding one (a `]` in a `ps` row, an
    unknown command, an admitted context's tail) is an echo, never counted as one."""

    rows = [
        "Accepting connection...", "NEW UI", "Cmd:ps", "PID       ID        SERVER         DEVICE",
        "713       8         654      GPU-0   python x] Cmd:ps", "714       8         654      GPU-0   y] NEW CLIENT 5 ",
        "715       8         654      GPU-0   z] Server 654 has 2 active worker threads. Server will not shutdown.",
        "NEW CLIENT 900 from user 0: Server already exists", "UI closed", "Accepting connection...", "NEW UI",
        'Cmd:get_server_status 654', 'Unknown command "] Cmd:get_server_list"', "UI closed",
        "NEW CLIENT 901 from user 0: Server already exists ] Cmd:ps", "Accepting connection...", "NEW UI",
        "Cmd:get_server_list", "654", "UI closed",
    ]
    lines = [H + r for r in rows]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    snap = through_the_pipeline(tmp_path)
    assert snap == parsed_line_by_line(tmp_path)
    assert snap.commands == {"ps": 1, "get_server_status": 1, "get_server_list": 1}
    assert snap.count("mps_server_shutdown_deferrals_total") == 0
    parsed, state = applied_in_runs(lines)
    assert parsed == [lines[-1]]  # all echoes: only the newest one's time
    assert state.s.control_changes == 2 and state.snapshot() == parsed_line_by_line(tmp_path)


def test_commands_back_to_back_in_one_run_end_where_line_by_line_does(tmp_path):
    """Several commands in one run, the batch ending inside the last one's answer, outside
    it, and on a framing line: the verbs counted in order and whether a command is open."""
    from mps_exporter.logs.echoes import apply_control

    block = ["Accepting connection...", "NEW UI", "Cmd:get_server_list", "654", "655", "UI closed",
             "Accepting connection...", "User did not send valid credentials",
             "Accepting connection...", "NEW UI", "Cmd:ps", "PID       ID        SERVER", "713       8         654"]
    lines = [H + r for r in block * 3 + ["Server 654 exited with status 0", "UI closed"]]

    def parse(line: str):
        return parse_line(line, "control", timezone.utc)

    for first in range(1, len(lines)):
        for second in range(first, len(lines) + 1):  # three batches: the second starts anywhere
            reference, state = LogState(), LogState()
            for start, stop in ((0, first), (first, second), (second, len(lines))):
                apply_control(state, lines[start:stop], parse, lambda line: None)
                for line in lines[start:stop]:
                    reference.apply(parse(line), "control")
                assert state.in_command == reference.in_command, (first, second, stop)
                assert state.s.commands == reference.s.commands, (first, second, stop)
            assert state.snapshot() == reference.snapshot(), (first, second)


def test_shutdowns_deferred_and_retried_among_echoes_are_counted(tmp_path):
    """`Server S has N active worker threads. Server will not shutdown.` (counted) and `Control
    will try shutting down server S again ...` (Noise) are taken in runs outside commands,
    parsed inside one; near misses are parsed."""

    rows = [
        "Starting new server 654 for user 0", "NEW SERVER 654: Ready",
        "Try shutting down server 654, backoff is disabled",
        "Server 654 has 2 active worker threads. Server will not shutdown.",
        "Control will try shutting down server 654 again in at most 200ms",
        "Accepting connection...", "NEW UI", "Cmd:get_server_list", "654",
        "Server 654 has 1 active worker thread. Server will not shutdown   ",  # in a command: parsed
        "UI closed", "Server 654 has 1 active worker thread. Server will not shutdown",
        "Server 654 has 2 active worker threads. Server will shutdown.",  # no deferral: parsed
        "Control will try shutting down server 654 again in at most 400ms",
        "Server 654 has 3 active worker threads. Server will not shutdown. and more",  # parsed
        "Server 654 exited with status 0",
    ]
    lines = [H + r for r in rows]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    snap = through_the_pipeline(tmp_path)
    assert snap == parsed_line_by_line(tmp_path)
    assert snap.count("mps_server_shutdown_deferrals_total") == 3
    parsed, state = applied_in_runs(lines)
    assert parsed == [lines[k] for k in (0, 1, 2, 9, 12, 14, 15, 13)]  # then the newest echo's time


def test_echoes_dated_in_other_digits_are_parsed(tmp_path):
    """The runs' header takes ASCII digits only: an echo dated in Arabic-Indic digits (the
    parser reads them) is parsed, to the same state."""

    arabic = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
    rows = ["Accepting connection...", "NEW UI", "Cmd:get_server_list", "654", "UI closed"]
    lines = [H + r for r in rows] + [H.translate(arabic) + r for r in rows] + [H + rows[0]]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    assert through_the_pipeline(tmp_path) == parsed_line_by_line(tmp_path)
    parsed, state = applied_in_runs(lines)
    assert parsed == lines[5:10] + [lines[-1]] and state.snapshot().commands == {"get_server_list": 2}


def test_commands_that_change_nothing_but_counts_are_echoes(tmp_path):
    """Every command but the two that set a running server's limit is counted in runs, with
    its answer (a set_* command's echo, get_device_client_list's heading): the same counts,
    limit commands and in_command as parsing; the two, odd verbs and near misses are parsed."""
    from mps_exporter.contract import MAX_COMMAND_VERBS

    rows = ["Starting new server 654 for user 0", "NEW SERVER 654: Ready"]
    for cmd, answer in (("Cmd:set_default_device_pinned_mem_limit 0 2G", ["set_default_device_pinned_mem_limit 0 2G."]),
                        ("Cmd:set_default_active_thread_percentage 25", ["25.0"]),
                        ("Cmd:help", ['Unknown command "help"']),
                        ("Cmd:get_device_client_list 0", ["[0] 00:00.0, NVIDIA H200", "713"]),
                        ("Cmd:set_device_pinned_mem_limit 654 0 3G", []),  # parsed: the server's limit
                        ("Cmd:set_active_thread_percentage 654 30", ["30.0"]),
                        ("Cmd:set_active_thread_percentage2 654 30", []),
                        ("Cmd:shutdown_server 999", ["Server 999 not found"]),
                        ("Cmd: set_default_active_thread_percentage 50", ["50.0"]),  # a space: parsed
                        ("Cmd:set_default_active_thread_percentage\t50", ["50.0"]),
                        ("Cmd:" + "x" * 41, []),
                        ("Cmd:Get_server_list", []),
                        ("Cmd:set_default_x 1 2 3 4 5 six", ["set_x 1 ."]),
                        ("Cmd:quit", ["Try shutting down server 654, backoff is disabled", "Server 654 exited with status 0",
                                      "Exit with status 0"])):
        rows += ["Accepting connection...", "NEW UI", cmd, *answer, "UI closed   "]
    rows += ["Accepting connection...", "NEW UI", "Cmd:set_default_active_thread_percentage 10"]  # no framing after it
    lines = [H + r for r in rows]
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    snap = through_the_pipeline(tmp_path)
    assert snap == parsed_line_by_line(tmp_path)
    assert snap.limit_commands == 9 and snap.commands["help"] == 1 and snap.commands["quit"] == 1
    parsed, state = applied_in_runs(lines)
    assert state.in_command and state.snapshot() == _applied_line_by_line(lines).snapshot()
    parsed = parsed[:-1]  # the last: the echoes' newest time
    assert not [line for line in parsed if "Cmd:set_default_" in line and "Cmd:set_default_active_thread_percentage" + "\t" not in line]
    # the two (and one with a digit after), a space, a tab, 41 letters, a capital
    assert len([line for line in parsed if "] Cmd:" in line]) == 7
    # With the verbs' labels full, a new verb is `other` either way.
    filler = [H + f"Cmd:get_v{k}" for k in range(MAX_COMMAND_VERBS + 2)]
    many = filler + lines
    parsed, state = applied_in_runs(many)
    assert state.snapshot() == _applied_line_by_line(many).snapshot()


def _applied_line_by_line(lines: List[str]) -> LogState:
    state = LogState()
    for line in lines:
        state.apply(parse_line(line, "control", timezone.utc), "control")
    return state


def test_a_shutdown_attempt_repeated_is_an_echo(tmp_path):
    """After a server's shutdown attempt outside commands, the daemon's next attempts on the
    same server (among deferrals, retries, framing and refused connections) change nothing and
    are counted in a run; an attempt on another server, one inside a command, one after a
    parsed line (a push: the waiting client's reason may switch again) and near misses are
    parsed: the same state as line by line, queued or not."""
    rows = [
        "Starting new server 654 for user 0", "NEW SERVER 654: Ready",
        "NEW CLIENT 900 from user 1500: Server is not ready, push client to pending list",
        "Try shutting down server 654, backoff is disabled",
        "Server 654 has 2 active worker threads. Server will not shutdown.",
        "Control will try shutting down server 654 again in at most 200ms",
        "Try shutting down server 654, backoff is enabled",  # again: an echo
        "Accepting connection...", "User did not send valid credentials",
        "Try shutting down server 654, backoff is enabled",  # again: an echo
        "Try shutting down server 6541, backoff is enabled",  # another server: parsed
        "Try shutting down server 654, backoff is enabled",  # parsed (after another one)
        "NEW CLIENT 901 from user 1600: Server is not ready, push client to pending list",
        "Try shutting down server 654, backoff is enabled",  # after a push: parsed, switches 901
        "Try shutting down server 654 ",
        "Try shutting down server 654",
        "Accepting connection...", "NEW UI", "Cmd:quit",
        "Try shutting down server 654, backoff is disabled",  # in a command: parsed
        "Try shutting down server 654, backoff is disabled",
        "Server 654 exited with status 0", "Exit with status 0",
        "Starting control daemon using socket /tmp/mps/pipe/control",
        "Starting new server 700 for user 0", "NEW SERVER 700: Ready",
        "Try shutting down server 700, backoff is disabled",  # nobody queued
        "NEW CLIENT 5 from user 0: Server already exists",
        "Try shutting down server 700, backoff is enabled",
        "Try shutting down server \u0667\u0660\u0660, backoff is enabled",  # other digits: parsed
        "Try shutting down server 700, backoff is enabled",
    ]
    lines = [H + r for r in rows]
    lines[9] = lines[9].replace("Control   546", "Other   546")  # not the daemon's header: parsed
    (tmp_path / "control.log").write_text("\n".join(lines) + "\n")
    snap = through_the_pipeline(tmp_path)
    assert snap == parsed_line_by_line(tmp_path)
    assert snap.pushes == {"server_starting": 0, "user_switch": 2}
    parsed, state = applied_in_runs(lines)
    assert state.snapshot() == _applied_line_by_line(lines).snapshot()
    tries = [line for line in parsed[:-1] if "Try shutting" in line]
    assert tries == [lines[k] for k in (3, 9, 10, 11, 13, 19, 20, 26, 29, 30)]
