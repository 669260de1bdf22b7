"""The control-daemon source: parsers on the capture's real replies, the allowlist,
timeouts, caching, and edge cases at the subprocess boundary."""

import sys
import textwrap

import pytest

from mps_exporter.config import DaemonConfig
from mps_exporter.sources import control as mc
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


def test_device_client_list_on_the_capture_and_refused_shapes():
    """`get_device_client_list` as driver 580 printed it (a heading per device, `PID.N`
    per client): the daemon's ordinal of each client's device; nothing, no clients; a
    server gone, ServerNotFound; any other line refused whole, never guessed."""
    out = outputs("ctl_busy.txt")
    assert mc.parse_device_client_list(out["get_device_client_list 0"]) == {1647: 0, 1648: 0, 1649: 0}
    assert mc.parse_device_client_list(outputs("ctl_idle.txt")["get_device_client_list"]) == {}
    two = "[0] 00:00.0, NVIDIA H200\n501.1\n[1] 00:01.0, NVIDIA H200\n502.1\n501.2\n"
    assert mc.parse_device_client_list(two) == {501: 0, 502: 1}  # a client on two devices keeps its first
    with pytest.raises(mc.ServerNotFound):
        mc.parse_device_client_list("Server 1 not found\n")  # as R470 answered without a server
    for bad in ("501.1\n", "[0] 00:00.0, NVIDIA H200\npython3\n", "[0] x\n" + "1.1\n" * (mc.MAX_LISTED + 1),
                "[99999] x\n1.1\n", "[0] x\n" + "9" * 5000 + ".1\n"):
        with pytest.raises(mc.ControlError):
            mc.parse_device_client_list(bad)


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
    # a GPU UUID only where a device goes, and only a whole one
    ("get_server_status", ("GPU-8f6d4e9c-1c2b-4b7a-9d3e-2f1a0b9c8d7e",)),
    ("get_default_device_pinned_mem_limit", ("GPU-8f6d4e9c-1c2b-4b7a-9d3e-2f1a0b9c8d7e\nquit",)),
    ("get_default_device_pinned_mem_limit", ("GPU-8f6d",)),
])
def test_write_commands_cannot_be_sent(verb, args):
    daemon = FakeControlDaemon.busy_capture()
    client = mc.ControlClient("/tmp/pipe", runner=daemon)
    with pytest.raises(mc.CommandNotAllowed):
        client.run(verb, *args)
    assert daemon.received == []


def test_a_device_may_be_named_by_its_gpu_uuid():
    """NVIDIA's DRA driver sets limits by GPU UUID; MPS answers them only asked so (issue 38)."""
    client = mc.ControlClient("/tmp/pipe", runner=FakeControlDaemon.busy_capture())
    uuid = "GPU-8f6d4e9c-1c2b-4b7a-9d3e-2f1a0b9c8d7e"
    assert client.command_line("get_default_device_pinned_mem_limit", uuid) == f"get_default_device_pinned_mem_limit {uuid}"
    assert client.command_line("get_device_pinned_mem_limit", 1589, uuid) == f"get_device_pinned_mem_limit 1589 {uuid}"


