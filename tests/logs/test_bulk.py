"""server.log's backlog applied in bulk (exporter/logs/bulk.py) must end in the same state
as parse_line + LogState.apply line by line: on every recorded server.log under tests/, on
generated logs full of the lines it takes a short cut for and of those it must not, split
into batches anywhere, and through the pipeline with reads cut at any byte."""

from __future__ import annotations

import functools
from datetime import datetime
import random
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import pytest

from mps_exporter.logs import parser
from mps_exporter.logs.bulk import apply_server
from mps_exporter.logs.parser import parse_line, scan_server
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.state import MAX_CLOCK_AHEAD, LogState

from .helpers import UTC

TESTS = Path(__file__).resolve().parents[1]
RECORDED = sorted(TESTS.glob("**/server.log"))
NOW = 1_800_000_000.0  # the clock of every state here: 2027-01-15


def _clock() -> float:
    return NOW


def _control(directory: Path) -> List[str]:
    path = directory / "control.log"
    return path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []


def line_by_line(control: Sequence[str], server: Sequence[str]) -> LogState:
    state = LogState(_clock)
    for line in control:  # control.log first, as the reader does: its exits wait on server.log
        state.apply(parse_line(line, "control", UTC), "control")
    for line in server:
        state.apply(parse_line(line, "server", UTC), "server")
    state.settle()
    return state


def in_bulk(control: Sequence[str], server: Sequence[str], cut: Callable[[int], int]) -> LogState:
    """server.log in batches: `cut(i)` is the length of the batch starting at line i."""
    state = LogState(_clock)
    for line in control:
        state.apply(parse_line(line, "control", UTC), "control")
    i = 0
    while i < len(server):
        n = max(1, cut(i))
        apply_server(state, server[i:i + n], UTC, _raise)
        i += n
    state.settle()
    return state


def _raise(line: str) -> None:
    raise AssertionError(f"applying {line!r} raised")


def assert_same(a: LogState, b: LogState) -> None:
    assert b.to_dict() == a.to_dict()
    assert b.snapshot() == a.snapshot()
    assert b.implausible_times == a.implausible_times


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    """Each test starts with the parser's and the bulk path's message caches empty."""
    monkeypatch.setattr(parser, "_MESSAGES", {"control": {}, "server": {}})
    monkeypatch.setattr(parser, "_QUIET", {})


def test_there_are_recorded_server_logs():
    assert len(RECORDED) >= 15, RECORDED  # fixtures and captures: recorded fixtures never skip


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: str(p.relative_to(TESTS).parent))
def test_recorded_server_logs_end_in_the_same_state(path):
    control = _control(path.parent)
    server = path.read_text(encoding="utf-8", errors="replace").splitlines()
    expected = line_by_line(control, server)
    for cut in (lambda i: len(server), lambda i: 1, lambda i: 7, lambda i: 1 + i % 13):
        assert_same(expected, in_bulk(control, server, cut))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: str(p.relative_to(TESTS).parent))
def test_the_scan_takes_every_line_apart_as_parse_line(path):
    """One row per line, and where the row has a verb, parse_line found the same one."""
    server = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = scan_server(server)
    assert rows is not None and len(rows) == len(server)
    for line, row in zip(server, rows):
        event = parse_line(line, "server", UTC)
        connected, active, disconnected, request, context_exit = row[3:8]
        if request or context_exit:
            assert event[2] == ("client_request" if request else "client_context_exit")
        for number in (connected, active, disconnected):
            if number:
                assert event[2] == int(number)


# ------------------------------------------------------------------ generated
def _stamp(t: float) -> str:
    whole = int(t)
    return datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%d %H:%M:%S") + f".{int((t - whole) * 1000):03d}"


_ARABIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")


