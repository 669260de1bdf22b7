"""Join what the sources saw in one scrape into the contract's families.

A pure function of a `Snapshot`: no I/O, no clock, so golden tests and replay
produce the same exposition the live exporter did.

Joins (see README "Where the numbers come from"):
- clients: the daemon's `ps` (server, device, namespace, command) + NVML's MPS
  process list (memory by PID and GPU) + /proc (uid, container, env limits);
- effective limits: the client's own env limit if set, else its server's, else
  the daemon default (thread ratio: the smaller of client's and server's);
- start times: the MPS logs when they saw the event, else /proc start time;
- when the daemon does not answer, the servers the logs know to be running
  still get their info, limits and start time.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import __version__
from .families import FamilyBuilder
from .logs.render import render_log_metrics
from .model import DaemonReading, GpuReading, NvmlReading, ProcessFacts, ServerFacts

ACTIVITY_METRICS = {
    "sm_active": "mps_gpu_sm_active_ratio",
    "sm_occupancy": "mps_gpu_sm_occupancy_ratio",
    "tensor_active": "mps_gpu_tensor_active_ratio",
    "dram_active": "mps_gpu_dram_active_ratio",
}
MPS_SERVER_COMMAND = "nvidia-cuda-mps"  # comm of nvidia-cuda-mps-server, cut to 15 chars


@dataclass
class Outcome:
    success: bool
    duration_seconds: float


@dataclass
class Snapshot:
    now: float
    nvml: Optional[NvmlReading] = None
    daemons: List[DaemonReading] = field(default_factory=list)
    processes: Dict[int, ProcessFacts] = field(default_factory=dict)
    logs: Dict[str, Any] = field(default_factory=dict)  # daemon name -> logs.LogSnapshot
    outcomes: Dict[str, Outcome] = field(default_factory=dict)


def render(snap: Snapshot) -> FamilyBuilder:
    out = FamilyBuilder()
    out.add("mps_exporter_build_info", 1, version=__version__, python_version=platform.python_version())
    for name, outcome in sorted(snap.outcomes.items()):
        out.add("mps_exporter_collector_success", int(outcome.success), collector=name)
        out.add("mps_exporter_collector_duration_seconds", outcome.duration_seconds, collector=name)
    gpus = snap.nvml.gpus if snap.nvml else []
    server_pids = {s.pid for d in snap.daemons for s in d.servers}
    for gpu in gpus:
        _render_gpu(out, gpu, snap.nvml.driver_version, server_pids, snap.processes)
    for daemon in snap.daemons:
        _render_daemon(out, daemon, gpus, snap, single_daemon=len(snap.daemons) == 1)
    if snap.logs:
        for name, log_snap in snap.logs.items():
            render_log_metrics(out, name, log_snap, snap.now)
    return out


# ---------------------------------------------------------------- GPUs
def sharing_mode(gpu: GpuReading, server_pids: set, processes: Dict[int, ProcessFacts]) -> str:
    if gpu.mig_enabled:
        return "mig"
    pids = {p.pid for p in gpu.compute_processes}

    def is_server(pid: int) -> bool:
        return pid in server_pids or getattr(processes.get(pid), "command", "") == MPS_SERVER_COMMAND

    if gpu.mps_clients or any(is_server(pid) for pid in pids):
        return "mps"
    if len(pids) > 1:
        return "time_slicing"
    return "exclusive" if pids else "idle"


def _render_gpu(out: FamilyBuilder, gpu: GpuReading, driver: str, server_pids: set, processes) -> None:
    g = {"gpu": str(gpu.index), "uuid": gpu.uuid}
    out.add("mps_gpu_up", int(gpu.up), **g)
    if not gpu.up:
        return
    out.add("mps_gpu_info", 1, **g, name=gpu.name, driver_version=driver, compute_mode=gpu.compute_mode,
            mig_mode="enabled" if gpu.mig_enabled else "disabled")
    out.add("mps_gpu_memory_total_bytes", gpu.memory_total_bytes, **g)
    out.add("mps_gpu_memory_used_bytes", gpu.memory_used_bytes, **g)
    out.add("mps_gpu_utilization_ratio", gpu.utilization_ratio, **g)
    out.add("mps_gpu_memory_utilization_ratio", gpu.memory_utilization_ratio, **g)
    out.add("mps_gpu_power_watts", gpu.power_watts, **g)
    out.add("mps_gpu_temperature_celsius", gpu.temperature_celsius, **g)
    for key, metric in ACTIVITY_METRICS.items():
        out.add(metric, gpu.activity.get(key), **g)
    mode = sharing_mode(gpu, server_pids, processes)
    out.add("mps_gpu_sharing_mode", 1, **g, mode=mode)
    out.add("mps_gpu_compute_processes", len(gpu.compute_processes), **g)
    if mode != "mps":  # under MPS NVML gives all SM time to the server: no per-client number
        for pid, ratio in sm_utilization(gpu).items():
            out.add("mps_process_sm_utilization_ratio", ratio, **g, pid=str(pid))


def sm_utilization(gpu: GpuReading) -> Dict[int, float]:
    """Per compute process: its newest SM utilization sample since the last scrape.

    NVML returns samples only for processes that used the SMs, so a process on
    the GPU without a new sample was idle over the interval: 0, not absent
    (absent would make its series flap between scrapes).
    """
    latest: Dict[int, Any] = {}
    for s in gpu.process_utilization:
        if s.pid not in latest or s.timestamp_us > latest[s.pid].timestamp_us:
            latest[s.pid] = s
    ratios = {p.pid: 0.0 for p in gpu.compute_processes}
    ratios.update({pid: s.sm_ratio for pid, s in latest.items()})
    return ratios


# ---------------------------------------------------------------- daemons
def _gpu_for_device(device: str, gpus: List[GpuReading]) -> Optional[GpuReading]:
    """`ps` prints a UUID prefix ("GPU-a20825ef-ef8f-4f37")."""
    return next((g for g in gpus if device and g.uuid.startswith(device)), None)


def _render_daemon(out: FamilyBuilder, d: DaemonReading, gpus: List[GpuReading], snap: Snapshot, single_daemon: bool) -> None:
    name = d.name
    log_snap = snap.logs.get(name)
    log_servers = getattr(log_snap, "servers", {}) or {}
    log_client_starts = getattr(log_snap, "client_start_times", {}) or {}
    out.add("mps_control_daemon_up", int(d.up), daemon=name)
    out.add("mps_control_daemon_info", 1, daemon=name, version=d.version, pipe_directory=d.pipe_directory,
            log_directory=d.log_directory)
    if d.default_active_thread_percentage is not None:
        out.add("mps_default_active_thread_ratio", d.default_active_thread_percentage / 100, daemon=name)
    for dev, limit in sorted(d.default_pinned_limits.items()):
        out.add("mps_default_pinned_memory_limit_bytes", limit, daemon=name, gpu=str(dev))

    # Servers: the daemon's list; when it did not answer, the logs' running servers.
    servers = {s.pid: s for s in d.servers}
    if not d.up or d.error:
        for pid, ls in log_servers.items():
            if getattr(ls, "running", False) and pid not in servers:
                servers[pid] = ServerFacts(pid=pid, status=None)
    utilization = {gpu.index: sm_utilization(gpu) for gpu in gpus}
    compute_memory = {gpu.index: {p.pid: p.used_bytes for p in gpu.compute_processes} for gpu in gpus}
    clients_per_server: Dict[int, int] = {}
    for c in d.clients:
        clients_per_server[c.server_pid] = clients_per_server.get(c.server_pid, 0) + 1
    server_atp: Dict[int, Optional[float]] = {}
    server_limits: Dict[int, Dict[int, int]] = {}
    for pid, s in sorted(servers.items()):
        ls = log_servers.get(pid)
        proc = snap.processes.get(pid)
        sp = {"daemon": name, "server_pid": str(pid)}
        uid = proc.uid if proc and proc.uid is not None else getattr(ls, "uid", None)
        user = proc.user if proc and proc.user else ("" if uid is None else str(uid))
        out.add("mps_server_info", 1, **sp, uid="" if uid is None else str(uid), user=user)
        if s.status:
            out.add("mps_server_status", 1, **sp, status=s.status)
        out.add("mps_server_clients", clients_per_server.get(pid, 0), **sp)
        atp = s.active_thread_percentage
        if atp is None:
            atp = getattr(ls, "active_thread_percentage", None)
        server_atp[pid] = atp
        out.add("mps_server_active_thread_ratio", None if atp is None else atp / 100, **sp)
        limits = s.pinned_limits or dict(getattr(ls, "pinned_limits", {}) or {})
        server_limits[pid] = limits
        for dev, limit in sorted(limits.items()):
            out.add("mps_server_pinned_memory_limit_bytes", limit, **sp, gpu=str(dev))
        start = getattr(ls, "start_time", None) or (proc.start_time_seconds if proc else None)
        out.add("mps_server_start_time_seconds", start, **sp)
        for gpu in gpus:
            g = {"gpu": str(gpu.index), "uuid": gpu.uuid}
            if pid in compute_memory[gpu.index]:
                out.add("mps_server_memory_used_bytes", compute_memory[gpu.index][pid], **sp, **g)
            out.add("mps_server_sm_utilization_ratio", utilization[gpu.index].get(pid), **sp, **g)

    # Clients: rows of `ps`, plus NVML MPS clients no daemon listed when this is the only daemon.
    ps_rows = {c.pid: c for c in d.clients}
    mps_memory = {}  # pid -> [(gpu, used)]
    for gpu in gpus:
        for p in gpu.mps_clients:
            mps_memory.setdefault(p.pid, []).append((gpu, p.used_bytes))
    listed_anywhere = {c.pid for other in snap.daemons for c in other.clients}
    pids = set(ps_rows) | ({pid for pid in mps_memory if pid not in listed_anywhere} if single_daemon else set())
    for pid in sorted(pids):
        row = ps_rows.get(pid)
        proc = snap.processes.get(pid) or ProcessFacts(pid)
        cp = {"daemon": name, "pid": str(pid)}
        server_pid = row.server_pid if row else None
        out.add("mps_client_info", 1, daemon=name, server_pid="" if server_pid is None else str(server_pid), pid=str(pid),
                uid="" if proc.uid is None else str(proc.uid), user=proc.user,
                command=(row.command if row else "") or proc.command, namespace=row.namespace if row else "",
                container_id=proc.container_id, pod_uid=proc.pod_uid)
        client_gpus = [gpu for gpu, _ in mps_memory.get(pid, [])]
        if row and not client_gpus:
            gpu = _gpu_for_device(row.device, gpus)
            client_gpus = [gpu] if gpu else []
        for gpu, used in mps_memory.get(pid, []):
            out.add("mps_client_memory_used_bytes", used, **cp, gpu=str(gpu.index), uuid=gpu.uuid)
        for gpu in client_gpus:
            limit = proc.env_pinned_limits.get(gpu.index)
            if limit is None and server_pid is not None:
                limit = server_limits.get(server_pid, {}).get(gpu.index)
            if limit is None:
                limit = d.default_pinned_limits.get(gpu.index) if server_pid is None else None
            out.add("mps_client_pinned_memory_limit_bytes", limit, **cp, gpu=str(gpu.index))
        limits = [v for v in (proc.env_active_thread_percentage,
                              server_atp.get(server_pid) if server_pid is not None else d.default_active_thread_percentage)
                  if v is not None]
        out.add("mps_client_active_thread_ratio", min(limits) / 100 if limits else None, **cp)
        out.add("mps_client_start_time_seconds", log_client_starts.get(pid) or proc.start_time_seconds, **cp)
