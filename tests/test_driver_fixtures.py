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
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.support.data import DATA
from tests.support.golden import exposition

DRIVERS = DATA / "drivers"
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
PINNED = frozenset({"get_device_pinned_mem_limit", "get_default_device_pinned_mem_limit"})
PRIORITY = frozenset({"get_default_client_priority"})


@dataclass
class Recorded:
    """`ControlClient.runner` answering from a family's answers.txt: a command line
    recorded there gets its recorded answer; a verb recorded without arguments answers
    `Unknown command` whatever its arguments. Anything else is a miss (the test fails)."""

    path: Path
    version: str = "11040"
    answers: Dict[str, str] = field(default_factory=dict)
    misses: List[str] = field(default_factory=list)
    received: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.answers = dict(transcript_outputs(self.path))
        assert self.answers, f"{self.path}: no recorded answers"

    def __call__(self, argv: Sequence[str], stdin_text: str, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
        if list(argv[1:]) == ["-v"]:
            return 0, f"CUDA MPS Control for Linux/Unix/QNX. Binary version: {self.version}\n"
        line = stdin_text.strip()
        self.received.append(line)
        if line in self.answers:
            return 0, self.answers[line]
        verb = line.split()[0]
        if self.answers.get(verb, "").startswith(mc.UNKNOWN_COMMAND):
            return 0, self.answers[verb]
        self.misses.append(line)
        return 1, f"not recorded: {line}\n"

    def unknown_verbs(self) -> FrozenSet[str]:
        return frozenset(cmd for cmd, out in self.answers.items() if out.startswith(mc.UNKNOWN_COMMAND))


# family -> (the verbs its daemon answers `Unknown command`, the version its -v prints)
FAMILIES: Dict[str, Tuple[FrozenSet[str], str]] = {
    "470": (PINNED | PRIORITY, "11040"),
    "580": (frozenset(), "13000"),
}


def series(text: str, name: str, **labels: str) -> List[str]:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return [line for line in text.splitlines() if line.startswith(name + "{") and all(w in line for w in want)]


def value(text: str, name: str, **labels: str) -> float:
    found = series(text, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return float(found[0].rsplit(" ", 1)[1])


def test_every_family_directory_names_its_source():
    dirs = sorted(p for p in DRIVERS.iterdir() if p.is_dir())
    assert {p.name for p in dirs} >= {"470", "535", "580", "580-bottlerocket", "580-dra", "580-k8s-device-plugin"}
    for d in dirs:
        source = (d / "SOURCE").read_text()
        assert "https://" in source, d
        assert any((d / f).is_file() for f in ("answers.txt", "control.log", "server.log")), d


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_answers_serve_servers_and_clients(tmp_path, family):
    unknown, version = FAMILIES[family]
    recorded = Recorded(DRIVERS / family / "answers.txt", version=version)
    assert recorded.unknown_verbs() == unknown  # the fixture says what the family lacks
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    nvml = FakeNvml([FakeGpu(uuid=UUID, mps_processes=[NvmlProcess(2457, 1 << 30), NvmlProcess(2483, 1 << 30)])])
    cfg = Config()
    cfg.daemons = [DaemonConfig(family, str(pipe), str(tmp_path / "log"))]
    cfg.procfs = str(write_proc(tmp_path / "proc", []))
    cfg.collectors.update(dcgm=False, logs=False, proc=False)
    cfg.runtime_roots = ()
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=recorded, nvml_wait_for_every_answer=True))
    collector = build_collector(cfg, readers)
    try:
        exposition(collector)
        text = exposition(collector)  # the second scrape: what was learned is not asked again
    finally:
        for r in readers.values():
            r.close()

    assert recorded.misses == []  # every command sent has a recorded answer
    d = {"daemon": family}
    assert value(text, "mps_exporter_collector_success", collector="control") == 1
    assert value(text, "mps_control_daemon_up", **d) == 1
    assert len(series(text, "mps_server_info", **d, server_pid="1589")) == 1
    assert value(text, "mps_server_clients", **d, server_pid="1589") == 2
    assert {re.search(r'[{,]pid="(\d+)"', line).group(1)  # type: ignore[union-attr]
            for line in series(text, "mps_client_info", **d)} == {"2457", "2483"}
    assert value(text, "mps_server_active_thread_ratio", **d, server_pid="1589") == 0.5
    fields = {
        "get_default_client_priority": series(text, "mps_default_client_priority", **d),
        "get_default_device_pinned_mem_limit": series(text, "mps_default_pinned_memory_limit_bytes", **d),
    }
    for verb, found in fields.items():
        assert bool(found) == (verb not in unknown), verb  # an unknown verb costs its field alone
    counted = {line.split('command="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in series(text, "mps_exporter_control_commands_unknown_total", **d)}
    assert set(counted) == unknown
    for verb in unknown:  # answered `Unknown command` once, never sent again
        assert sum(line.split()[0] == verb for line in recorded.received) == 1, verb
        assert counted[verb] >= 1


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
for line in open(sys.argv[1], encoding="utf-8").read().splitlines():
    if line.startswith("> "):
        cmd = line[2:].strip()
        answers[cmd] = ""
    elif cmd is not None:
        answers[cmd] += line + "\\n"
if sys.argv[3:] == ["-v"]:  # replay.py ANSWERS VERSION [-v]
    print("CUDA MPS Control for Linux/Unix/QNX. Binary version: " + sys.argv[2])
    sys.exit(0)
line = sys.stdin.read().strip()
out = answers.get(line)
if out is None and answers.get(line.split()[0], "").startswith("Unknown command"):
    out = answers[line.split()[0]]
if out is None:
    sys.stdout.write("not recorded: " + line + "\\n")
    sys.exit(3)
sys.stdout.write(out)
'''


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dump_serves_each_familys_recorded_daemon(tmp_path, monkeypatch, family):
    """`mps-exporter dump` with the recorded answers behind a real control program (a
    subprocess answering from answers.txt): the control collector up, the servers and
    clients served, what the family does not know counted per command."""
    unknown, version = FAMILIES[family]
    program = tmp_path / "replay.py"
    program.write_text(REPLAY_PROGRAM)
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {program} {DRIVERS / family / 'answers.txt'} {version} \"$@\"\n")
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
    assert value(text, "mps_server_clients", **d, server_pid="1589") == 2
    assert len(series(text, "mps_client_info", **d)) == 2
    assert bool(series(text, "mps_default_client_priority", **d)) == ("get_default_client_priority" not in unknown)
    counted = {line.split('command="')[1].split('"')[0]
               for line in series(text, "mps_exporter_control_commands_unknown_total", **d)}
    assert counted == unknown  # one dump asks each verb once: every unknown one answered so


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