def test_every_command_a_scrape_sends_is_read_only_and_single_line():
    daemon = FakeControlDaemon.busy_capture()
    source = mc.DaemonReader(DaemonConfig("default", "/tmp/pipe", "/tmp/log"), mc.ControlClient("/tmp/pipe", runner=daemon))
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
    return mc.DaemonReader(DaemonConfig("default", "/p", "/l"), mc.ControlClient("/p", runner=daemon),
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


@pytest.mark.parametrize("version,asked_by_uuid", [("13000", False), ("13010", False), ("12080", True), ("", True)])
def test_a_servers_limit_is_asked_by_uuid_only_where_the_binary_may_key_it_as_set(version, asked_by_uuid):
    """From R580 (binary 13000) a server's limit answers alike by ordinal and by UUID
    (tests/gpu/reports/2026-11-29-h200-pinned-limit-keys): an empty answer by ordinal is
    the answer. An older binary, or one that says no version, is asked by UUID as well,
    where a limit set by UUID answers; the daemon's defaults are asked both ways always."""
    daemon = FakeControlDaemon.busy_capture()
    daemon.version = version
    daemon.servers[0].pinned_limits = {UUID: "3G"}  # answered only by UUID, as a daemon keying it as set would
    daemon.default_pinned_limits = {UUID: "2G"}
    r = make_source(daemon).read(devices=[0], uuids={0: UUID})
    assert (f"get_device_pinned_mem_limit 1589 {UUID}\n" in daemon.received) == asked_by_uuid
    assert f"get_default_device_pinned_mem_limit {UUID}\n" in daemon.received
    assert r.default_pinned_limits == {0: 2 << 30}
    assert r.servers[0].pinned_limits == ({0: 3 << 30} if asked_by_uuid else {})


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


def signals(log_changes=None, limit_commands=None, nvml=None, daemon_pid=546):
    marks = mc.ChangeSignals(log_changes, None if limit_commands is None else (limit_commands, daemon_pid),
                             None if nvml is None else frozenset(nvml))
    return lambda: marks


def sent_by(source, daemon, **kwargs):
    """The commands one read sends."""
    first = len(daemon.received)
    reading = source.read(devices=[0], signals=signals(**kwargs))
    return [line.strip() for line in daemon.received[first:]], reading


def test_a_new_set_command_in_control_log_rereads_every_limit_at_once():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon, refresh=60, clock=lambda: 0.0)
    sent_by(source, daemon, log_changes=5, limit_commands=2)
    daemon.servers[0].active_thread_percentage, daemon.servers[0].pinned_limits = 30.0, {0: "3G"}
    daemon.default_active_thread_percentage, daemon.default_pinned_limits = 25.0, {0: "2G"}
    _, r = sent_by(source, daemon, log_changes=5, limit_commands=2)  # no new set_* line: cached
    assert (r.servers[0].active_thread_percentage, r.servers[0].pinned_limits) == (100.0, {})
    assert (r.default_active_thread_percentage, r.default_pinned_limits) == (100.0, {})
    _, r = sent_by(source, daemon, log_changes=5, limit_commands=3)
    assert (r.servers[0].active_thread_percentage, r.servers[0].pinned_limits) == (30.0, {0: 3 << 30})
    assert (r.default_active_thread_percentage, r.default_pinned_limits) == (25.0, {0: 2 << 30})
    assert sent_by(source, daemon, log_changes=5, limit_commands=3)[0] == ["get_server_list"]  # cached again
    # A new daemon (its PID in control.log) starts with its own defaults: read again.
    daemon.default_active_thread_percentage = 50.0
    sent, r = sent_by(source, daemon, log_changes=6, limit_commands=3, daemon_pid=700)
    assert "get_default_active_thread_percentage" in sent and r.default_active_thread_percentage == 50.0


def test_with_the_logs_read_limits_never_expire_by_time():
    now = [0.0]
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon, refresh=60, clock=lambda: now[0])
    sent_by(source, daemon, log_changes=1, limit_commands=0)
    sent_by(source, daemon, log_changes=1, limit_commands=0)
    now[0] = 3600
    assert sent_by(source, daemon, log_changes=1, limit_commands=0)[0] == ["get_server_list"]