def generated(seed: int, n: int) -> List[str]:
    """server.log lines: servers whose clients connect (several contexts), turn ACTIVE and
    leave, between Noise of every kind, and the odd lines the short cut must leave to apply:
    trailing blanks, text after a verb, no header, a date that does not exist, a time past
    the clock, a fatal error report, a limit, a refusal, time stepping back."""
    rng = random.Random(seed)
    t = NOW - 3600.0
    out: List[str] = []
    servers = [1000 + k for k in range(3)]
    connected: dict = {s: [] for s in servers}
    next_client = 5000

    def line(server: int, msg: str, role: str = "Server") -> None:
        out.append(f"[{_stamp(t)} {role}   {server}] {msg}")

    while len(out) < n:
        t += rng.choice((0.0, 0.001, 0.004, 0.2, 1.3))
        s = rng.choice(servers)
        r = rng.random()
        if r < 0.18:
            next_client += 1
            connected[s].append(next_client)
            for ctx in range(rng.randint(1, 3)):
                line(s, f"Received new client request for {{PID: {next_client}, Context ID: {ctx}}}")
                line(s, f"Client {{PID: {next_client}, Context ID: {ctx}}} connected")
                line(s, f"Creating worker thread for client {{PID: {next_client}, Context ID: {ctx}}}")
        elif r < 0.3 and connected[s]:
            line(s, f"Status of client {{PID: {rng.choice(connected[s])}, Context ID: 0}} is ACTIVE")
        elif r < 0.42 and connected[s]:
            c = connected[s].pop(rng.randrange(len(connected[s])))
            line(s, f"Server failed to recevie command with status 0, assuming client {{PID: {c}, Context ID: 0}} exit")
            line(s, f"Client {{PID: {c}, Context ID: 0}} exiting. Number of active client contexts is 0.")
            line(s, f"Client process {c} disconnected")
            if rng.random() < 0.2:
                line(s, f"Client process {c} disconnected")  # a refused client says it twice
        elif r < 0.55:
            line(s, rng.choice(["Server has been notified to shutdown", "Waiting for current clients to finish",
                                "Device NVIDIA H200 (uuid GPU-a4ef) is associated", "Server has started",
                                "Creating server context on device 0 (NVIDIA H200)", "Startup",
                                "Volta MPS Server: Received new client request", "Volta MPS: Creating worker thread"]),
                 role=rng.choice(["Server", "Other"]))
        elif r < 0.6:
            line(s, "Active Threads Percentage set to 50.0")
            line(s, "Device pinned memory limit for device 0 set to 0x80000000 bytes")
            line(s, "Server Priority set to 1")
        elif r < 0.64:  # a fatal error report: its lines keep it open, any other closes it
            line(s, "Server is handling a fatal GPU error.")
            line(s, "The following devices will be reset:")
            line(s, "0")
            line(s, "The following client process have a sticky error set:")
            for c in connected[s][:2]:
                line(s, str(c))
            line(s, f"Client {{PID: {next_client}, Context ID: 0}} on device 0 to be torn down")
        elif r < 0.66:
            line(s, f"Client {{PID: {next_client}, Context ID: 1}} connected")
            line(s, "Failed to accept new client. Maximum number of clients (48) reached.")
        elif r < 0.7:
            line(s, rng.choice([
                f"Client {{PID: {next_client}, Context ID: 0}} connected   ",  # blanks: the verb still
                f"Client {{PID: {next_client}, Context ID: 0}} connected and more",  # not the verb
                f"Client process {next_client} disconnected\t",
                f"Status of client {{PID: {next_client}, Context: 0}} is ACTIVE",
                f"Status of client {{PID: {next_client}, Context ID: 0}} is INACTIVE",
                "Received new client request   ",
                "no rule knows this", "", "Exiting",
                "Client {PID: 99999999999, Context ID: 0} connected",  # 11 digits: no verb
            ]))
        elif r < 0.74:
            out.append(rng.choice([
                "", "   ", "garbage without a header", f"[{_stamp(t)} Server {s}]",
                f"[2026-13-01 00:00:00.000 Server   {s}] Client {{PID: 7, Context ID: 0}} connected",
                f"[2026-02-30 00:00:00.000 Server   {s}] Client process 7 disconnected",
                f"[0000-01-01 00:00:00.000 Server   {s}] Received new client request",
                f"[{_stamp(t)} Server   {s}] \u0661\u0662 Client process 5 disconnected",
                # the header in Arabic-Indic digits: parse_line reads it, the scan leaves it to it
                f"[{_stamp(t).translate(_ARABIC)} Server   {s}] Client {{PID: {next_client}, Context ID: 3}} connected",
                f"[{_stamp(t).translate(_ARABIC)} Server   {s}] Creating worker thread for client",
                # a verb numbered in those digits: taken apart by the rules, to the same event
                f"[{_stamp(t)} Server   {s}] Client {{PID: {str(next_client).translate(_ARABIC)}, Context ID: 1}} connected",
                f"[{_stamp(t)} Server   {s}] Client process {str(next_client).translate(_ARABIC)} disconnected",
                f"[{_stamp(t)} Server   {s}] Client {{PID: 5, Context ID: \u0661}} exiting. Number of active client contexts",
                f"[{_stamp(t)} Server   {s}]Client process {next_client} disconnected",  # no space
                f"[{_stamp(t)} Legacy Server   {s}] Client {{PID: {next_client}, Context ID: 2}} connected",
                f"[{_stamp(t)} Server   {s}] Client process {next_client} disconnected\r",
            ]))
        elif r < 0.77:  # ahead of the clock: not believed
            ahead = NOW + MAX_CLOCK_AHEAD + rng.choice((10.0, 1e6))
            out.append(f"[{_stamp(ahead)} Server   {s}] " + rng.choice([
                f"Client {{PID: {next_client}, Context ID: 0}} connected", "Server has started",
                f"Received new client request for {{PID: {next_client}, Context ID: 0}}"]))
        elif r < 0.79:
            t -= rng.choice((0.5, 2.0))  # the clock stepped back
            line(s, f"Received new client request for {{PID: {next_client}, Context ID: 0}}")
        else:
            line(s, f"Received new client request for {{PID: {next_client}, Context ID: 0}}")
    return out[:n]


