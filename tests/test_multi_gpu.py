"""Issue 30's synthetic parts: what only shows with two GPUs on one node, through the
whole collector (fakes at the library boundary: pynvml, the control subprocess, /proc,
the MPS logs) down to the exposition the dashboards and alerts read.

The live run on a machine with two GPUs (tests/gpu/multi_gpu_phase.py) checks the same
behaviour against what MPS enforces; these tests hold the exporter's side of it.
"""

from __future__ import annotations

from pathlib import Path

from mps_exporter.config import DEVICE_PLUGIN, Config, DiscoveryRoot
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer
from tests.fakes.fake_procfs import FakeProcess as ProcProcess, write_proc
from tests.fakes.fake_pynvml import FakeNvml
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.support import scenarios
from tests.support.golden import exposition

GIB = 1 << 30


def series(text: str, name: str, **labels: str) -> list:
    """The sample lines of `name` carrying every one of `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [line for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line for w in wanted)]


def value(text: str, name: str, **labels: str) -> float:
    (line,) = series(text, name, **labels)
    return float(line.rsplit(" ", 1)[1])


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
def server_log(server: int, uuid: str, admitted: list, refused: list) -> str:
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
        if pid in refused:
            out += [line(t, "Failed to accept new client. Maximum number of clients (48) reached."),
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
    readers = build_readers(cfg, Backends(nvml_module=nvml, control_runner=fakes))
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