def test_steady_state_sends_get_server_list_alone():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon)
    first, _ = sent_by(source, daemon, log_changes=10, limit_commands=0)
    assert first[:3] == ["get_server_list", "ps", "get_default_active_thread_percentage"]
    # The second `ps` confirms the first (a client may arrive between two lines of an answer).
    assert sent_by(source, daemon, log_changes=10, limit_commands=0)[0] == ["get_server_list", "ps"]
    for _ in range(5):
        sent, r = sent_by(source, daemon, log_changes=10, limit_commands=0)
        assert sent == ["get_server_list"]
        # ... and the reading is the same as when every command was sent
        assert sorted(c.pid for c in r.clients) == [1647, 1648, 1649]
        assert [(s.pid, s.status) for s in r.servers] == [(1589, "ACTIVE")]
    assert r.commands_sent == {"get_server_list": 7, "ps": 2, "get_server_status": 1,
                               "get_default_active_thread_percentage": 1, "get_default_device_pinned_mem_limit": 1,
                               "get_default_client_priority": 1,
                               "get_active_thread_percentage": 1, "get_device_pinned_mem_limit": 1}


def test_a_client_arriving_shows_in_the_next_read():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon)
    for _ in range(3):
        sent_by(source, daemon, log_changes=10, limit_commands=0)
    daemon.clients.append(FakeClient(1700, 1589, UUID, 9))
    # The logs saw it (`NEW CLIENT`): ps at once.
    sent, r = sent_by(source, daemon, log_changes=11, limit_commands=0)
    assert sent == ["get_server_list", "ps", "get_server_status 1589"] and 1700 in {c.pid for c in r.clients}
    assert sent_by(source, daemon, log_changes=11, limit_commands=0)[0] == ["get_server_list", "ps"]
    assert sent_by(source, daemon, log_changes=11, limit_commands=0)[0] == ["get_server_list"]
    # Without the logs, NVML's MPS process list tells: a new PID there, ps again.
    nvml = {(0, 1647), (0, 1648), (0, 1649), (0, 1700)}
    other = make_source(daemon)
    for _ in range(2):
        sent_by(other, daemon, nvml=nvml)
    assert sent_by(other, daemon, nvml=nvml)[0] == ["get_server_list", "get_server_status 1589"]
    daemon.clients.append(FakeClient(1701, 1589, UUID, 10))
    sent, r = sent_by(other, daemon, nvml=nvml | {(0, 1701)})
    assert "ps" in sent and 1701 in {c.pid for c in r.clients}
    # A client that leaves changes the server list or the logs or NVML too: each one alone re-reads.
    daemon.clients = [c for c in daemon.clients if c.pid != 1701]
    sent, r = sent_by(other, daemon, nvml=nvml)
    assert "ps" in sent and 1701 not in {c.pid for c in r.clients}


def test_a_new_server_in_the_list_is_read_whatever_the_signals_say():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon)
    for _ in range(3):
        sent_by(source, daemon, log_changes=1, limit_commands=0)
    daemon.servers.append(FakeServer(2521, status="INITIALIZING"))
    sent, r = sent_by(source, daemon, log_changes=1, limit_commands=0)
    assert "ps" in sent and "get_server_status 2521" in sent
    assert {(s.pid, s.status) for s in r.servers} == {(1589, "ACTIVE"), (2521, "INITIALIZING")}
    # A server not ACTIVE is asked every time until it is.
    assert "get_server_status 2521" in sent_by(source, daemon, log_changes=1, limit_commands=0)[0]
    daemon.servers[1].status = "ACTIVE"
    sent_by(source, daemon, log_changes=1, limit_commands=0)
    assert sent_by(source, daemon, log_changes=1, limit_commands=0)[0] == ["get_server_list"]


def test_without_any_signal_every_read_sends_ps_and_status():
    daemon = FakeControlDaemon.busy_capture()
    source = make_source(daemon)
    source.read(devices=[0])
    for _ in range(2):
        assert sent_by(source, daemon)[0] == ["get_server_list", "ps", "get_server_status 1589"]


