"""The control-daemon source: parsers on the capture's real replies, the allowlist,
timeouts, caching, and edge cases at the subprocess boundary."""

import sys
import textwrap

import pytest

from mps_exporter.config import DaemonConfig
from mps_exporter.sources import mps_control as mc
from tests.fakes.fake_control import CAPTURE, FakeClient, FakeControlDaemon, FakeServer, transcript_outputs

UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"


def outputs(name):
    return dict(transcript_outputs(CAPTURE / "control" / name))


# ------------------------------------------------------------ parsers on real replies
def test_parsers_on_busy_capture():
    out = outputs("ctl_busy.txt")
    assert mc.parse_pid_list(out["get_server_list"]) == [1589]
    assert mc.parse_pid_list(out["get_client_list 1589"]) == [1649, 1648, 1647]
    assert mc.parse_server_status(out["get_server_status 1589"]) == "ACTIVE"
    ps = mc.parse_ps(out["ps"])
    assert [(e.pid, e.client_id, e.server_pid, e.device, e.namespace, e.command) for e in ps] == [
        (1649, 7, 1589, "GPU-a20825ef-ef8f-4f37", "4026531836", "python3"),
        (1648, 8, 1589, "GPU-a20825ef-ef8f-4f37", "4026531836", "python3"),
        (1647, 6, 1589, "GPU-a20825ef-ef8f-4f37", "4026531836", "python3"),
    ]
    # A client PID is not a server: the daemon says so, and that is ServerNotFound.
    with pytest.raises(mc.ServerNotFound):
        mc.parse_percentage(out["get_active_thread_percentage 1649"])
    with pytest.raises(mc.ControlError, match="Unknown command"):
        mc.check_reply(out["get_client_priority 1649"])


def test_parsers_on_idle_limits_and_nodaemon_captures():
    idle = outputs("ctl_idle.txt")
    assert mc.parse_pid_list(idle["get_server_list"]) == []
    assert mc.parse_percentage(idle["get_default_active_thread_percentage"]) == 100.0
    assert mc.parse_pinned_limit(idle["get_default_device_pinned_mem_limit 0"]) is None  # empty reply
    limits = outputs("limits.txt")
    assert mc.parse_pinned_limit(limits["get_default_device_pinned_mem_limit 0"]) == 2 * 1024**3
    # limits.txt appends the clients' own output after this command's reply: first line only.
    assert mc.parse_percentage(limits["get_default_active_thread_percentage"].splitlines()[0]) == 25.0
    nodaemon = outputs("ctl_nodaemon.txt")
    with pytest.raises(mc.DaemonNotRunning):
        mc.parse_pid_list(nodaemon["no daemon: get_server_list"])
    assert mc.parse_version((CAPTURE / "control" / "ctl_latency.txt").read_text()) == "13000"


def test_parsers_reject_garbage():
    with pytest.raises(mc.ControlError):
        mc.parse_pid_list("1589\nsomething else\n")
    with pytest.raises(mc.ControlError):
        mc.parse_ps("not a header\n1 2 3\n")
    with pytest.raises(mc.ControlError):
        mc.parse_server_status("MAYBE\n")
    with pytest.raises(mc.ControlError):
        mc.parse_percentage("250.0\n")
    assert mc.parse_pinned_limit("No default pinned memory limit set for the device!\n") is None
    assert mc.parse_pinned_limit("512M\n") == 512 * 1024**2
    assert mc.parse_pinned_limit("0x80000000 bytes\n") == 2**31


# ------------------------------------------------------------ the allowlist
@pytest.mark.parametrize("verb,args", [
    ("quit", ()), ("shutdown_server", (1589,)), ("set_default_active_thread_percentage", (25,)),
    ("set_active_thread_percentage", (1589, 25)), ("set_default_device_pinned_mem_limit", (0, "2G")),
    ("start_server", ()), ("terminate_client", (1589, 1647)), ("help", ()),
    # argument smuggling: a newline would make the daemon run a second command
    ("get_server_status", ("1589\nquit",)), ("get_server_status", ("1589 quit",)),
    ("get_client_list", ("-1",)), ("get_server_list", ("extra",)), ("get_device_pinned_mem_limit", (1589,)),
])
def test_write_commands_cannot_be_sent(verb, args):
    daemon = FakeControlDaemon.busy_capture()
    client = mc.ControlClient("/tmp/pipe", runner=daemon)
    with pytest.raises(mc.CommandNotAllowed):
        client.run(verb, *args)
    assert daemon.received == []


