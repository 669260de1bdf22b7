"""Issue 41, done-when 1: a fake host with a control daemon started in each layout the issue
lists (ECS's systemd unit, GKE, Bottlerocket's host unit, a Slurm prolog's per-job daemon,
a plain Docker container, NVIDIA's device plugin and DRA driver), each found once with its
directories, its multi-user flag and its devices; and a daemon started later, at a pipe
directory no flag names, found and served after exactly one re-scan (injected clock)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mps_exporter.config import DEVICE_PLUGIN, DRA, Config, DiscoveryRoot
from mps_exporter.discovery import DaemonSet, is_multiuser, scan_processes
from mps_exporter.sources.base import Backends
from mps_exporter.sources.control import ControlClient, DaemonReader
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer
from tests.fakes.fake_procfs import FakeProcess, write_proc
from tests.support.golden import exposition

CLAIM = "0b7e1d52-3c2a-4f8e-9a51-6d0f3e2b1c47"
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
BOTTLEROCKET = "/run/nvidia/mps/nvidia.com/gpu.shared"


@dataclass
class Layout:
    pid: int
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    container: Optional[str] = None  # None: the daemon runs in the host's root
    # what the exporter must find: the daemon's own pipe and log paths (reached through
    # /proc/PID/root), -M / --multiuser-server, CUDA_VISIBLE_DEVICES
    pipe: str = "/tmp/nvidia-mps"
    log: str = "/var/log/nvidia-mps"
    multiuser: bool = False
    devices: Optional[str] = None


LAYOUTS: Dict[str, Layout] = {
    # Amazon ECS GPU AMI: systemd's nvidia-mps.service (amazon-ecs-ami #744, #771), logs in
    # MPS's default directory.
    "ecs": Layout(101, ["/usr/bin/nvidia-cuda-mps-control", "-f", "--multiuser-server"],
                  {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps-ecs"}, pipe="/run/mps-ecs", multiuser=True),
    # GKE: its daemon in a container that bind-mounts the host's /tmp/nvidia-mps.
    "gke": Layout(202, ["nvidia-cuda-mps-control", "-f"], container="gke"),
    # Bottlerocket: the device plugin's daemon as a host systemd unit.
    "bottlerocket": Layout(303, ["nvidia-cuda-mps-control", "-d"],
                           {"CUDA_MPS_PIPE_DIRECTORY": f"{BOTTLEROCKET}/pipe",
                            "CUDA_MPS_LOG_DIRECTORY": f"{BOTTLEROCKET}/log"},
                           pipe=f"{BOTTLEROCKET}/pipe", log=f"{BOTTLEROCKET}/log"),
    # Slurm: a site prolog's daemon for job 42's GPUs.
    "slurm": Layout(404, ["nvidia-cuda-mps-control", "-d", "-M"],
                    {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-job-42", "CUDA_MPS_LOG_DIRECTORY": "/var/log/slurm-mps-42",
                     "CUDA_VISIBLE_DEVICES": "2,3"},
                    pipe="/tmp/mps-job-42", log="/var/log/slurm-mps-42", multiuser=True, devices="2,3"),
    # Plain Docker: `docker run ... nvidia-cuda-mps-control -f` with MPS's defaults, in the
    # container's own file system (no bind mount): only its /proc/PID/root reaches them.
    "docker": Layout(505, ["nvidia-cuda-mps-control", "-f"], container="docker"),
    # NVIDIA's device plugin: /run/nvidia/mps mounted at /mps in its daemon's container.
    "device-plugin": Layout(606, ["nvidia-cuda-mps-control", "-d"],
                            {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
                             "CUDA_MPS_LOG_DIRECTORY": "/mps/nvidia.com/gpu/log"},
                            container="device-plugin", pipe="/mps/nvidia.com/gpu/pipe", log="/mps/nvidia.com/gpu/log"),
    # NVIDIA's DRA driver: the claim's directories at MPS's defaults in its daemon's pod.
    "dra": Layout(707, ["nvidia-cuda-mps-control", "-f"], {"CUDA_VISIBLE_DEVICES": UUID}, container="dra",
                  devices=UUID),
}


@dataclass
class Host:
    tmp: Path
    proc: Path
    plugins: Path
    mps_root: Path

    def through(self, pid: int, path: str) -> str:
        return f"{self.proc}/{pid}/root/{path.lstrip('/')}"

    def start(self, pid: int, argv: List[str], env: Dict[str, str], root: Path, ticks: int = 1000) -> None:
        """A control daemon process appears in /proc."""
        write_proc(self.proc, [FakeProcess(pid, comm="nvidia-cuda-mps", environ=env, start_ticks=ticks)])
        (self.proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (self.proc / str(pid) / "root").symlink_to(root)


def pipe_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "control").touch()  # a FIFO on a real node
    return path


def build_host(tmp: Path) -> Host:
    root = tmp / "host"
    for d in ("run/mps-ecs", "tmp/nvidia-mps", f"{BOTTLEROCKET.lstrip('/')}/pipe", "tmp/mps-job-42"):
        pipe_dir(root / d)
    for d in ("var/log/nvidia-mps", f"{BOTTLEROCKET.lstrip('/')}/log", "var/log/slurm-mps-42"):
        (root / d).mkdir(parents=True, exist_ok=True)
    plugins, mps_root = tmp / "plugins", tmp / "run-nvidia-mps"
    claim = plugins / "gpu.nvidia.com" / "mps" / f"{CLAIM}-a1b2c"
    pipe_dir(claim / "pipe")
    (claim / "log").mkdir()
    pipe_dir(mps_root / "nvidia.com" / "gpu" / "pipe")
    (mps_root / "nvidia.com" / "gpu" / "log").mkdir()

    def container(name: str, mounts: Dict[str, Path], own: Tuple[str, ...] = ()) -> Path:
        croot = tmp / "containers" / name
        for inside, target in mounts.items():
            (croot / inside.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (croot / inside.lstrip("/")).symlink_to(target)  # a bind mount of the host's directory
        for d in own:  # the container's own directories
            pipe_dir(croot / d.lstrip("/")) if d.startswith("/tmp") else (croot / d.lstrip("/")).mkdir(parents=True)
        return croot

    roots = {
        "gke": container("gke", {"/tmp/nvidia-mps": root / "tmp/nvidia-mps",
                                 "/var/log/nvidia-mps": root / "var/log/nvidia-mps"}),
        "docker": container("docker", {}, own=("/tmp/nvidia-mps", "/var/log/nvidia-mps")),
        "device-plugin": container("device-plugin", {"/mps": mps_root}),
        "dra": container("dra", {"/tmp/nvidia-mps": claim / "pipe", "/var/log/nvidia-mps": claim / "log"}),
    }
    proc = write_proc(tmp / "proc", [FakeProcess(1, comm="systemd")])
    (proc / "1" / "cmdline").write_bytes(b"/sbin/init\0")
    (proc / "1" / "root").symlink_to(root)
    host = Host(tmp, proc, plugins, mps_root)
    for layout in LAYOUTS.values():
        host.start(layout.pid, layout.argv, layout.env, roots[layout.container] if layout.container else root)
    return host


def test_each_layouts_daemon_is_found_once_with_its_directories_flag_and_devices(tmp_path):
    h = build_host(tmp_path)
    found = scan_processes(str(h.proc))
    assert len(found) == len(LAYOUTS)  # once each
    by_pipe = {d.pipe_directory: d for d in found}
    for name, layout in LAYOUTS.items():
        d = by_pipe.get(h.through(layout.pid, layout.pipe))
        assert d is not None, name
        assert d.log_directory == h.through(layout.pid, layout.log), name
        argv = (h.proc / str(layout.pid) / "cmdline").read_bytes().decode().split("\0")[:-1]
        assert is_multiuser(argv) is layout.multiuser, name
        process = DaemonReader(d, ControlClient(d.pipe_directory, runner=FakeControlDaemon()),
                               proc_root=str(h.proc)).process()
        assert process is not None and (process.multiuser, process.visible_devices) == (
            layout.multiuser, layout.devices), name
    names = {d.pipe_directory: d.name for d in found}
    # Daemons in the host's root, and GKE's bind mount of the host's /tmp/nvidia-mps: named
    # by their path. Paths the host has elsewhere or not at all: named with their pid.
    assert names[h.through(101, "/run/mps-ecs")] == "/run/mps-ecs"
    assert names[h.through(202, "/tmp/nvidia-mps")] == "/tmp/nvidia-mps"
    assert names[h.through(303, f"{BOTTLEROCKET}/pipe")] == f"{BOTTLEROCKET}/pipe"
    assert names[h.through(404, "/tmp/mps-job-42")] == "/tmp/mps-job-42"
    assert names[h.through(505, "/tmp/nvidia-mps")] == "505:/tmp/nvidia-mps"
    assert names[h.through(606, "/mps/nvidia.com/gpu/pipe")] == "606:/mps/nvidia.com/gpu/pipe"
    assert names[h.through(707, "/tmp/nvidia-mps")] == "707:/tmp/nvidia-mps"


def test_the_layouts_and_the_processes_name_each_daemon_once(tmp_path):
    """With the DRA and device plugin roots configured, their daemons keep the layouts'
    names (claim, resource) and are not watched a second time as processes."""
    h = build_host(tmp_path)
    sets = DaemonSet([], [DiscoveryRoot(DRA, str(h.plugins)), DiscoveryRoot(DEVICE_PLUGIN, str(h.mps_root))],
                     processes=True, proc_root=str(h.proc))
    names = sorted(d.name for d in sets.current())
    assert names == sorted([f"{CLAIM}-a1b2c", "nvidia.com/gpu", "/run/mps-ecs", "/tmp/nvidia-mps",
                            f"{BOTTLEROCKET}/pipe", "/tmp/mps-job-42", "505:/tmp/nvidia-mps"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingSet(DaemonSet):
    scans = 0

    def rescan(self) -> None:  # type: ignore[override]
        self.scans += 1
        super().rescan()


def test_a_daemon_started_later_is_found_and_served_after_one_rescan(tmp_path):
    """A daemon at a pipe directory no flag names, started after the exporter: not seen
    before the next scan is due, found and its servers and clients served by the first
    collection after exactly one re-scan."""
    h = build_host(tmp_path)
    clock = Clock()
    sets = CountingSet([], interval=5.0, clock=clock, processes=True, proc_root=str(h.proc))
    late = h.tmp / "host" / "srv" / "mps-late"
    pipe_dir(late)
    late_pipe = h.through(808, "/srv/mps-late")
    fakes = FakeDaemons({h.through(layout.pid, layout.pipe): FakeControlDaemon() for layout in LAYOUTS.values()})
    fakes.by_pipe[late_pipe] = FakeControlDaemon(servers=[FakeServer(900)], clients=[FakeClient(901, 900, UUID)])
    cfg = Config()
    cfg.daemons = []
    cfg.procfs = str(h.proc)
    cfg.collectors.update(nvml=False, dcgm=False, proc=False, logs=False)
    # Every collection reads the daemons and waits for them: no background reads, no last
    # reading served while a read runs on.
    cfg.refresh_interval = cfg.control_wait = 0.0
    readers = build_readers(cfg, Backends(control_runner=fakes, daemon_set=sets))
    collector = build_collector(cfg, readers, bounded=False)
    try:
        before = exposition(collector)
        assert sets.scans == 1 and 'daemon="/srv/mps-late"' not in before
        h.start(808, ["nvidia-cuda-mps-control", "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "/srv/mps-late"},
                h.tmp / "host", ticks=5000)
        clock.now = 4.9  # no scan due yet
        assert 'daemon="/srv/mps-late"' not in exposition(collector)
        assert sets.scans == 1
        clock.now = 5.0  # one re-scan
        after = exposition(collector)
        assert sets.scans == 2
    finally:
        for r in readers.values():
            r.close()
    assert 'mps_control_daemon_up{daemon="/srv/mps-late"} 1.0' in after
    assert any(line.startswith("mps_server_clients{") and 'daemon="/srv/mps-late"' in line and
               'server_pid="900"' in line and line.endswith(" 1.0") for line in after.splitlines())
    assert sum(c.startswith("get_server_list") for c in fakes.by_pipe[late_pipe].received) == 1