def test_a_ps_that_failed_is_sent_again_under_the_same_signals():
    daemon = FakeControlDaemon.busy_capture()
    garbled = []

    def runner(argv, stdin_text, env, timeout):
        rc, out = daemon(argv, stdin_text, env, timeout)
        return (rc, "garbage\n") if stdin_text == "ps\n" and garbled and garbled.pop() else (rc, out)

    source = mc.DaemonReader(DaemonConfig("default", "/p", "/l"), mc.ControlClient("/p", runner=runner))
    sent_by(source, daemon, log_changes=1, limit_commands=0)
    daemon.clients.append(FakeClient(1700, 1589, UUID, 9))
    garbled.append(True)
    _, r = sent_by(source, daemon, log_changes=1, limit_commands=0)  # the confirming ps fails
    assert r.error and "ps header" in r.error
    sent, r = sent_by(source, daemon, log_changes=1, limit_commands=0)
    assert "ps" in sent and r.error is None and 1700 in {c.pid for c in r.clients}


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
    source = mc.DaemonReader(DaemonConfig("default", "/p", "/l"), mc.ControlClient("/p", timeout=0.01, runner=daemon))
    r = source.read(devices=[0])
    assert not r.up and "did not answer" in r.error


def test_missing_binary_is_an_error():
    client = mc.ControlClient("/p", binary="/nonexistent/nvidia-cuda-mps-control")
    r = mc.DaemonReader(DaemonConfig("default", "/p", "/l"), client).read(devices=[0])
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


# ------------------------------------------------------------ a control binary that misbehaves (issue 26)

def control_program(tmp_path, body: str):
    """A stand-in nvidia-cuda-mps-control: a shell script."""
    wrapper = tmp_path / "nvidia-cuda-mps-control"
    wrapper.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_detached_child_holding_the_output_costs_no_scrape(tmp_path):
    import os
    import time

    pidfile = tmp_path / "orphan"
    binary = control_program(tmp_path, f"""
        read cmd
        echo 713
        setsid sh -c 'echo $$ > {pidfile}; exec sleep 30' &
        exit 0
    """)
    client = mc.ControlClient("/p", binary=binary, timeout=5.0)
    try:
        for _ in range(3):  # every read, not only the first
            started = time.monotonic()
            assert mc.parse_pid_list(client.run("get_server_list")) == [713]
            assert time.monotonic() - started < 1.0  # not the 5 s deadline
    finally:
        for _ in range(50):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.02)
        for line in pidfile.read_text().split():
            try:
                os.kill(int(line), 9)
            except ProcessLookupError:
                pass


def test_an_answer_over_the_cap_is_one_failed_read(tmp_path):
    import time

    binary = control_program(tmp_path, f"""
        read cmd
        exec {sys.executable} -c "import sys; sys.stdout.write('1234567\\\\n' * 1_430_000)"
    """)
    client = mc.ControlClient("/p", binary=binary, timeout=5.0)
    started = time.monotonic()
    with pytest.raises(mc.ControlError, match="more than 1048576 bytes"):
        client.run("get_server_list")
    assert time.monotonic() - started < 3.0


def test_an_absurd_number_of_servers_or_clients_is_not_believed():
    with pytest.raises(mc.ControlError, match="not believed"):
        mc.parse_pid_list("\n".join(str(1000 + i) for i in range(mc.MAX_LISTED + 1)))
    assert len(mc.parse_pid_list("\n".join(str(1000 + i) for i in range(mc.MAX_LISTED)))) == mc.MAX_LISTED
    rows = "\n".join(f"{1000 + i} 1 713 0 4026531836 app" for i in range(mc.MAX_LISTED + 1))
    with pytest.raises(mc.ControlError, match="not believed"):
        mc.parse_ps("PID ID SERVER DEVICE NAMESPACE COMMAND\n" + rows)


def test_a_child_that_closes_its_output_but_goes_on_running_is_killed_at_the_deadline(tmp_path):
    binary = control_program(tmp_path, """
        read cmd
        exec 1>&- 2>&-
        sleep 30
    """)
    client = mc.ControlClient("/p", binary=binary, timeout=0.5)
    with pytest.raises(mc.ControlError, match="did not exit within 0.5s"):
        client.run("get_server_list")
