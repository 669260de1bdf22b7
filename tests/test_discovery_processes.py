"""Discovery from the processes themselves (issue 41): every nvidia-cuda-mps-control
process of a fake host, in each layout that starts one, found once, with its directories
(through /proc/PID/root where it runs in a container) and its -M."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter import cli
from mps_exporter.collector import build_registry
from mps_exporter.config import DEVICE_PLUGIN, DRA, PROCESS, Config, DaemonConfig, DiscoveryRoot
from mps_exporter.discovery import COMM_RECHECK_SECONDS, DaemonSet, scan_processes
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer
from tests.fakes.fake_procfs import FakeProcess, write_proc

CLAIM = "0b7e1d52-3c2a-4f8e-9a51-6d0f3e2b1c47"
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"


@dataclass
class Daemon:
    pid: int
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    root: Optional[Path] = None  # None: the host's root


@dataclass
class FakeHost:
    """`host`: the host's file system as PID 1 sees it (not at the same paths as ours);
    `proc`: its /proc; `plugins`, `mps_root`: the DRA and device plugin roots as the
    exporter sees them (bind mounts of the host's)."""

    host: Path
    proc: Path
    plugins: Path
    mps_root: Path
    pids: Dict[str, int]

    def through(self, layout: str, path: str) -> str:
        """A daemon's own path, reached through its /proc/PID/root."""
        return f"{self.proc}/{self.pids[layout]}/root/{path.lstrip('/')}"


def mkdirs(*paths: Path) -> None:
    for p in paths:
        p.mkdir(parents=True, exist_ok=True)


def pipe_dir(path: Path) -> Path:
    mkdirs(path)
    (path / "control").touch()  # a FIFO on a real node
    return path


def fake_host(tmp: Path, ours: Path) -> FakeHost:
    """One node with a control daemon started in each known way, and the processes around
    them that are not daemons."""
    host, plugins, mps_root = tmp / "host", tmp / "plugins", tmp / "run-nvidia-mps"
    mkdirs(host / "var" / "log" / "nvidia-mps", host / "var" / "log" / "slurm-mps-42")
    pipe_dir(host / "run" / "mps-ecs")  # Amazon ECS: systemd's nvidia-mps.service
    pipe_dir(host / "tmp" / "nvidia-mps")  # GKE: the host's /tmp/nvidia-mps, in a container
    pipe_dir(host / "tmp" / "mps-job-42")  # a Slurm prolog's daemon, this job's GPUs
    claim = plugins / "gpu.nvidia.com" / "mps" / f"{CLAIM}-a1b2c"
    pipe_dir(claim / "pipe")
    mkdirs(claim / "log")
    gpu = mps_root / "nvidia.com" / "gpu"
    pipe_dir(gpu / "pipe")
    mkdirs(gpu / "log")
    pipe_dir(ours / "pipe")  # someone's daemon at a directory no flag names, seen at our paths too

    def container(name: str, mounts: Dict[str, Path]) -> Path:
        root = tmp / "containers" / name
        for inside, target in mounts.items():
            mkdirs((root / inside.lstrip("/")).parent)
            (root / inside.lstrip("/")).symlink_to(target)  # a bind mount of the host's directory
        return root

    gke = container("gke", {"/tmp/nvidia-mps": host / "tmp" / "nvidia-mps",
                            "/var/log/nvidia-mps": host / "var" / "log" / "nvidia-mps"})
    dra = container("dra", {"/tmp/nvidia-mps": claim / "pipe", "/var/log/nvidia-mps": claim / "log"})
    plugin = container("device-plugin", {"/mps": mps_root})
    daemons = {
        "ecs": Daemon(101, ["/usr/bin/nvidia-cuda-mps-control", "-f"], {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps-ecs"}),
        "gke": Daemon(202, ["nvidia-cuda-mps-control", "-f"], root=gke),
        "slurm": Daemon(303, ["nvidia-cuda-mps-control", "-d", "-M"],
                        {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-job-42", "CUDA_MPS_LOG_DIRECTORY": "/var/log/slurm-mps-42",
                         "CUDA_VISIBLE_DEVICES": "2,3"}),
        "dra": Daemon(404, ["nvidia-cuda-mps-control", "-f"], {"CUDA_VISIBLE_DEVICES": UUID}, root=dra),
        "device-plugin": Daemon(505, ["nvidia-cuda-mps-control", "-d"],
                                {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
                                 "CUDA_MPS_LOG_DIRECTORY": "/mps/nvidia.com/gpu/log"}, root=plugin),
        "ours": Daemon(606, ["nvidia-cuda-mps-control", "-d"], {"CUDA_MPS_PIPE_DIRECTORY": str(ours / "pipe"),
                                                                "CUDA_MPS_LOG_DIRECTORY": str(ours / "log")},
                       root=Path("/")),
    }
    procs = [FakeProcess(1, comm="systemd"), FakeProcess(700, comm="nvidia-cuda-mps"),
             FakeProcess(701, comm="nvidia-cuda-mps"), FakeProcess(702, comm="python3")]
    procs += [FakeProcess(d.pid, comm="nvidia-cuda-mps", environ=d.env) for d in daemons.values()]
    proc = write_proc(tmp / "proc", procs)
    (proc / "1" / "cmdline").write_bytes(b"/sbin/init\0")
    (proc / "1" / "root").symlink_to(host)
    (proc / "700" / "cmdline").write_bytes(b"nvidia-cuda-mps-server\0")  # a server: same comm, not a daemon
    (proc / "700" / "root").symlink_to(host)
    (proc / "701" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0")  # `echo ps | nvidia-cuda-mps-control`
    (proc / "701" / "root").symlink_to(host)
    (proc / "702" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-d\0")  # comm says not: never read
    (proc / "702" / "root").symlink_to(host)
    for d in daemons.values():
        (proc / str(d.pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in d.argv) + b"\0")
        (proc / str(d.pid) / "root").symlink_to(d.root or host)
    return FakeHost(host, proc, plugins, mps_root, {k: d.pid for k, d in daemons.items()})


def test_scan_finds_each_control_daemon_once_with_its_directories(tmp_path):
    ours = tmp_path / "srv-mps"
    h = fake_host(tmp_path, ours)
    found = {d.name: d for d in scan_processes(str(h.proc))}
    assert {n: (d.pipe_directory, d.log_directory) for n, d in found.items()} == {
        # the host sees these at the daemon's own path: named by it, reached through its root
        "/run/mps-ecs": (h.through("ecs", "/run/mps-ecs"), h.through("ecs", "/var/log/nvidia-mps")),
        "/tmp/nvidia-mps": (h.through("gke", "/tmp/nvidia-mps"), h.through("gke", "/var/log/nvidia-mps")),
        "/tmp/mps-job-42": (h.through("slurm", "/tmp/mps-job-42"), h.through("slurm", "/var/log/slurm-mps-42")),
        # the containers' own paths, which the host has elsewhere: named with the pid
        "404:/tmp/nvidia-mps": (h.through("dra", "/tmp/nvidia-mps"), h.through("dra", "/var/log/nvidia-mps")),
        "505:/mps/nvidia.com/gpu/pipe": (h.through("device-plugin", "/mps/nvidia.com/gpu/pipe"),
                                         h.through("device-plugin", "/mps/nvidia.com/gpu/log")),
        # a directory the exporter sees at the same path: that path, no /proc in between
        str(ours / "pipe"): (str(ours / "pipe"), str(ours / "log")),
    }
    assert {d.layout for d in found.values()} == {PROCESS}


def config(h: FakeHost, roots: List[DiscoveryRoot], static: List[DaemonConfig]) -> Config:
    cfg = Config()
    cfg.daemons = static
    cfg.discover = roots
    cfg.procfs = str(h.proc)
    cfg.collectors.update(nvml=False, dcgm=False, proc=False, logs=False)
    return cfg


def dump(cfg: Config, fakes: FakeDaemons) -> str:
    readers = build_readers(cfg, Backends(control_runner=fakes))
    try:
        return generate_latest(build_registry(build_collector(cfg, readers, bounded=False), process=False)).decode()
    finally:
        for r in readers.values():
            r.close()


def daemon_info(text: str) -> Dict[str, Dict[str, str]]:
    """daemon -> the labels of its mps_control_daemon_info."""
    out = {}
    for line in text.splitlines():
        if line.startswith("mps_control_daemon_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
            out[labels.pop("daemon")] = labels
    return out


def test_the_exporter_watches_every_daemon_once_named_as_the_layouts_name_it(tmp_path):
    """Done-when: each daemon of the fake host once, with its directories and -M; those
    the flags or layouts name keep that name (the default daemon at /tmp/nvidia-mps too)."""
    ours = tmp_path / "srv-mps"
    h = fake_host(tmp_path, ours)
    static = DaemonConfig("default", str(h.host / "tmp" / "nvidia-mps"), str(h.host / "var" / "log" / "nvidia-mps"))
    cfg = config(h, [DiscoveryRoot(DRA, str(h.plugins)), DiscoveryRoot(DEVICE_PLUGIN, str(h.mps_root))], [static])
    claim = h.plugins / "gpu.nvidia.com" / "mps" / f"{CLAIM}-a1b2c"
    gpu = h.mps_root / "nvidia.com" / "gpu"
    pipes = {"default": static.pipe_directory, f"{CLAIM}-a1b2c": str(claim / "pipe"),
             "nvidia.com/gpu": str(gpu / "pipe"), "/run/mps-ecs": h.through("ecs", "/run/mps-ecs"),
             "/tmp/mps-job-42": h.through("slurm", "/tmp/mps-job-42"), str(ours / "pipe"): str(ours / "pipe")}
    fakes = FakeDaemons({pipe: FakeControlDaemon(servers=[FakeServer(1000 + i)],
                                                 clients=[FakeClient(2000 + i, 1000 + i, UUID)])
                         for i, pipe in enumerate(pipes.values())})
    info = daemon_info(dump(cfg, fakes))
    assert {n: (i["pipe_directory"], i["multiuser"]) for n, i in info.items()} == {  # labels keep 128 characters
        "default": (pipes["default"][:128], "false"),  # GKE's daemon, in its container
        f"{CLAIM}-a1b2c": (pipes[f"{CLAIM}-a1b2c"][:128], "false"),
        "nvidia.com/gpu": (pipes["nvidia.com/gpu"][:128], "false"),
        "/run/mps-ecs": (pipes["/run/mps-ecs"][:128], "false"),
        "/tmp/mps-job-42": (pipes["/tmp/mps-job-42"][:128], "true"),  # -M
        str(ours / "pipe")[:128]: (str(ours / "pipe")[:128], "false"),
    }
    assert info["/run/mps-ecs"]["log_directory"] == h.through("ecs", "/var/log/nvidia-mps")[:128]  # MPS's default
    assert info["/tmp/mps-job-42"]["log_directory"] == h.through("slurm", "/var/log/slurm-mps-42")[:128]
    assert info[f"{CLAIM}-a1b2c"]["claim_uid"] == CLAIM
    # every daemon was asked once: none twice under two names
    assert all(len([c for c in f.received if c.startswith("get_server_list")]) == 1 for f in fakes.by_pipe.values())


def test_the_slurm_daemons_devices_number_its_clients(tmp_path):
    """The process-found daemon's CUDA_VISIBLE_DEVICES is read as a configured one's is."""
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    cfg = config(h, [], [])
    cfg.daemons = []
    sets = DaemonSet([], processes=True, proc_root=cfg.procfs)
    slurm = next(d for d in sets.current() if d.name == "/tmp/mps-job-42")
    from mps_exporter.sources.control import ControlClient, DaemonReader
    reader = DaemonReader(slurm, ControlClient(slurm.pipe_directory, runner=FakeControlDaemon()), proc_root=cfg.procfs)
    process = reader.process()
    assert process is not None and (process.multiuser, process.visible_devices) == (True, "2,3")


def test_a_daemon_that_goes_takes_its_series_and_a_new_one_comes(tmp_path):
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    now = [0.0]
    sets = DaemonSet([], interval=5.0, clock=lambda: now[0], processes=True, proc_root=str(h.proc))
    assert "/tmp/mps-job-42" in [d.name for d in sets.current()]
    shutil.rmtree(h.proc / "303")  # the job ends: its epilog quits the daemon
    assert "/tmp/mps-job-42" in [d.name for d in sets.current()]  # not rescanned before the interval
    now[0] = 5.0
    names = [d.name for d in sets.current()]
    assert "/tmp/mps-job-42" not in names and len(names) == 5


def test_without_process_discovery_only_the_named_daemons(tmp_path):
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    assert DaemonSet([], processes=False, proc_root=str(h.proc)).current() == []
    static = DaemonConfig("default", str(h.host / "tmp" / "nvidia-mps"), "/var/log/nvidia-mps")
    names = [d.name for d in DaemonSet([static], processes=True, proc_root=str(h.proc)).current()]
    assert names.count("default") == 1 and "/tmp/nvidia-mps" not in names  # GKE's daemon is the default one


@pytest.mark.skipif(os.path.exists("/tmp/nvidia-mps"), reason="this machine has a /tmp/nvidia-mps of its own")
def test_the_default_daemon_the_exporter_cannot_see_is_reached_through_the_daemons_root(tmp_path):
    """`mps-exporter` with no flags in a container without the host's /tmp/nvidia-mps: the
    host's daemon there is the `default` daemon, not a second one beside a `default` that is
    down."""
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    static = DaemonConfig("default", "/tmp/nvidia-mps", str(tmp_path / "no-log-here"))
    daemons = {d.name: d for d in DaemonSet([static], processes=True, proc_root=str(h.proc)).current()}
    assert "/tmp/nvidia-mps" not in daemons
    assert (daemons["default"].pipe_directory, daemons["default"].log_directory) == (
        h.through("gke", "/tmp/nvidia-mps"), h.through("gke", "/var/log/nvidia-mps"))
    assert len(daemons) == 6  # 404:/tmp/nvidia-mps, the DRA pod's own, is another daemon


def test_flags_default_on_and_off(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    cfg = cli.parse_args(["serve"])[1]
    assert cfg.discover_processes is True
    assert [(d.name, d.pipe_directory) for d in cfg.daemons] == [("default", "/tmp/nvidia-mps")]  # as before
    assert cli.parse_args(["serve", "--no-mps.discover-processes"])[1].discover_processes is False
    cfg = cli.parse_args(["serve", "--mps.discover", "dra"])[1]
    assert cfg.discover_processes is True and cfg.daemons == []


def test_the_scan_is_bounded(tmp_path):
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    assert len(scan_processes(str(h.proc), limit=2)) == 2
    assert scan_processes(str(tmp_path / "no-proc")) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a procfs")
def test_a_real_proc_without_daemons_finds_none_it_cannot_reach():
    """This machine's /proc: whatever it holds, every daemon found has a pipe directory
    that exists (nothing is invented)."""
    for d in scan_processes("/proc"):
        assert os.path.isdir(d.pipe_directory)


def test_a_process_that_becomes_a_daemon_is_found_at_the_next_scan_or_within_the_recheck(tmp_path):
    # A comm read alike at two scans is not read again until the full pass (CommReader): a
    # process caught between fork and exec is read again at the next scan; one that was
    # python3 at two scans and then exec()s the daemon is found at the full pass.
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    pipe_dir(h.host / "run" / "mps-late")
    pipe_dir(h.host / "run" / "mps-later")
    now = [0.0]
    sets = DaemonSet([], interval=5.0, clock=lambda: now[0], processes=True, proc_root=str(h.proc))

    def becomes_daemon(pid: int, pipe: str) -> None:
        (h.proc / str(pid) / "comm").write_text("nvidia-cuda-mps\n")
        (h.proc / str(pid) / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-f\0")
        (h.proc / str(pid) / "environ").write_bytes(f"CUDA_MPS_PIPE_DIRECTORY={pipe}\0".encode())

    write_proc(h.proc, [FakeProcess(800, comm="systemd")])  # forked by systemd, not exec()ed yet
    (h.proc / "800" / "root").symlink_to(h.host)
    (h.proc / "702" / "root").unlink()
    (h.proc / "702" / "root").symlink_to(h.host)
    names = [d.name for d in sets.current()]
    assert len(names) == 6 and "/run/mps-late" not in names
    becomes_daemon(800, "/run/mps-late")
    now[0] = 5.0
    assert "/run/mps-late" in [d.name for d in sets.current()]  # read once only: read again
    becomes_daemon(702, "/run/mps-later")  # python3 at both scans: settled
    # The last full pass was at 5 s, where 800 was first named nvidia-cuda-mps.
    for now[0] in (10.0, COMM_RECHECK_SECONDS):
        assert "/run/mps-later" not in [d.name for d in sets.current()]
    now[0] = 5.0 + COMM_RECHECK_SECONDS
    assert "/run/mps-later" in [d.name for d in sets.current()]


def test_a_daemon_that_execs_in_place_is_found_when_its_first_server_starts(tmp_path):
    # A settled python3 that exec()s the daemon (`exec nvidia-cuda-mps-control -f` after a
    # long set-up) keeps its PID: no scan reads its comm again until the full pass. The
    # server its first client starts is a new process named nvidia-cuda-mps: that scan
    # reads every comm again, and finds the daemon.
    h = fake_host(tmp_path, tmp_path / "srv-mps")
    pipe_dir(h.host / "run" / "mps-late")
    now = [0.0]
    sets = DaemonSet([], interval=5.0, clock=lambda: now[0], processes=True, proc_root=str(h.proc))
    (h.proc / "702" / "root").unlink()
    (h.proc / "702" / "root").symlink_to(h.host)
    before = [d.name for d in sets.current()]
    now[0] = 5.0
    assert [d.name for d in sets.current()] == before  # python3 at both scans: settled
    (h.proc / "702" / "comm").write_text("nvidia-cuda-mps\n")
    (h.proc / "702" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-f\0")
    (h.proc / "702" / "environ").write_bytes(b"CUDA_MPS_PIPE_DIRECTORY=/run/mps-late\0")
    now[0] = 10.0
    assert [d.name for d in sets.current()] == before  # no new process: not read again
    write_proc(h.proc, [FakeProcess(950, comm="nvidia-cuda-mps")])
    now[0] = 15.0
    assert "/run/mps-late" in [d.name for d in sets.current()]
    assert now[0] < COMM_RECHECK_SECONDS  # found by the server's start, not the recheck


def comm_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tuple[FakeHost, List[str], List[float], Any]:
    """The fake host, the comm files read (each path, in order), the clock, and a CommReader
    on that clock with a full pass every 60 s."""
    from mps_exporter import discovery

    h = fake_host(tmp_path, tmp_path / "srv-mps")
    read: List[str] = []
    real_comm = discovery._comm
    monkeypatch.setattr(discovery, "_comm", lambda proc_dir: read.append(proc_dir) or real_comm(proc_dir))
    now = [0.0]
    return h, read, now, discovery.CommReader(recheck=60.0, clock=lambda: now[0])


def test_a_steady_listing_is_not_read_again_until_the_full_pass(tmp_path, monkeypatch):
    # CommReader.control_pids: the listing and every comm in it as at the last scan, and no
    # full pass due: no comm is read, no pass over the processes made (CommReader.read not
    # called), and the daemons found are the same.
    h, read, now, comms = comm_reader(tmp_path, monkeypatch)
    processes = len([p for p in os.listdir(h.proc) if p.isdigit()])

    passes = []
    real_read = comms.read
    monkeypatch.setattr(comms, "read", lambda *args: passes.append(args) or real_read(*args))

    def scan_at(t: float) -> List[str]:
        now[0] = t
        read.clear()
        passes.clear()
        return [d.name for d in scan_processes(str(h.proc), comms=comms)]

    first = scan_at(0.0)
    assert len(read) == processes and first  # the first pass reads them all
    assert scan_at(5.0) == first and len(read) == processes  # each read once: read again
    assert scan_at(10.0) == first and read == [] and passes == []  # settled, the same listing
    write_proc(h.proc, [FakeProcess(900, comm="bash")])
    assert scan_at(15.0) == first and read == [f"{h.proc}/900"]  # a new process alone
    assert scan_at(20.0) == first and read == [f"{h.proc}/900"]  # read once: read again
    assert scan_at(25.0) == first and read == [] and passes == []
    assert scan_at(60.0) == first and len(read) == processes + 1  # the full pass
    write_proc(h.proc, [FakeProcess(901, comm="nvidia-cuda-mps")])
    assert scan_at(65.0) == first and len(read) == processes + 2  # a new MPS process: a full pass
    assert read.count(f"{h.proc}/901") == 1  # read once: not settled by it


def test_a_changed_listing_reads_the_new_processes_alone_and_a_daemon_that_left_is_gone(tmp_path, monkeypatch):
    # CommReader keeps the comms by PID as listed: a process that left costs no read, and
    # the daemon's PID leaves the answer; a new one is read, the settled others are not.
    h, read, now, comms = comm_reader(tmp_path, monkeypatch)
    for now[0] in (0.0, 5.0):  # read, then read again and settled
        before = comms.control_pids(str(h.proc))
    assert before is not None and 101 in before
    shutil.rmtree(h.proc / "101")  # the ECS daemon exits
    write_proc(h.proc, [FakeProcess(910, comm="bash")])
    passed: List[List[object]] = []  # the PIDs each pass in Python went over
    real_read = comms.read
    monkeypatch.setattr(comms, "read", lambda root, pids: passed.append(list(pids)) or real_read(root, pids))
    read.clear()
    now[0] = 10.0
    after = comms.control_pids(str(h.proc))
    assert read == [f"{h.proc}/910"]
    assert passed == [["910"]]  # not every process, each looked up and skipped
    assert after == [pid for pid in before if pid != 101]
