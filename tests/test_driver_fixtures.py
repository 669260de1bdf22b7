"""Recorded answers and logs per driver family (issue 41, done-when 3): tests/data/drivers/.

Each family's `answers.txt` ("> command" then its answer, as the capture transcripts) is
replayed behind the control reader: every command the exporter sends must be in it, the
daemon's servers and clients are served with the fields it could read, the control
collector stays up, and what the daemon did not know is counted per command. Each
family's logs (cut unchanged from the public threads its SOURCE names) go through the log
pipeline: every line is recognized or counted unrecognized, with the right counters.
"""

from __future__ import annotations

import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Sequence, Tuple

import pytest

from mps_exporter import cli
from mps_exporter.config import Config, DaemonConfig
from mps_exporter.logs import events as ev
from mps_exporter.logs.parser import parse_line
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.sources import control as mc
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import transcript_outputs
from tests.fakes.fake_procfs import write_proc
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.support.data import DATA
from tests.support.golden import exposition
from tests.support.lines import series, value

DRIVERS = DATA / "drivers"
SERVER_ANSWERS = DRIVERS / "server-answers.txt"  # written: one server, two clients, every verb
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
PINNED = frozenset({"get_device_pinned_mem_limit", "get_default_device_pinned_mem_limit"})
PRIORITY = frozenset({"get_default_client_priority"})
STATUS = frozenset({"get_server_status"})
PS = frozenset({"ps"})
# The families whose answers.txt record_packages.py recorded from NVIDIA's program of a
# Debian or Ubuntu package (580's daemon needs the driver to start: it is the H200 capture's).
RECORDED = ("470", "525", "535", "550", "555", "570")
MARKER = "## Recorded from the package (written by record_packages.py)"
# family -> the verbs its recorded daemon answered `Unknown command` (what the recordings
# showed, written here so that a re-recording that differs fails).
FAMILIES: Dict[str, FrozenSet[str]] = {
    "470": PS | STATUS | PINNED | PRIORITY,
    "525": STATUS | PRIORITY,
    "535": STATUS,
    "550": frozenset(),
    "555": frozenset(),
    "570": frozenset(),
    "580": frozenset(),
}
# What `-v` printed with the daemon up, where the family has no version.txt (580: the
# fake's answer in the capture's format, written).
VERSION_580 = "CUDA MPS Control for Linux/Unix/QNX. Binary version: 13000\n"


def version_output(family: str) -> str:
    path = DRIVERS / family / "version.txt"
    return path.read_text() if family in RECORDED else VERSION_580


