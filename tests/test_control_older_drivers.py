"""Older drivers (issue 41): a control daemon that answers `Unknown command` to one of
the exporter's commands (drivers before client priorities, before pinned memory limits)
costs that field, never its servers and clients; the exporter learns it once per daemon,
forgets it when the daemon restarts, and counts what was not asked or not answered."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, FrozenSet

import pytest

from mps_exporter.config import Config, DaemonConfig
from mps_exporter.sources import control as mc
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer, transcript_outputs
from tests.fakes.fake_procfs import write_proc
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.support.data import DATA
from tests.support.golden import exposition
from tests.support.lines import series, value

UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
PINNED = frozenset({"get_device_pinned_mem_limit", "get_default_device_pinned_mem_limit"})
PRIORITY = frozenset({"get_default_client_priority"})
STATUS = frozenset({"get_server_status"})
PS = frozenset({"ps"})
DRIVERS = DATA / "drivers"


def recorded_unknown(answers: Path) -> FrozenSet[str]:
    """The exporter's verbs a family's recorded daemon answered `Unknown command`."""
    return frozenset(cmd.split()[0] for cmd, out in transcript_outputs(answers)
                     if out.startswith(mc.UNKNOWN_COMMAND)) & frozenset(mc.READ_ONLY_COMMANDS)


# Driver families by the commands their daemons do not know, read from each family's
# recording of NVIDIA's program (tests/data/drivers/<family>/answers.txt, every family
# directory: R470, R525, R535, R550, R555, R570, R580), then shapes no family recorded.
FAMILIES: Dict[str, FrozenSet[str]] = {
    **{f"R{d.name}": recorded_unknown(d / "answers.txt") for d in sorted(DRIVERS.iterdir()) if d.name.isdigit()},
    "before client priorities (no family)": PRIORITY,
    "nothing but get_server_list and ps": mc.OPTIONAL_COMMANDS - PS,
    "nothing but get_server_list and get_client_list": mc.OPTIONAL_COMMANDS - {"get_client_list"},
}


def test_every_recorded_family_is_a_row():
    """The rows come from the recordings: each family's directory is one, R470's lacks the
    most (tests/test_driver_fixtures.py holds each family's set, literal)."""
    assert [f for f in FAMILIES if f.startswith("R")] == ["R470", "R525", "R535", "R550", "R555", "R570", "R580"]
    assert FAMILIES["R470"] == PS | STATUS | PINNED | PRIORITY

def daemon(unknown: FrozenSet[str]) -> FakeControlDaemon:
    """A daemon of a family that lacks `unknown`: R525 or older, whose program says no
    binary version (docs/drivers.md)."""
    return FakeControlDaemon(
        servers=[FakeServer(500, active_thread_percentage=50.0, pinned_limits={0: "1G"})],
        clients=[FakeClient(501, 500, UUID, 1), FakeClient(502, 500, UUID, 2)],
        default_active_thread_percentage=80.0, default_pinned_limits={0: "2G"}, default_client_priority=1,
        unknown_commands=unknown, version="")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_driver_family_serves_its_servers_and_clients(tmp_path, family):
    """Done-when: the servers and clients with the fields the daemon could read, the
    control collector up, and what was not asked or not answered counted per command."""
    unknown = FAMILIES[family]
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    fake = daemon(unknown)
    nvml = FakeNvml([FakeGpu(uuid=UUID, mps_processes=[NvmlProcess(501, 1 << 30), NvmlProcess(502, 1 << 30)])])
    cfg = Config()
    cfg.daemons = [DaemonConfig("old", str(pipe), str(tmp_path / "log"))]
    cfg.procfs = str(write_proc(tmp_path / "proc", []))
    cfg.collectors.update(dcgm=False, logs=False, proc=False)
    cfg.runtime_roots = ()
    # Each scrape waits for its own control read: with the default 10 ms wait, a loaded machine
    # serves the second scrape the first one's reading (tests/support/scenarios.py does the same).
    cfg.control_wait = 0.0
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=FakeDaemons({str(pipe): fake}), nvml_wait_for_every_answer=True))
    collector = build_collector(cfg, readers)
    try:
        exposition(collector)
        text = exposition(collector)  # the second scrape: what was learned is not asked again
    finally:
        for r in readers.values():
            r.close()

    d = {"daemon": "old"}
    assert value(text, "mps_exporter_collector_success", collector="control") == 1
    assert value(text, "mps_control_daemon_up", **d) == 1
    assert len(series(text, "mps_server_info", **d, server_pid="500")) == 1
    assert value(text, "mps_server_clients", **d, server_pid="500") == 2
    assert len(series(text, "mps_client_info", **d)) == 2
    known = {
        "get_default_active_thread_percentage": series(text, "mps_default_active_thread_ratio", **d),
        "get_default_client_priority": series(text, "mps_default_client_priority", **d),
        "get_default_device_pinned_mem_limit": series(text, "mps_default_pinned_memory_limit_bytes", **d),
        "get_active_thread_percentage": series(text, "mps_server_active_thread_ratio", **d),
        "get_device_pinned_mem_limit": series(text, "mps_server_pinned_memory_limit_bytes", **d),
        "get_server_status": series(text, "mps_server_status", **d),
    }
    # ps, and where it is unknown get_client_list and get_device_client_list in its stead
    sent = set(known) | PS | ({"get_client_list", "get_device_client_list"} if "ps" in unknown else set())
    asked = set(unknown) & sent
    assert {verb for verb, found in known.items() if not found} == asked & set(known)  # each costs its field alone
    counted = {line.split('command="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in series(text, "mps_exporter_control_commands_unknown_total", **d)}
    assert set(counted) == asked
    for verb in asked:  # answered Unknown command once, never sent again
        assert sum(line.split()[0] == verb for line in fake.received) == 1, verb
        assert counted[verb] >= 1
    if "get_server_status" in unknown:  # asked in every read while no status is known: counted, not sent
        assert counted["get_server_status"] == 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reader(tmp_path: Path, fake: FakeControlDaemon, clock: Clock) -> mc.DaemonReader:
    pipe = tmp_path / "pipe"
    pipe.mkdir(exist_ok=True)
    return mc.DaemonReader(DaemonConfig("old", str(pipe), str(tmp_path / "log")),
                           mc.ControlClient(str(pipe), runner=fake), facts_refresh_seconds=10.0, clock=clock)


def sent(fake: FakeControlDaemon, verb: str) -> int:
    return sum(line.split()[0] == verb for line in fake.received)


def test_learned_once_per_daemon_and_forgotten_when_it_restarts(tmp_path):
    fake, clock = daemon(PINNED | PRIORITY), Clock()
    r = reader(tmp_path, fake, clock)
    pid_file = tmp_path / "pipe" / mc.PID_FILE
    pid_file.write_text("546\n")
    first = r.read([0], uuids={0: UUID})
    assert first.error is None and [s.pid for s in first.servers] == [500]
    assert first.default_client_priority is None and first.default_pinned_limits == {}
    assert first.servers[0].pinned_limits == {} and first.servers[0].active_thread_percentage == 50.0
    # The ordinal answered Unknown command; the UUID form of the same verb was not sent.
    assert sent(fake, "get_default_device_pinned_mem_limit") == 1
    assert first.commands_unknown == {"get_default_client_priority": 1, "get_default_device_pinned_mem_limit": 2,
                                      "get_device_pinned_mem_limit": 2}
    for step in range(1, 4):  # the facts expire every 10 s: re-read, and these not asked again
        clock.now = 10.0 * step
        r.read([0], uuids={0: UUID})
    assert sent(fake, "get_default_client_priority") == sent(fake, "get_device_pinned_mem_limit") == 1
    assert sent(fake, "get_default_active_thread_percentage") == 4  # a known verb is re-read as before
    last = r.read([0], uuids={0: UUID})
    assert last.commands_unknown["get_default_client_priority"] == 4  # 1 answer + 3 not sent

    # The driver is upgraded and the daemon restarted: a new pid file, and it knows them all.
    fake.unknown_commands = frozenset()
    pid_file.write_text("9999\n")
    os.utime(pid_file, ns=(1, 1))
    clock.now = 100.0
    upgraded = r.read([0], uuids={0: UUID})
    assert sent(fake, "get_default_client_priority") == 2
    assert upgraded.default_client_priority == 1
    assert upgraded.default_pinned_limits == {0: 2 << 30} and upgraded.servers[0].pinned_limits == {0: 1 << 30}


def test_a_daemon_that_stops_is_asked_again_when_it_comes_back(tmp_path):
    fake, clock = daemon(PRIORITY), Clock()
    r = reader(tmp_path, fake, clock)
    r.read([0])
    fake.running = False
    assert r.read([0]).up is False
    fake.running, fake.unknown_commands = True, frozenset()
    assert r.read([0]).default_client_priority == 1
    assert sent(fake, "get_default_client_priority") == 2


def test_other_errors_still_fail_the_daemon(tmp_path):
    """Only `Unknown command` costs a field: an answer that cannot be read is an error."""
    fake, clock = daemon(frozenset()), Clock()
    fake.default_active_thread_percentage = 250.0  # not a percentage
    reading = reader(tmp_path, fake, clock).read([0])
    assert reading.error is not None and "thread percentage" in reading.error


def test_unknown_command_is_its_own_error_whatever_the_exit_code():
    for rc in (0, 1):
        client = mc.ControlClient("/tmp/x", runner=lambda argv, text, env, timeout, rc=rc:
                                  (rc, 'Unknown command "get_default_client_priority"\n'))
        with pytest.raises(mc.UnknownCommand):
            client.run("get_default_client_priority")
    with pytest.raises(mc.UnknownCommand):
        mc.check_reply('Unknown command "help"\n')  # driver 580's words (ctl_idle.txt)