def exits(server_lines: Sequence[str]) -> List[str]:
    """control.log announcing the servers and their exits at times among server.log's: the
    exits wait for server.log's lines past them (exits with clients)."""
    times = sorted(line[1:24] for line in server_lines if line.startswith("[20"))
    out = []
    for s in (1000, 1001, 1002):
        out.append(f"[{times[0]} Control   546] Starting new server {s} for user 0")
        out.append(f"[{times[0]} Control   546] NEW SERVER {s}: Ready")
    for k, s in enumerate((1000, 1001, 1002)):
        at = times[len(times) * (k + 1) // 4]
        out.append(f"[{at} Control   546] Server {s} exited with status 0")
    return out


@pytest.mark.parametrize("seed", range(12))
def test_generated_logs_end_in_the_same_state_cut_anywhere(seed):
    server = generated(seed, 1500)
    rng = random.Random(seed)
    for control in ([], exits(server)):
        expected = line_by_line(control, server)
        assert expected.s.lines["server"] == len(server)
        cuts = [rng.randint(1, 40) for _ in range(len(server))]
        for cut in (lambda i: len(server), cuts.__getitem__, lambda i: 1):
            assert_same(expected, in_bulk(control, server, cut))


def test_generated_logs_hold_what_the_short_cut_must_get_right():
    """The generator is worth its name: the cases above happen in it."""
    state = line_by_line(exits(generated(0, 1500)), generated(0, 1500))
    snap = state.snapshot()
    assert snap.count("mps_client_connections_total") > 50 and snap.count("mps_client_disconnections_total") > 20
    assert snap.count("mps_fatal_gpu_errors_total") > 0 and snap.count("mps_server_exits_with_clients_total") > 0
    assert state.implausible_times > 0 and snap.unrecognized["server"] > 0


def test_a_line_holding_a_newline_is_applied_line_by_line():
    lines = ["[2026-11-21 04:19:24.640 Server   654] Client {PID: 586, Context ID: 0} connected",
             "[2026-11-21 04:19:24.641 Server   654] Server has started\n[2026-11-21 04:19:24.641 Server   654] Exiting"]
    assert scan_server(lines) is None
    assert_same(line_by_line([], lines), in_bulk([], lines, lambda i: 2))


# ------------------------------------------------------------------ the pipeline
def _write(directory: Path, control: Sequence[str], server: Sequence[str], last_newline: bool = True) -> None:
    (directory / "control.log").write_text("".join(line + "\n" for line in control), encoding="utf-8")
    text = "\n".join(server) + ("\n" if last_newline and server else "")
    (directory / "server.log").write_text(text, encoding="utf-8")


def _pipeline(directory: Path, read_bytes: Optional[int]) -> LogPipeline:
    pipe = LogPipeline("default", str(directory), timezone="UTC", clock=_clock)
    if read_bytes is not None:  # every poll cut after a few bytes: lines split across reads
        for follower in pipe._followers.values():
            follower.poll = functools.partial(follower.poll, max_bytes=read_bytes)  # type: ignore[method-assign]
    return pipe


def _comparable(snap):
    snap.read_errors, snap.caught_up, snap.backlog_bytes = {}, True, 0
    return snap


@pytest.mark.parametrize("read_bytes", [None, 97, 1000, 4096])
def test_the_pipeline_reads_in_bulk_to_the_same_state(tmp_path, read_bytes):
    server = [line for line in generated(3, 3000) if "\r" not in line]  # a file splits there too
    control = exits(server)
    _write(tmp_path, control, server)
    expected = line_by_line(control, server)
    expected_snap = expected.snapshot()
    expected_snap.rotation_gaps, expected_snap.state_file_errors = {}, None
    snap = _comparable(_pipeline(tmp_path, read_bytes).read_once())
    snap.rotation_gaps = {}
    assert snap == _comparable(expected_snap)


def test_a_partial_last_line_waits_for_its_end(tmp_path):
    server = [line for line in generated(4, 800) if "\r" not in line]
    control = exits(server)
    head, last = server[-1][:20], server[-1][20:]
    _write(tmp_path, control, server[:-1] + [head], last_newline=False)
    pipe = _pipeline(tmp_path, 211)
    before = _comparable(pipe.read_once())
    want = line_by_line(control, server[:-1]).snapshot()
    assert before.lines == want.lines and before.counts == want.counts
    with open(tmp_path / "server.log", "a", encoding="utf-8") as f:
        f.write(last + "\n")
    after = _comparable(pipe.read_once())
    after.rotation_gaps = {}
    want = line_by_line(control, server).snapshot()
    assert after == _comparable(want)


# ------------------------------------------------------------------ control.log
def generated_control(seed: int, n: int) -> List[str]:
    """control.log of a monitored node whose clients come and go: command echoes, clients'
    contexts admitted (`Server already exists`) inside answers, between framing lines and
    before commands, while nobody is queued and while someone is (then each is parsed: it
    ends a wait), and lines that only look like them."""
    rng = random.Random(seed)
    t = NOW - 3600.0
    out: List[str] = []
    client = 7000

    def line(msg: str, pid: int = 546) -> None:
        out.append(f"[{_stamp(t)} Control   {pid}] {msg}")

    def accepted() -> None:
        line(rng.choice([f"NEW CLIENT {client} from user 0: Server already exists",
                         f"NEW CLIENT {client} from user 0: Server already exists   ",
                         f"NEW CLIENT {client} from user 1000: Server already exists, and more",
                         "NEW CLIENT -3 from user 0: Server already exists",
                         "NEW CLIENT 12345678901 from user 0: Server already exists",  # 11 digits: no client
                         f"NEW CLIENT {client} from user 0: Server already existed"]))

    server = 800
    while len(out) < n:
        t += rng.choice((0.0, 0.001, 0.01, 0.3))
        r = rng.random()
        if r < 0.45:  # a monitoring command, clients' contexts admitted anywhere in it
            line("Accepting connection...")
            if rng.random() < 0.2:
                accepted()
            line("NEW UI")
            if rng.random() < 0.2:
                line("User did not send valid credentials")
            line(rng.choice(["Cmd:get_server_list", "Cmd:ps", f"Cmd:get_server_status {server}"]))
            for _ in range(rng.randint(0, 3)):
                if rng.random() < 0.3:
                    accepted()
                line(rng.choice([str(server), "ACTIVE", f"{client}   1   {server}   0   python3",
                                 f"12 [{_stamp(t)} Control   546] NEW CLIENT {client} from user 0: Server already exists"]))
            if rng.random() < 0.2:
                accepted()
            line("UI closed")
            if rng.random() < 0.3:
                accepted()
                if rng.random() < 0.5:
                    line("User did not send valid credentials")
        elif r < 0.55:  # a client queued while its server starts, then admitted
            client += 1
            line(f"NEW CLIENT {client} from user 0: Server is not ready, push client to pending list")
            if rng.random() < 0.5:
                line("Accepting connection...")
                line("NEW UI")
                line("Cmd:get_server_list")
                line(str(server))
                accepted()
                line("UI closed")
            server += 1
            line(f"Starting new server {server} for user 0", pid=server)
            line(f"NEW SERVER {server}: Ready")
            t += 0.05
            line(f"NEW CLIENT {client} from user 0: Server already exists")
            accepted()
        elif r < 0.6:
            line(f"Server {server} exited with status 0")
        else:
            client += 1
            accepted()
    return out[:n]


@pytest.mark.parametrize("read_bytes", [None, 131, 2000])
@pytest.mark.parametrize("seed", range(4))
def test_clients_admitted_among_echoes_end_in_the_same_state(tmp_path, seed, read_bytes):
    control = generated_control(seed, 2500)
    _write(tmp_path, control, [])
    expected = line_by_line(control, [])
    assert expected.s.queue_wait["server_starting"].count > 10 and expected.s.control_changes > 500
    pipe = _pipeline(tmp_path, read_bytes)
    pipe.read_once()
    assert pipe.state_entry()["state"] == expected.to_dict()


def test_a_line_whose_handling_raises_is_named_and_counted():
    """From a batch's text no string is made per line: the line named to on_error is still the
    one that raised, and it still counts."""
    from mps_exporter.logs.bulk import apply_server_text

    server = generated(5, 400)
    bad = next(i for i, line in enumerate(server) if line.endswith("} connected") and i > 100)
    client = int(server[bad].split("PID: ")[1].split(",")[0])
    state = LogState(_clock)
    handler = state.context_connected

    def connected(ts: float, pid: int, client_pid: int) -> None:
        if client_pid == client:
            raise RuntimeError("a bug")
        handler(ts, pid, client_pid)

    state.context_connected = connected  # type: ignore[method-assign]
    named: List[str] = []
    apply_server_text(state, "".join(line + "\n" for line in server), UTC, named.append)
    assert named and set(named) == {line for line in server if line.endswith("} connected") and f"PID: {client}," in line}
    assert state.s.lines["server"] == line_by_line([], server).s.lines["server"]