@dataclass
class Recorded:
    """`ControlClient.runner` answering from an answers file ("> command", its answer,
    `rc=N`): a command line recorded there gets its recorded answer; a verb recorded
    answering `Unknown command` answers so whatever its arguments. Anything else is a miss
    (the test fails)."""

    path: Path
    version: str = VERSION_580
    answers: Dict[str, str] = field(default_factory=dict)
    misses: List[str] = field(default_factory=list)
    received: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.answers = dict(transcript_outputs(self.path))  # a missing file fails here: never skipped
        assert self.answers, f"{self.path}: no recorded answers"

    def __call__(self, argv: Sequence[str], stdin_text: str, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
        if list(argv[1:]) == ["-v"]:
            return 0, self.version
        line = stdin_text.strip()
        self.received.append(line)
        if line in self.answers:
            return 0, self.answers[line]
        verb = line.split()[0]
        unknown = self.unknown_answers()
        if verb in unknown:
            return 0, unknown[verb]
        self.misses.append(line)
        return 1, f"not recorded: {line}\n"

    def unknown_answers(self) -> Dict[str, str]:
        return {cmd.split()[0]: out for cmd, out in self.answers.items() if out.startswith(mc.UNKNOWN_COMMAND)}

    def unknown_verbs(self) -> FrozenSet[str]:
        """The exporter's verbs the daemon did not know (`help` is none of them)."""
        return frozenset(self.unknown_answers()) & frozenset(mc.READ_ONLY_COMMANDS)


def server_answers(family: str, into: Path) -> Path:
    """The written answers of a daemon with server 1589 and clients 2457, 2483, restricted
    to what `family` knows: each verb its recording answered `Unknown command` answers
    that recorded line instead."""
    unknown = Recorded(DRIVERS / family / "answers.txt").unknown_answers()
    lines = []
    for cmd, out in transcript_outputs(SERVER_ANSWERS):
        lines += [f"> {cmd}", *unknown.get(cmd.split()[0], out).splitlines()]
    into.write_text("\n".join(lines) + "\n")
    return into


def counted_unknown(text: str, daemon: str) -> Dict[str, float]:
    return {line.split('command="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in series(text, "mps_exporter_control_commands_unknown_total", daemon=daemon)}


def test_every_family_directory_names_its_source():
    dirs = sorted(p for p in DRIVERS.iterdir() if p.is_dir())
    assert {p.name for p in dirs} >= {*FAMILIES, "580-bottlerocket", "580-dra", "580-k8s-device-plugin"}
    for d in dirs:
        source = (d / "SOURCE").read_text()
        assert "https://" in source, d
        assert any((d / f).is_file() for f in ("answers.txt", "control.log", "server.log")), d
        assert (MARKER in source) == (d.name in RECORDED), d  # the recorder's section: recorded families only


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_recording_says_what_it_does_not_know(family):
    """The recorded answers.txt of each family: which of the exporter's verbs it answered
    `Unknown command`; from the packages every verb of the allowlist was asked (with the
    exporter's arguments), `help` too, and every server-less answer is one of the shapes
    the parsers take."""
    recorded = Recorded(DRIVERS / family / "answers.txt")
    assert recorded.unknown_verbs() == FAMILIES[family]
    assert recorded.answers["help"] == 'Unknown command "help"\n'  # no driver knows `help`
    if family not in RECORDED:
        return
    assert {cmd.split()[0] for cmd in recorded.answers} >= set(mc.READ_ONLY_COMMANDS)
    source = (DRIVERS / family / "SOURCE").read_text()
    assert "recorded from the real binary" in source.lower()
    for cmd, out in recorded.answers.items():
        verb, args = cmd.split()[0], cmd.split()[1:]
        if verb in FAMILIES[family] or verb == "help":
            assert out == f'Unknown command "{verb}"\n', cmd
        elif args and args[0] == "1" and verb != "get_default_device_pinned_mem_limit":
            assert out == "Server 1 not found\n", cmd  # no server runs without a GPU
        else:
            assert out in ("", "Server not found\n", "100.0\n", "0\n"), cmd


def read_with(tmp_path: Path, name: str, runner: Recorded, nvml: FakeNvml) -> str:
    """Two scrapes of the collector (control, NVML) with `runner` behind the control
    reader; the second's exposition."""
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    cfg = Config()
    cfg.daemons = [DaemonConfig(name, str(pipe), str(tmp_path / "log"))]
    cfg.procfs = str(write_proc(tmp_path / "proc", []))
    cfg.collectors.update(dcgm=False, logs=False, proc=False)
    cfg.runtime_roots = ()
    cfg.control_wait = 0.0  # each scrape waits for its own control read
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=runner, nvml_wait_for_every_answer=True))
    collector = build_collector(cfg, readers)
    try:
        exposition(collector)
        return exposition(collector)  # the second scrape: what was learned is not asked again
    finally:
        for r in readers.values():
            r.close()


# family -> the binary version its `-v` printed (literal; the others printed none)
BINARY_VERSIONS = {"570": "12080", "580": "13000"}


# family -> the verbs a daemon without servers is sent and does not know (literal)
SERVER_LESS_UNKNOWN: Dict[str, FrozenSet[str]] = {
    "470": PS | PRIORITY | {"get_default_device_pinned_mem_limit"},
    "525": PRIORITY,
    "535": frozenset(), "550": frozenset(), "555": frozenset(), "570": frozenset(), "580": frozenset(),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_server_less_daemon_of_each_family_keeps_the_collector_up(tmp_path, family):
    """Each family's recorded daemon as it answered (no server, one GPU on the node): the
    control collector up, the daemon up, its defaults served where it knows them, and the
    verbs it answered `Unknown command` counted per command, each sent once."""
    recorded = Recorded(DRIVERS / family / "answers.txt", version=version_output(family))
    text = read_with(tmp_path, family, recorded, FakeNvml([FakeGpu(uuid=UUID)]))
    d = {"daemon": family}
    assert recorded.misses == []  # every command sent has a recorded answer
    assert value(text, "mps_exporter_collector_success", collector="control") == 1
    assert value(text, "mps_control_daemon_up", **d) == 1
    assert series(text, "mps_server_info", **d) == []
    assert value(text, "mps_default_active_thread_ratio", **d) == 1.0
    # the binary version `-v` printed: R570 and R580 name it, the older programs print none
    assert len(series(text, "mps_control_daemon_info", **d, version=BINARY_VERSIONS.get(family, ""))) == 1
    assert bool(series(text, "mps_default_client_priority", **d)) == ("get_default_client_priority" not in FAMILIES[family])
    counted = counted_unknown(text, family)
    assert set(counted) == SERVER_LESS_UNKNOWN[family] == FAMILIES[family] & {line.split()[0] for line in recorded.received}
    for verb in counted:  # answered Unknown command once, never sent again
        assert sum(line.split()[0] == verb for line in recorded.received) == 1, verb


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_answers_serve_servers_and_clients(tmp_path, family):
    """A daemon with one server and two clients, answering in the capture's formats only
    what its family knows: the server and both clients served with the fields the family
    could read (R470: its clients from get_client_list and get_device_client_list, with
    no command nor PID namespace), the rest counted per command."""
    unknown = FAMILIES[family]
    recorded = Recorded(server_answers(family, tmp_path / "answers.txt"), version=version_output(family))
    # NVML lists no MPS process: a client's GPU can come from the daemon alone
    text = read_with(tmp_path, family, recorded, FakeNvml([FakeGpu(uuid=UUID)]))

    assert recorded.misses == []  # every command sent has an answer
    d = {"daemon": family}
    assert value(text, "mps_exporter_collector_success", collector="control") == 1
    assert value(text, "mps_control_daemon_up", **d) == 1
    assert len(series(text, "mps_server_info", **d, server_pid="1589")) == 1
    assert value(text, "mps_server_clients", **d, server_pid="1589") == 2
    clients = series(text, "mps_client_info", **d)
    assert {re.search(r'[{,]pid="(\d+)"', line).group(1) for line in clients} == {"2457", "2483"}  # type: ignore[union-attr]
    ps_known = "ps" not in unknown  # the command and PID namespace only ps prints
    assert all(('command="python3"' in line) == ps_known for line in clients), clients
    assert all(('pid_namespace="4026531836"' in line) == ps_known for line in clients), clients
    assert value(text, "mps_server_active_thread_ratio", **d, server_pid="1589") == 0.5
    fields = {
        "get_server_status": series(text, "mps_server_status", **d, server_pid="1589", status="ACTIVE"),
        "get_default_client_priority": series(text, "mps_default_client_priority", **d),
        "get_default_device_pinned_mem_limit": series(text, "mps_default_pinned_memory_limit_bytes", **d, gpu="0"),
        "get_device_pinned_mem_limit": series(text, "mps_server_pinned_memory_limit_bytes", **d, gpu="0"),
    }
    for verb, found in fields.items():
        assert bool(found) == (verb not in unknown), verb  # an unknown verb costs its field alone
    if "get_device_pinned_mem_limit" not in unknown:  # 1G on device 0: the clients' GPU is known (ps's)
        assert len(series(text, "mps_client_pinned_memory_limit_bytes", **d, gpu="0")) == 2
    counted = counted_unknown(text, family)
    assert set(counted) == unknown
    for verb in unknown:  # answered `Unknown command` once, never sent again
        assert sum(line.split()[0] == verb for line in recorded.received) == 1, verb
        assert counted[verb] >= 1


def test_a_470_daemon_names_its_clients_devices_without_ps(tmp_path):
    """R470 (no `ps`): each client's server from get_client_list, its device from
    get_device_client_list (the daemon's ordinal 0, named by the node's GPU of that
    ordinal); client ID, PID namespace and command unknown."""
    recorded = Recorded(server_answers("470", tmp_path / "answers.txt"), version=version_output("470"))
    reader = mc.DaemonReader(DaemonConfig("470", "/nonexistent", "/nonexistent"), mc.ControlClient("/nonexistent",
                             runner=recorded))
    reading = reader.read([0], uuids={0: UUID})
    assert reading.error is None and recorded.misses == []
    assert [(c.pid, c.client_id, c.server_pid, c.device, c.namespace, c.command) for c in reading.clients] == [
        (2457, None, 1589, UUID, "", ""), (2483, None, 1589, UUID, "", "")]
    assert [(s.pid, s.status, s.active_thread_percentage, s.pinned_limits) for s in reading.servers] == [
        (1589, None, 50.0, {})]
    # a pinned limit asked by ordinal then by UUID: the first answered `Unknown command`,
    # the second not sent, both counted
    assert reading.commands_unknown == {"ps": 1, "get_server_status": 1, "get_device_pinned_mem_limit": 2,
                                        "get_default_device_pinned_mem_limit": 2, "get_default_client_priority": 1}
    assert [line.split()[0] for line in recorded.received].count("get_device_pinned_mem_limit") == 1


# directory -> what the pipeline must count (lines, unrecognized, and the state it builds)
LOGS = {
    # 535.129.03 (k8s-device-plugin#685): server 95 dies before it is ready (exit 1, a start
    # failure), 98 is started. Its server.log was pasted with each line's `[date time` cut
    # off: all 4 lines counted unrecognized, none breaks the read.
    "535": dict(lines={"control": 5, "server": 4}, unrecognized={"control": 0, "server": 4},
                starts=0, exits={"1": 1}, failures=1, connections=0, queued=0),
    # 580 in the device plugin (k8s-device-plugin#1614): a containerized client (PID 0)
    # pushed while server 337 starts, still waiting when the excerpt ends.
    "580-k8s-device-plugin": dict(lines={"control": 8, "server": 0}, unrecognized={"control": 0, "server": 0},
                                  starts=0, exits={}, failures=0, connections=0, queued=1),
    # 580 on Bottlerocket (bottlerocket-kernel-kit#415), server.log only: one client
    # context connected; the server's limits (33 %, 5 GiB pinned on device 0) are events.
    "580-bottlerocket": dict(lines={"control": 0, "server": 15}, unrecognized={"control": 0, "server": 0},
                             starts=0, exits={}, failures=0, connections=1, queued=0),
    # MPS 13030 under the DRA driver (dra-driver-nvidia-gpu#1153): server 11803 becomes
    # ready (one start), a client of uid 0 is then pushed behind uid 1000's server.
    "580-dra": dict(lines={"control": 14, "server": 0}, unrecognized={"control": 0, "server": 0},
                    starts=1, exits={}, failures=0, connections=0, queued=1),
}


@pytest.mark.parametrize("directory", list(LOGS))
def test_recorded_logs_are_recognized_or_counted(directory):
    expect = LOGS[directory]
    snap = LogPipeline("default", str(DRIVERS / directory), timezone="UTC").read_once()
    assert snap.lines == expect["lines"]
    assert snap.unrecognized == expect["unrecognized"]
    assert snap.count("mps_server_starts_total") == expect["starts"]
    assert snap.server_exits == expect["exits"]
    assert snap.count("mps_server_start_failures_total") == expect["failures"]
    assert snap.count("mps_client_connections_total") == expect["connections"]
    assert sum(snap.queued.values()) == expect["queued"]


@pytest.mark.parametrize("family", RECORDED)
def test_each_recorded_control_log_is_recognized_line_by_line(family):
    """The control.log of each recording (its commands echoed, `Unknown command` answers,
    `Server not found` for `ps` without a server): no line unrecognized, one command
    event per command of answers.txt and the closing `quit`."""
    events = [parse_line(line, "control") for line in
              (DRIVERS / family / "control.recorded.log").read_text().splitlines()]
    assert [e for e in events if isinstance(e, ev.Unrecognized)] == []
    commands = [e for e in events if isinstance(e, ev.Command)]
    assert len(commands) == len(Recorded(DRIVERS / family / "answers.txt").answers) + 1
    assert sum(isinstance(e, ev.DaemonStarted) for e in events) == sum(isinstance(e, ev.DaemonExited) for e in events) == 1


def test_the_580_server_log_carries_its_limits():
    events = [parse_line(line, "server") for line in
              (DRIVERS / "580-bottlerocket" / "server.log").read_text().splitlines()]
    atp = [e for e in events if isinstance(e, ev.ServerActiveThreads)]
    pinned = [e for e in events if isinstance(e, ev.ServerPinnedLimit)]
    priority = [e for e in events if isinstance(e, ev.ServerPriority)]
    assert [(e.pid, e.percentage) for e in atp] == [(4428, 33.0)]
    assert [(e.pid, e.limit_bytes) for e in pinned] == [(4428, 0x140000000)]  # 5 GiB
    assert [e.priority for e in priority] == [0]
    assert not any(isinstance(e, ev.Unrecognized) for e in events)


REPLAY_PROGRAM = '''\
import sys
answers = {}
cmd = None
codes = {}
for line in open(sys.argv[1], encoding="utf-8").read().splitlines():
    if line.startswith("> "):
        cmd = line[2:].strip()
        answers[cmd] = ""
    elif cmd is not None and line.startswith("rc=") and line[3:].isdigit():
        codes[cmd] = int(line[3:])
    elif cmd is not None:
        answers[cmd] += line + "\\n"
if sys.argv[3:] == ["-v"]:  # replay.py ANSWERS VERSION-FILE [-v]: what -v printed
    sys.stdout.write(open(sys.argv[2], encoding="utf-8").read())
    sys.exit(0)
line = sys.stdin.read().strip()
out = answers.get(line)
verb = line.split()[0]
unknown = [c for c, o in answers.items() if c.split()[0] == verb and o.startswith("Unknown command")]
if out is None and unknown:
    line, out = unknown[0], answers[unknown[0]]
if out is None:
    sys.stdout.write("not recorded: " + line + "\\n")
    sys.exit(3)
sys.stdout.write(out)
sys.exit(codes.get(line, 0))
'''


@pytest.mark.parametrize("servers", ["none", "one"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dump_serves_each_familys_recorded_daemon(tmp_path, monkeypatch, family, servers):
    """`mps-exporter dump` with the answers behind a real control program (a subprocess
    answering from the file): the family's recorded daemon as it answered (no server), and
    the written one-server answers restricted to what the family knows. The control
    collector up, the servers and clients served, what the family does not know counted
    per command."""
    unknown = FAMILIES[family]
    answers = DRIVERS / family / "answers.txt" if servers == "none" else server_answers(family, tmp_path / "a.txt")
    version = tmp_path / "version.txt"
    version.write_text(version_output(family))
    program = tmp_path / "replay.py"
    program.write_text(REPLAY_PROGRAM)
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {program} {answers} {version} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    rc = cli.main(["dump", "--mps.pipe-directory", str(pipe), "--mps.log-directory", str(tmp_path / "log"),
                   "--mps.control-binary", str(binary), "--no-mps.discover-processes",
                   "--no-collector.nvml", "--no-collector.dcgm", "--no-collector.proc", "--no-collector.logs",
                   "--textfile", str(tmp_path / "dump.prom")])
    text = (tmp_path / "dump.prom").read_text()
    assert rc == 0
    d = {"daemon": "default"}
    assert value(text, "mps_exporter_collector_success", collector="control") == 1
    assert value(text, "mps_control_daemon_up", **d) == 1
    assert bool(series(text, "mps_default_client_priority", **d)) == ("get_default_client_priority" not in unknown)
    if servers == "none":
        assert series(text, "mps_server_info", **d) == []
        # a daemon without servers is asked ps and the defaults only
        assert set(counted_unknown(text, "default")) == SERVER_LESS_UNKNOWN[family]
        return
    assert value(text, "mps_server_clients", **d, server_pid="1589") == 2
    assert len(series(text, "mps_client_info", **d)) == 2
    assert bool(series(text, "mps_server_status", **d)) == ("get_server_status" not in unknown)
    assert set(counted_unknown(text, "default")) == unknown  # one dump asks each verb once


def test_no_recorded_line_breaks_the_parser_even_with_its_numbers_made_huge():
    """Every line of every family's logs, and each with one number made 5,000 digits long:
    an event or an Unrecognized with a reason, never the parser's own error."""
    from mps_exporter.logs.parser import PARSER_ERROR

    huge, checked = "9" * 5000, 0
    for path in sorted(DRIVERS.rglob("*.log")):
        file = "control" if path.name.startswith("control") else "server"
        for line in path.read_text(encoding="utf-8").splitlines():
            variants = [line] + [line[:m.start()] + huge + line[m.end():] for m in re.finditer(r"\d+", line)]
            for text in variants:
                result = parse_line(text, file)
                assert not (isinstance(result, ev.Unrecognized) and result.reason == PARSER_ERROR), text[:200]
                checked += 1
    assert checked > 400  # 425 with the fixtures of 2026-11
