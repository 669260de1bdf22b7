"""Issue 30's synthetic parts: what only shows with two GPUs on one node, through the
whole collector (fakes at the library boundary: pynvml, the control subprocess, /proc,
the MPS logs) down to the exposition the dashboards and alerts read.

The live run on a machine with two GPUs (tests/gpu/multi_gpu_phase.py) checks the same
behaviour against what MPS enforces; these tests hold the exporter's side of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mps_exporter.config import DEVICE_PLUGIN, Config, DiscoveryRoot
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer
from tests.fakes.fake_procfs import FakeProcess as ProcProcess, write_proc
from tests.fakes.fake_pynvml import FakeNvml
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.support import scenarios
from tests.support.golden import exposition
from tests.support.lines import series, value

GIB = 1 << 30


# ---------------------------------------------------------------- limits across remapped devices
def remapped_limits_scenario(tmp_path) -> scenarios.Scenario:
    """Two GPUs, one server (4000) on both, three clients per GPU (GPU 0: 10000-10002,
    GPU 1: 10003-10005), the issue's remapped settings in their environments:

    - 10000 sees both GPUs and sets `0=2G,1=4G`; it holds memory on both;
    - 10001 sees `1,0` (physical GPU 1 is its device 0), sets `0=2G`, holds memory on both;
    - 10003 sees `CUDA_VISIBLE_DEVICES=1` and sets `0=2G`;
    - 10004 sees GPU 1 by its UUID and sets `0=2G`;
    - 10005 sees only GPU 1 and sets `1=4G`: its device 1 does not exist, CUDA drops it all."""
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    gpu0, gpu1 = scen.nvml.gpus
    for pid in (10000, 10001):  # on both GPUs
        gpu1.mps_processes.append(NvmlProcess(pid, 256 << 20))
        gpu1.compute_processes.append(NvmlProcess(pid, 256 << 20))
    envs = {
        10000: {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"},
        10001: {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10003: {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10004: {"CUDA_VISIBLE_DEVICES": gpu1.uuid, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10005: {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=4G"},
    }
    write_proc(scen.proc_root, [ProcProcess(pid, uid=1000 + pid % 7, environ=env) for pid, env in envs.items()])
    return scen


def test_a_limit_keyed_by_the_clients_device_0_binds_the_physical_gpu_it_sees(tmp_path):
    scen = remapped_limits_scenario(tmp_path)
    text = exposition(scen.collector())
    uuid1 = scen.nvml.gpus[1].uuid
    limit = "mps_client_pinned_memory_limit_bytes"
    for pid in ("10003", "10004"):  # CUDA_VISIBLE_DEVICES=1 and =GPU-<uuid of 1>: 2 GiB on GPU 1, none on 0
        assert value(text, limit, pid=pid, gpu="1") == 2 * GIB, pid
        assert series(text, limit, pid=pid, gpu="0") == [], pid
        assert value(text, "mps_client_memory_used_bytes", pid=pid, gpu="1", uuid=uuid1) > 0
        assert series(text, "mps_client_limit_source", pid=pid, pinned_memory="client") != []
    # `1,0`: its device 0 is physical GPU 1; on GPU 0 (its device 1) it set nothing.
    assert value(text, limit, pid="10001", gpu="1") == 2 * GIB
    assert series(text, limit, pid="10001", gpu="0") == []
    assert len(series(text, "mps_client_memory_used_bytes", pid="10001")) == 2


def test_a_client_seeing_both_gpus_gets_each_its_own_limit(tmp_path):
    text = exposition(remapped_limits_scenario(tmp_path).collector())
    limit = "mps_client_pinned_memory_limit_bytes"
    assert value(text, limit, pid="10000", gpu="0") == 2 * GIB
    assert value(text, limit, pid="10000", gpu="1") == 4 * GIB
    assert len(series(text, "mps_client_memory_used_bytes", pid="10000")) == 2
    assert series(text, "mps_client_limit_ignored", pid="10000") == []


def test_an_entry_naming_a_device_the_client_cannot_see_binds_no_limit(tmp_path):
    text = exposition(remapped_limits_scenario(tmp_path).collector())
    (ignored,) = series(text, "mps_client_limit_ignored", pid="10005")
    assert 'limit="pinned_memory"' in ignored and 'reason="invisible_device"' in ignored
    assert series(text, "mps_client_limit_source", pid="10005", pinned_memory="none") != []
    assert series(text, "mps_client_pinned_memory_limit_bytes", pid="10005") == []
    assert value(text, "mps_client_memory_used_bytes", pid="10005", gpu="1") > 0  # it runs, unlimited


# ---------------------------------------------------------------- one daemon per GPU, 48 clients each
MAX_CLIENTS_REFUSAL = "Failed to accept new client. Maximum number of clients (48) reached."


def server_log(server: int, uuid: str, admitted: list, refused: list, refusal: str = MAX_CLIENTS_REFUSAL) -> str:
    """server.log of one server as MPS 13000 writes it (line shapes copied from
    tests/data/captures/h100-edges/server.log): `admitted` clients connect, then each of
    `refused` is refused at the 48-client cap."""
    def line(second: float, text: str) -> str:
        return f"[2026-11-25 10:00:{second:06.3f} Server  {server}] {text}\n"
    device = f"Device NVIDIA H100 80GB HBM3 (uuid {uuid}) is associated"
    out = [f"[2026-11-25 10:00:01.000 Other  {server}] Startup\n",
           line(2, "Creating server context on device 0 (NVIDIA H100 80GB HBM3)"),
           line(2, "CUDA MPS Server for Linux/Unix. Binary version: 13000"),
           line(2, "Server has started")]
    for k, pid in enumerate(admitted + refused):
        t = 3 + k * 0.01
        out += [line(t, f"Received new client request for {{PID: {pid}, Context ID: 0}}"),
                line(t, f"Client {{PID: {pid}, Context ID: 0}} connected"),
                line(t, f"Creating worker thread for client {{PID: {pid}, Context ID: 0}}"),
                line(t, device)]
        if pid not in refused:
            out.append(line(t, f"Status of client {{PID: {pid}, Context ID: 0}} is ACTIVE"))
        if pid in refused:
            out += [line(t, refusal),
                    line(t, f"Client process {pid} disconnected")]
    return "".join(out)


def control_log(pipe: Path, server: int, clients: list) -> str:
    """control.log of a daemon that started `server` for `clients` (shapes from the same capture)."""
    head = "[2026-11-25 10:00:00.000 Control  1000] "
    out = [f"{head}Starting control daemon using socket {pipe}/control\n",
           f"{head}To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}\n",
           f"{head}NEW CLIENT {clients[0]} from user 0: Server is not ready, push client to pending list\n",
           f"[2026-11-25 10:00:00.500 Control  {server}] Starting new server {server} for user 0\n",
           f"[2026-11-25 10:00:02.000 Control  1000] NEW SERVER {server}: Ready\n"]
    out += [f"[2026-11-25 10:00:02.500 Control  1000] NEW CLIENT {pid} from user 0: Server already exists\n"
            for pid in clients[1:]]
    return "".join(out)


def test_one_daemon_per_gpu_under_the_device_plugin_48_clients_each_the_49th_refused(tmp_path):
    """Two device-plugin resources, each a control daemon with CUDA_VISIBLE_DEVICES set to
    one GPU and its own pipe and log directories: discovery finds both, each daemon lists
    its own server and 48 clients, and the 49th client of GPU 1 is refused and counted.

    MPS's refusal line names no device (`Failed to accept new client. Maximum number of
    clients (48) reached.`, written by the server): the exporter counts it on the daemon,
    which under this layout is the GPU. (The line before it, `Device ... (uuid ...) is
    associated`, does name the GPU; the exporter does not use it.)"""
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=48)
    servers = {0: 4000, 1: 4100}
    gpu1 = nvml.gpus[1]
    gpu1.compute_processes[0].pid = servers[1]  # each daemon's own server, on its GPU only
    gpu1.sm_util_by_pid = {servers[1]: gpu1.sm_util_by_pid.pop(4000)}
    root = tmp_path / "run-nvidia-mps"
    fakes = FakeDaemons()
    resources = {0: "nvidia.com/mps-gpu0", 1: "nvidia.com/mps-gpu1"}
    refused = 19999
    for index, resource in resources.items():
        gpu, server = nvml.gpus[index], servers[index]
        directory = root / resource
        (directory / "pipe").mkdir(parents=True)
        (directory / "pipe" / "control").touch()
        (directory / "log").mkdir()
        clients = [p.pid for p in gpu.mps_processes]
        (directory / "log" / "control.log").write_text(control_log(directory / "pipe", server, clients))
        (directory / "log" / "server.log").write_text(
            server_log(server, gpu.uuid, clients, [refused] if index == 1 else []))
        fakes.by_pipe[str(directory / "pipe")] = FakeControlDaemon(
            servers=[FakeServer(server)], clients=[FakeClient(pid, server, gpu.uuid, k) for k, pid in enumerate(clients)])
    cfg = Config()
    cfg.discover = [DiscoveryRoot(DEVICE_PLUGIN, str(root))]
    cfg.daemons = []
    cfg.procfs = str(write_proc(tmp_path / "proc", [ProcProcess(4000, comm="nvidia-cuda-mps"),
                                                     ProcProcess(4100, comm="nvidia-cuda-mps")]))
    cfg.runtime_roots = ()
    cfg.collectors["dcgm"] = False
    cfg.log_timezone = "UTC"
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=fakes, nvml_wait_for_every_answer=True))
    readers["logs"].catch_up()
    text = exposition(build_collector(cfg, readers))

    for index, resource in resources.items():
        d, server, uuid = {"daemon": resource}, str(servers[index]), nvml.gpus[index].uuid
        assert value(text, "mps_control_daemon_up", **d) == 1
        assert [line.split('server_pid="')[1].split('"')[0] for line in series(text, "mps_server_info", **d)] == [server]
        assert value(text, "mps_server_clients", **d, server_pid=server) == 48
        # The server's memory on its own GPU only; every client on its own daemon and GPU.
        assert [line.split('gpu="')[1][0] for line in series(text, "mps_server_memory_used_bytes", **d)] == [str(index)]
        infos = series(text, "mps_client_info", **d)
        assert len(infos) == 48 and all(f'server_pid="{server}"' in line for line in infos)
        used = series(text, "mps_client_memory_used_bytes", **d)
        assert len(used) == 48 and all(f'uuid="{uuid}"' in line for line in used)
        assert value(text, "mps_client_connections_total", **d) == 48 + (index == 1)
    assert len(series(text, "mps_client_info")) == 96
    assert value(text, "mps_client_rejections_total", daemon=resources[1], reason="client_limit") == 1
    assert value(text, "mps_client_rejections_total", daemon=resources[0], reason="client_limit") == 0
    assert value(text, "mps_server_client_limit", daemon=resources[1]) == 48
    assert series(text, "mps_server_client_limit", daemon=resources[0]) == []


# ---------------------------------------------------------------- daemons that see some GPUs (issue 38)
def per_gpu_daemons(tmp_path, visible: dict, daemons: dict, environs: dict, server_logs: dict = None,
                    killed: bool = False):
    """Two GPUs, one control daemon per GPU in the device plugin's layout, each started with
    CUDA_VISIBLE_DEVICES=`visible[index]` (its process in /proc says so, as the daemon's own
    environment does on a node), answering as `daemons[index]` (a FakeControlDaemon whose
    server and clients are filled in here); clients' environments from `environs`;
    `server_logs[index]`: that daemon's server.log (none: empty logs); `killed`: GPU 1's server
    is gone from NVML and /proc. The exposition."""
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=3)
    servers = {0: 4000, 1: 4100}
    gpu1 = nvml.gpus[1]
    gpu1.compute_processes[0].pid = servers[1]
    gpu1.sm_util_by_pid = {servers[1]: gpu1.sm_util_by_pid.pop(4000)}
    root = tmp_path / "run-nvidia-mps"
    fakes = FakeDaemons()
    processes = [ProcProcess(pid, environ=env) for pid, env in environs.items()]
    processes += [ProcProcess(s, comm="nvidia-cuda-mps") for s in servers.values() if not (killed and s == servers[1])]
    if killed:
        gpu1.compute_processes = [p for p in gpu1.compute_processes if p.pid != servers[1]]
    for index, daemon in daemons.items():
        gpu, server = nvml.gpus[index], servers[index]
        directory = root / f"nvidia.com/mps-gpu{index}"
        (directory / "pipe").mkdir(parents=True)
        (directory / "pipe" / "control").touch()
        (directory / "log").mkdir()
        daemon.pid = 900 + index
        (directory / "pipe" / "nvidia-cuda-mps-control.pid").write_text(f"{daemon.pid}\n")
        clients = [p.pid for p in gpu.mps_processes]
        if server_logs and index in server_logs:
            (directory / "log" / "control.log").write_text(control_log(directory / "pipe", server, clients))
            (directory / "log" / "server.log").write_text(server_logs[index])
        daemon.servers[0].pid = server
        daemon.clients = [FakeClient(pid, server, gpu.uuid, k) for k, pid in enumerate(clients)]
        fakes.by_pipe[str(directory / "pipe")] = daemon
        processes.append(ProcProcess(daemon.pid, comm="nvidia-cuda-mps", environ={
            "CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_VISIBLE_DEVICES": visible[index]}))
    proc = write_proc(tmp_path / "proc", processes)
    for daemon in daemons.values():
        (proc / str(daemon.pid) / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-d\0")
        (proc / str(daemon.pid) / "root").symlink_to("/")
    cfg = Config()
    cfg.discover = [DiscoveryRoot(DEVICE_PLUGIN, str(root))]
    cfg.daemons = []
    cfg.procfs = str(proc)
    cfg.runtime_roots = ()
    cfg.collectors["dcgm"] = False
    cfg.log_timezone = "UTC"
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=fakes, nvml_wait_for_every_answer=True))
    readers["logs"].catch_up()
    return nvml, exposition(build_collector(cfg, readers))


def limits_by_gpu(text: str, name: str, **labels: str) -> dict:
    return {line.split('gpu="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in series(text, name, **labels)}


@pytest.mark.parametrize("by", ["index", "uuid"])
def test_limits_of_a_daemon_started_on_gpu_1_land_on_gpu_1(tmp_path, by):
    """NVIDIA's MPS guide, the device plugin's resources and Slurm's prolog start a daemon
    with CUDA_VISIBLE_DEVICES; it and its clients count devices from its own list. The GPU 1
    daemon's `set_default_device_pinned_mem_limit 0 3G` bound clients on GPU 1 (issue 38):
    the default, the server's limit and what its clients inherit or set themselves (`0=2G`
    with no CUDA_VISIBLE_DEVICES of their own, `0=1G` with CUDA_VISIBLE_DEVICES=0) are on
    physical GPU 1, none on GPU 0."""
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    visible = {0: "0", 1: "1" if by == "index" else uuid1}
    daemons = {0: FakeControlDaemon(servers=[FakeServer(0)]),
               1: FakeControlDaemon(servers=[FakeServer(0, pinned_limits={0: "3G"})], default_pinned_limits={0: "3G"})}
    environs = {10004: {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"},
                10005: {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}}
    _, text = per_gpu_daemons(tmp_path, visible, daemons, environs)
    d1 = {"daemon": "nvidia.com/mps-gpu1"}
    assert limits_by_gpu(text, "mps_default_pinned_memory_limit_bytes", **d1) == {"1": 3 * GIB}
    assert limits_by_gpu(text, "mps_server_pinned_memory_limit_bytes", **d1, server_pid="4100") == {"1": 3 * GIB}
    assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1, pid="10003") == {"1": 3 * GIB}
    assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1, pid="10004") == {"1": 1 * GIB}
    assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1, pid="10005") == {"1": 2 * GIB}
    assert series(text, "mps_client_limit_ignored", **d1) == []
    # GPU 0's daemon has no limit anywhere.
    assert limits_by_gpu(text, "mps_default_pinned_memory_limit_bytes", daemon="nvidia.com/mps-gpu0") == {}


def test_a_client_of_the_gpu_1_daemon_naming_device_1_binds_nothing(tmp_path):
    """Under a daemon that sees one GPU there is no device 1: CUDA drops the whole setting."""
    daemons = {1: FakeControlDaemon(servers=[FakeServer(0)])}
    _, text = per_gpu_daemons(tmp_path, {1: "1"}, daemons, {10005: {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=2G"}})
    d1 = {"daemon": "nvidia.com/mps-gpu1", "pid": "10005"}
    assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1) == {}
    assert len(series(text, "mps_client_limit_ignored", **d1, reason="invisible_device")) == 1


def test_a_default_set_by_uuid_as_the_dra_driver_sets_it(tmp_path):
    """`set_default_device_pinned_mem_limit GPU-<uuid> 2048M` (the DRA driver's template): MPS
    answers it only asked by UUID (its server's limit both ways), and its server logs `... for device GPU-<uuid> set to
    0x80000000 bytes`. The default, the server's limit and the client's inherited limit
    (from the server's limits at its connection) are 2 GiB on the GPU of that UUID."""
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    daemons = {1: FakeControlDaemon(servers=[FakeServer(0, pinned_limits={0: "2G", uuid1: "2G"})],
                                    default_pinned_limits={uuid1: "2048M"})}
    log = server_log(4100, uuid1, [10003, 10004, 10005], []).splitlines(keepends=True)
    log[3:3] = ["[2026-11-25 10:00:02.000 Server  4100] activeThreadsPercentage set to 100.0\n",
                f"[2026-11-25 10:00:02.000 Server  4100] Device pinned memory limit for device {uuid1} "
                f"set to 0x80000000 bytes\n"]
    _, text = per_gpu_daemons(tmp_path, {1: uuid1}, daemons, {}, server_logs={1: "".join(log)})
    d1 = {"daemon": "nvidia.com/mps-gpu1"}
    assert limits_by_gpu(text, "mps_default_pinned_memory_limit_bytes", **d1) == {"1": 2 * GIB}
    assert limits_by_gpu(text, "mps_server_pinned_memory_limit_bytes", **d1) == {"1": 2 * GIB}
    for pid in ("10003", "10004", "10005"):
        assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1, pid=pid) == {"1": 2 * GIB}
        (source,) = series(text, "mps_client_limit_source", **d1, pid=pid)
        assert 'pinned_memory="server_at_connect"' in source
    assert value(text, "mps_log_unrecognized_lines_total", **d1, file="server") == 0


def test_a_limit_the_daemon_answers_rounded_down_is_published_as_server_log_wrote_it(tmp_path):
    """A default of 1536M binds 1.5 GiB; the daemon answers `1G` for it, its server's
    server.log says `0x60000000 bytes` (H200, driver 580;
    tests/gpu/reports/2026-11-29-h200-pinned-1536M). The server's limit and what its
    clients inherit are 1.5 GiB; a logged limit the answer is not the rounding of (4G
    under `1G`) is not taken. The daemon's default has no server.log: `1G` still."""
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    log = server_log(4100, uuid1, [10003, 10004], []).splitlines(keepends=True)
    for logged, served in ((0x60000000, 1536 << 20), (4 << 30, 1 << 30)):
        limit_line = f"[2026-11-25 10:00:02.000 Server  4100] Device pinned memory limit for device 0 set to {logged:#x} bytes\n"
        daemons = {1: FakeControlDaemon(servers=[FakeServer(0, pinned_limits={0: "1G", uuid1: "1G"})],
                                        default_pinned_limits={0: "1G"})}
        _, text = per_gpu_daemons(tmp_path / hex(logged), {1: "1"}, daemons, {},
                                  server_logs={1: "".join(log[:3] + [limit_line] + log[3:])})
        d1 = {"daemon": "nvidia.com/mps-gpu1"}
        assert limits_by_gpu(text, "mps_server_pinned_memory_limit_bytes", **d1) == {"1": served}
        assert limits_by_gpu(text, "mps_default_pinned_memory_limit_bytes", **d1) == {"1": 1 << 30}
        for pid in ("10003", "10004"):
            assert limits_by_gpu(text, "mps_client_pinned_memory_limit_bytes", **d1, pid=pid) == {"1": served}


def test_a_killed_daemon_takes_its_servers_and_clients_with_it(tmp_path):
    """`kill -9` of a daemon and its server (what deleting a device-plugin daemon pod does):
    control.log says nothing, the directory stays, the control program finds no daemon. The
    server the logs still call running is gone from /proc and NVML, so from /metrics too."""
    daemons = {1: FakeControlDaemon(servers=[FakeServer(0)], running=False)}
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    nvml, text = per_gpu_daemons(tmp_path, {1: "1"}, daemons, {},
                                 server_logs={1: server_log(4100, uuid1, [10003], [])}, killed=True)
    d1 = {"daemon": "nvidia.com/mps-gpu1"}
    assert value(text, "mps_control_daemon_up", **d1) == 0
    assert series(text, "mps_server_info", **d1) == []
    # Its clients outlive it and NVML still lists them (run x2-issue38-killdaemon): no daemon's.
    assert nvml.gpus[1].mps_processes and series(text, "mps_client_info") == []


def test_a_daemon_down_whose_server_still_runs_keeps_it(tmp_path):
    """The control daemon gone but its server alive (NVML lists it on its GPU): still shown."""
    daemons = {1: FakeControlDaemon(servers=[FakeServer(0)], running=False)}
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    _, text = per_gpu_daemons(tmp_path, {1: "1"}, daemons, {}, server_logs={1: server_log(4100, uuid1, [10003], [])})
    assert len(series(text, "mps_server_info", daemon="nvidia.com/mps-gpu1", server_pid="4100")) == 1


def test_the_ceiling_mps_enforced_for_clients_with_raised_device_connections(tmp_path):
    """Clients with CUDA_DEVICE_MAX_CONNECTIONS=8: MPS admitted 15 and refused the rest with
    `Reached maximum number of device connections.` (2 x H100, issue 38), a line with no
    number: the ceiling published is the count admitted when it refused."""
    uuid1 = FakeNvml.synthetic(gpus=2, clients_per_gpu=0).gpus[1].uuid
    admitted, refused = list(range(20000, 20015)), [20015, 20016]
    log = server_log(4100, uuid1, admitted, refused,
                     refusal="Failed to accept new client. Reached maximum number of device connections.")
    _, text = per_gpu_daemons(tmp_path, {1: "1"}, {1: FakeControlDaemon(servers=[FakeServer(0)])}, {},
                              server_logs={1: log})
    d1 = {"daemon": "nvidia.com/mps-gpu1"}
    assert value(text, "mps_server_client_limit", **d1) == 15
    assert value(text, "mps_client_rejections_total", **d1, reason="client_limit") == 2
    assert value(text, "mps_log_unrecognized_lines_total", **d1, file="server") == 0