def test_every_command_a_scrape_sends_is_read_only_and_single_line():
    daemon = FakeControlDaemon.busy_capture()
    source = mc.ControlSource(DaemonConfig("default", "/tmp/pipe", "/tmp/log"), mc.ControlClient("/tmp/pipe", runner=daemon))
    for _ in range(3):
        source.read(devices=[0, 1])
    assert daemon.received
    for line in daemon.received:
        assert line.endswith("\n") and line.count("\n") == 1
        assert line.split()[0] in mc.READ_ONLY_COMMANDS
    assert all(env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/pipe" for env in daemon.envs)


# ------------------------------------------------------------ the source
def make_source(daemon, refresh=60.0, clock=None):
    kwargs = {"clock": clock} if clock else {}
    return mc.ControlSource(DaemonConfig("default", "/p", "/l"), mc.ControlClient("/p", runner=daemon),
                            facts_refresh_seconds=refresh, **kwargs)


def test_busy_reading_and_commands_per_scrape():
    daemon = FakeControlDaemon.busy_capture()
    daemon.default_pinned_limits = {0: "2G"}
    daemon.servers[0].pinned_limits = {0: "1G"}
    daemon.servers[0].active_thread_percentage = 50.0
    source = make_source(daemon)
    r = source.read(devices=[0])
    assert r.up and r.error is None and r.version == "13000"
    assert [(s.pid, s.status, s.active_thread_percentage, s.pinned_limits) for s in r.servers] == [(1589, "ACTIVE", 50.0, {0: 1 << 30})]
    assert sorted(c.pid for c in r.clients) == [1647, 1648, 1649]
    assert r.default_active_thread_percentage == 100.0 and r.default_pinned_limits == {0: 2 << 30}
    first = len(daemon.received)
    source.read(devices=[0])
    # Steady state: get_server_list, ps, and get_server_status per server; limits are cached.
    assert daemon.received[first:] == ["get_server_list\n", "ps\n", "get_server_status 1589\n"]


def test_facts_are_reread_after_refresh_interval_and_for_new_servers():
    now = [0.0]
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon, refresh=60, clock=lambda: now[0])
    source.read(devices=[0])
    daemon.servers[0].active_thread_percentage = 30.0
    now[0] = 30
    assert source.read(devices=[0]).servers[0].active_thread_percentage == 100.0  # cached
    now[0] = 61
    assert source.read(devices=[0]).servers[0].active_thread_percentage == 30.0
    daemon.servers.append(FakeServer(2521, status="INITIALIZING", active_thread_percentage=25.0))
    r = source.read(devices=[0])
    assert {(s.pid, s.status, s.active_thread_percentage) for s in r.servers} == {(1589, "ACTIVE", 30.0), (2521, "INITIALIZING", 25.0)}


