"""Recorded and synthetic scenarios: every source of the exporter, faked at its
library boundary (pynvml, the control subprocess, /proc), ready to serve.

- `busy`: the capture's busy moment (nvml_busy.json, ctl_busy.txt): server 1589
  with clients 1647/1648/1649 holding 9000/2856/1688 MiB; client 1648 sets its
  own limits in its environment the way a user would; logs from the capture.
- `synthetic(gpus, clients_per_gpu)`: one server per GPU, N clients each;
  with `clients_per_pod`, the clients run in Kubernetes pods (that many per pod,
  one container each; the last client a bare process), and the server sets a
  pinned memory limit on every GPU.
"""

from __future__ import annotations

import hashlib
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mps_exporter.collector import MpsCollector
from mps_exporter.config import Config, DaemonConfig
from mps_exporter.wiring import build_collector, build_readers
from mps_exporter.sources.base import Backends, Reader
from tests.fakes.fake_control import CAPTURE, FakeClient, FakeControlDaemon, FakeServer
from tests.fakes.fake_procfs import FakeProcess, write_proc
from tests.fakes.fake_pynvml import FakeNvml
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.fakes.fake_runtime import CONTAINERD_ID, CONTAINERD_ROOT, CRIO_ROOT, write_containerd_spec

BUSY_CLIENT_ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G",
                   "CUDA_MPS_CLIENT_PRIORITY": "1"}
# Client 1648's pod and container: containerd's spec in tests/data/runtime names them.
POD_UID = "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"
CONTAINER_ID = CONTAINERD_ID
POD_NAMES = ("ml-team", "trainer-7d9c6b5f4-x2k8p", "trainer")
# Names of the synthetic pods (one namespace per node; the fleet bench renames it per node).
SYNTHETIC_NAMESPACE, SYNTHETIC_CONTAINER = "team-00000", "worker"


@dataclass
class Scenario:
    cfg: Config
    nvml: FakeNvml
    daemon: FakeControlDaemon
    proc_root: Path
    log_directory: Optional[Path] = None
    pods: Dict[int, Tuple[str, str]] = field(default_factory=dict)  # client pid -> (pod uid, bare container id)

    def backends(self) -> Backends:
        # Fakes without latency answer at once: no test depends on the scheduler (the bench's,
        # with the measured latencies, keep the live waits).
        return Backends(nvml_module=self.nvml, control_runner=self.daemon,
                        nvml_wait_for_every_answer=not self.nvml.latency_us)

    def readers(self) -> Dict[str, Reader[Any]]:
        """Every enabled source over the fakes; the logs read to their end, the Xid events
        registered (no thread: nothing here closes the readers)."""
        readers = build_readers(self.cfg, self.backends())
        for name in ("logs", "xid"):
            if name in readers:
                readers[name].catch_up()
        return readers

    def collector(self, with_logs: bool = True) -> MpsCollector:
        readers = self.readers()
        if not with_logs:
            readers.pop("logs", None)
        return build_collector(self.cfg, readers)


def _log_pipeline_built() -> bool:
    try:
        import mps_exporter.logs.pipeline  # noqa: F401
    except ImportError:
        return False
    return True


def _config(pipe: str, log_dir: str, proc_root: Path) -> Config:
    cfg = Config()
    cfg.daemons = [DaemonConfig("default", pipe, log_dir)]
    cfg.procfs = str(proc_root)
    cfg.runtime_roots = ()  # no pod names but a scenario's own (never this machine's runtime)
    cfg.collectors["dcgm"] = False  # no DCGM on these machines
    cfg.log_timezone = "UTC"  # the capture's machine wrote its logs in UTC
    # Tests that change the fake daemon expect the next scrape to show it, on a machine
    # loaded enough for a fake read to outlast 50 ms; test_refresh tests the wait itself.
    cfg.control_wait = 0.0
    return cfg


def busy(tmp: Path, logs: bool = True) -> Scenario:
    uuid = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
    daemon = FakeControlDaemon(servers=[FakeServer(1589)], clients=[
        FakeClient(1649, 1589, uuid, 7), FakeClient(1648, 1589, uuid, 8), FakeClient(1647, 1589, uuid, 6)])
    proc_root = write_proc(tmp / "proc", [
        FakeProcess(1589, uid=0, comm="nvidia-cuda-mps", start_ticks=1000),
        FakeProcess(1647, uid=0, start_ticks=2000),
        FakeProcess(1648, uid=0, start_ticks=2001, environ=BUSY_CLIENT_ENV,
                    cgroup=f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CONTAINER_ID}.scope\n"),
        FakeProcess(1649, uid=0, start_ticks=2002),
    ])
    log_dir = CAPTURE if logs and (CAPTURE / "control.log").exists() and _log_pipeline_built() else None
    cfg = _config("/tmp/mps/pipe", str(log_dir or "/var/log/nvidia-mps"), proc_root)
    cfg.runtime_roots = (str(CONTAINERD_ROOT), str(CRIO_ROOT))
    if log_dir is None:
        cfg.collectors["logs"] = False
    return Scenario(cfg, FakeNvml.from_capture("busy"), daemon, proc_root, log_dir)


def synthetic_pod(index: int) -> Tuple[str, str]:
    """(pod uid, bare container id) of the index-th synthetic pod."""
    return str(uuidlib.UUID(int=index + 1, version=4)), hashlib.sha256(b"container-%d" % index).hexdigest()


def synthetic_pod_name(index: int) -> str:
    return f"job-{index:03d}"


def synthetic(tmp: Path, gpus: int = 8, clients_per_gpu: int = 6, latency: bool = False,
              clients_per_pod: int = 0) -> Scenario:
    """One MPS server (pid 4000) on every GPU; client pids as FakeNvml.synthetic numbers them."""
    nvml = FakeNvml.synthetic(gpus=gpus, clients_per_gpu=clients_per_gpu)
    if latency:
        busy_latency = FakeNvml.from_capture("busy", latency=True).latency_us
        nvml.latency_us = busy_latency
    clients: List[FakeClient] = []
    processes = [FakeProcess(4000, uid=0, comm="nvidia-cuda-mps")]
    pods: Dict[int, Tuple[str, str]] = {}
    pids = [p.pid for gpu in nvml.gpus for p in gpu.mps_processes]
    for gpu in nvml.gpus:
        for p in gpu.mps_processes:
            clients.append(FakeClient(p.pid, 4000, gpu.uuid, len(clients)))
            proc = FakeProcess(p.pid, uid=1000 + p.pid % 7)
            if clients_per_pod and p.pid != pids[-1]:
                pods[p.pid] = synthetic_pod((len(clients) - 1) // clients_per_pod)
                pod_uid, container_id = pods[p.pid]
                write_containerd_spec(tmp / "runtime", container_id, SYNTHETIC_NAMESPACE,
                                      synthetic_pod_name((len(clients) - 1) // clients_per_pod), SYNTHETIC_CONTAINER,
                                      pod_uid)
                proc.cgroup = (f"0::/kubepods.slice/kubepods-pod{pod_uid.replace('-', '_')}.slice/"
                               f"cri-containerd-{container_id}.scope\n")
            processes.append(proc)
    server = FakeServer(4000, pinned_limits={g: "64G" for g in range(gpus)} if clients_per_pod else {})
    daemon = FakeControlDaemon(servers=[server], clients=clients, latency_seconds=0.0019 if latency else 0.0)
    proc_root = write_proc(tmp / "proc", processes)
    cfg = _config("/tmp/mps/pipe", "/var/log/nvidia-mps", proc_root)
    cfg.runtime_roots = (str(tmp / "runtime"),)
    cfg.collectors["logs"] = False
    return Scenario(cfg, nvml, daemon, proc_root, pods=pods)


def outside_mps(tmp: Path) -> Scenario:
    """One server and client on GPU 0, and pid 6000 of uid 1500 (`train.py`, 1.4 GB) on the
    same GPU outside MPS (its pipe directory reached no daemon): in NVML's compute list only."""
    scen = synthetic(tmp, gpus=1, clients_per_gpu=1)
    scen.nvml.gpus[0].compute_processes.append(NvmlProcess(6000, 1468006400))
    write_proc(scen.proc_root, [FakeProcess(6000, uid=1500, comm="train.py")])
    return scen