def test_a_new_set_command_in_control_log_rereads_every_limit_at_once():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon, refresh=60, clock=lambda: 0.0)
    source.read(devices=[0], limit_commands=lambda: 2)
    daemon.servers[0].active_thread_percentage, daemon.servers[0].pinned_limits = 30.0, {0: "3G"}
    daemon.default_active_thread_percentage, daemon.default_pinned_limits = 25.0, {0: "2G"}
    r = source.read(devices=[0], limit_commands=lambda: 2)  # no new set_* line: cached
    assert (r.servers[0].active_thread_percentage, r.servers[0].pinned_limits) == (100.0, {})
    assert (r.default_active_thread_percentage, r.default_pinned_limits) == (100.0, {})
    r = source.read(devices=[0], limit_commands=lambda: 3)
    assert (r.servers[0].active_thread_percentage, r.servers[0].pinned_limits) == (30.0, {0: 3 << 30})
    assert (r.default_active_thread_percentage, r.default_pinned_limits) == (25.0, {0: 2 << 30})
    first = len(daemon.received)
    source.read(devices=[0], limit_commands=lambda: 3)  # and cached again
    assert daemon.received[first:] == ["get_server_list\n", "ps\n", "get_server_status 1589\n"]
    asked_after = []  # the commands sent when the count is asked: waiting for the logs overlaps them
    source.read(devices=[0], limit_commands=lambda: asked_after.append(list(daemon.received[-2:])) or 3)
    assert asked_after == [["get_server_list\n", "ps\n"]]
    first = len(daemon.received)
    source.read(devices=[0])  # logs not read: the refresh interval alone
    assert daemon.received[first:] == ["get_server_list\n", "ps\n", "get_server_status 1589\n"]


def test_no_daemon_is_down_not_an_error():
    r = make_source(FakeControlDaemon(running=False)).read(devices=[0])
    assert not r.up and r.error is None and r.servers == [] and r.clients == []


def test_empty_server_list():
    r = make_source(FakeControlDaemon()).read(devices=[0])
    assert r.up and r.servers == [] and r.clients == []


def test_server_disappearing_between_two_commands_is_dropped_with_its_clients():
    daemon = FakeControlDaemon.busy_capture()
    daemon.servers.append(FakeServer(2000))
    daemon.clients.append(FakeClient(2001, 2000, UUID))
    daemon.vanish_after_list = [1589]
    r = make_source(daemon).read(devices=[0])
    assert r.up and r.error is None
    assert [s.pid for s in r.servers] == [2000]
    assert [c.pid for c in r.clients] == [2001]


def test_fault_status_is_reported():
    daemon = FakeControlDaemon.busy_capture()
    daemon.servers[0].status = "FAULT"
    assert make_source(daemon).read(devices=[0]).servers[0].status == "FAULT"


def test_hung_daemon_is_an_error_not_a_crash():
    daemon = FakeControlDaemon.busy_capture()
    daemon.hang_seconds = 0.05
    source = mc.ControlSource(DaemonConfig("default", "/p", "/l"), mc.ControlClient("/p", timeout=0.01, runner=daemon))
    r = source.read(devices=[0])
    assert not r.up and "did not answer" in r.error


def test_missing_binary_is_an_error():
    client = mc.ControlClient("/p", binary="/nonexistent/nvidia-cuda-mps-control")
    r = mc.ControlSource(DaemonConfig("default", "/p", "/l"), client).read(devices=[0])
    assert not r.up and "not found" in r.error


def test_real_subprocess_timeout_kills_the_process(tmp_path):
    # A stand-in control program that never answers: the runner must kill it on time.
    prog = tmp_path / "hang.py"
    prog.write_text(textwrap.dedent("""
        import sys, time
        sys.stdin.read()
        time.sleep(30)
    """))
    pidfile = tmp_path / "pid"
    wrapper = tmp_path / "nvidia-cuda-mps-control"
    wrapper.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec {sys.executable} {prog}\n")
    wrapper.chmod(0o755)
    client = mc.ControlClient("/p", binary=str(wrapper), timeout=0.5)
    with pytest.raises(mc.ControlError, match="did not answer within 0.5s"):
        client.run("get_server_list")
    import os
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_real_subprocess_passes_pipe_directory(tmp_path):
    wrapper = tmp_path / "nvidia-cuda-mps-control"
    wrapper.write_text('#!/bin/sh\nread cmd\necho "$CUDA_MPS_PIPE_DIRECTORY $cmd"\n')
    wrapper.chmod(0o755)
    client = mc.ControlClient("/run/nvidia/mps/pipe", binary=str(wrapper))
    assert client.run("get_server_status", 12).strip() == "/run/nvidia/mps/pipe get_server_status 12"
