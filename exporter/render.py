"""Join what the sources saw in one collection into the contract's families.

A pure function of a `Snapshot`: no I/O, no clock, so golden tests and replay
produce the same exposition the live exporter did. One part per table of the
contract: the exporter itself, GPUs, daemons, servers, clients, logs.

Joins (see README "Where the numbers come from"):
- clients: the daemon's `ps` (server, device, namespace, command) + NVML's MPS
  process list (memory by PID and GPU) + /proc (uid, container, env limits);
- limits in force: limits.client_limits (the server's as the client connected,
  from the logs, where they show it);
- start times: the MPS logs when they saw the event, else /proc start time;
- when the daemon does not answer, the servers the logs know to be running
  still get their info, limits and start time.
"""

from __future__ import annotations

import logging
import platform
import threading
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from . import __version__
from .contract import (CLIENT_PID, CUT, DAEMON, DEVICE, FIXED, GPU, INPUT, SERVER_PID, UID, USER, UUID, Label,
                       counter, gauge, histogram, table)
from .families import FamilyBuilder
from prometheus_client.samples import Sample
from . import limits as lim
from .limits import Limits, VisibleDevice, client_limits, on_gpus, own_limits, visible_devices
from .exitstatus import OUTCOMES
from .logs.render import render_log_metrics
from .runtime_metadata import CONTAINER, NAMES_SOURCE as _NAMES_SOURCE, NAMESPACE, OWNER, POD
from .model import (
    EDGE_REASONS,
    EdgeReport,
    LogServer,
    LogSnapshot,
    DaemonReading,
    DcgmReading,
    GpuReading,
    Outcome,
    ProcessFacts,
    ProcessMemory,
    PsEntry,
    ServerFacts,
    Snapshot,
)

log = logging.getLogger(__name__)

__all__ = ["Outcome", "Snapshot", "readings_key", "render", "render_readings", "sharing_mode", "sm_utilization"]

# ---------------------------------------------------------------- the declarations
MODE = Label("mode", FIXED, "the exporter's classification", "mps, mixed, time_slicing, exclusive, mig, idle")
OUTSIDE_PID = Label("pid", INPUT, "NVML's compute process list of a GPU that MPS serves",
                    "processes outside MPS running on the GPU now; gone when they end")
PROCESS_PID = Label("pid", INPUT, "NVML's process list of a GPU not under MPS",
                    "processes running on the GPU now; gone when they end")
SERVER_STATUS = Label("status", FIXED, "control daemon `get_server_status`",
                      "ACTIVE, INITIALIZING, FAULT (anything else is a control error)")
POD_UID = Label("pod_uid", INPUT, "/proc/PID/cgroup of the server's clients (a UUID, or empty)",
                f"pods with MPS clients running now, per server; {CUT}")
LIMIT = Label("limit", FIXED, "the exporter's limit model (exporter/limits.py)", ", ".join(lim.LIMITS))
# mps_client_limit_source: one label per limit, its value where the limit in force came from.
LIMIT_SOURCES = tuple(Label(limit, FIXED, "the exporter's limit model (exporter/limits.py)", ", ".join(lim.SOURCES))
                      for limit in lim.LIMITS)
IGNORED_REASON = Label("reason", FIXED, "the exporter's limit model (exporter/limits.py)", ", ".join(lim.IGNORED_REASONS))
# The collector names are the registry's (catalog.py writes them into the docs).
CLIENT = (CLIENT_PID, NAMESPACE, POD, CONTAINER)  # every per-client series
COLLECTOR = Label("collector", FIXED, "the exporter's collectors", "{collectors}")

GPU_METRICS = table(
    "GPU",
    gauge("mps_gpu_info", "Static facts about a GPU (value 1).", GPU, UUID,
          Label("name", DEVICE, "NVML", "one per GPU"), Label("driver_version", DEVICE, "NVML", "one per node"),
          Label("compute_mode", DEVICE, "NVML", "NVML's compute modes"),
          Label("mig_mode", DEVICE, "NVML", "enabled or disabled")),
    gauge("mps_gpu_up", "1 if NVML answered for this GPU in this scrape.", GPU, UUID),
    gauge("mps_gpu_memory_total_bytes", "Total device memory.", GPU, UUID),
    gauge("mps_gpu_memory_used_bytes", "Used device memory.", GPU, UUID),
    gauge("mps_gpu_utilization_ratio", "NVML GPU utilization: share of time any kernel ran. Saturates with one tiny "
          "kernel stream; not a contention signal under MPS.", GPU, UUID),
    gauge("mps_gpu_memory_utilization_ratio", "NVML memory controller busy ratio.", GPU, UUID),
    gauge("mps_gpu_sm_active_ratio", "Share of SMs busy over the last interval (NVML GPM or DCGM field 1002).",
          GPU, UUID),
    gauge("mps_gpu_sm_occupancy_ratio", "SM occupancy over the last interval (NVML GPM or DCGM field 1003).",
          GPU, UUID),
    gauge("mps_gpu_tensor_active_ratio", "Tensor pipe activity over the last interval (NVML GPM any-tensor or DCGM "
          "field 1004).", GPU, UUID),
    gauge("mps_gpu_dram_active_ratio", "DRAM bandwidth activity over the last interval (NVML GPM or DCGM field "
          "1005).", GPU, UUID),
    gauge("mps_gpu_power_watts", "Power draw.", GPU, UUID),
    gauge("mps_gpu_temperature_celsius", "GPU core temperature.", GPU, UUID),
    gauge("mps_gpu_sharing_mode", "How the GPU is shared: mps, mixed (MPS serves it and processes outside "
          "MPS run on it too), time_slicing, exclusive, mig or idle (value 1).", GPU, UUID, MODE),
    gauge("mps_gpu_compute_processes", "Compute processes NVML lists on the GPU (MPS server and clients included).",
          GPU, UUID),
    gauge("mps_gpu_clients", "MPS client processes on the GPU (NVML's MPS process list), at every "
          "--mps.client-granularity.", GPU, UUID),
    gauge("mps_process_sm_utilization_ratio", "Per-process SM utilization on GPUs not under MPS (under MPS NVML "
          "attributes it all to the server).", GPU, UUID, PROCESS_PID),
    gauge("mps_gpu_processes_outside_mps", "Compute processes on a GPU that MPS serves that are neither an MPS server "
          "nor a client: they run beside MPS, outside its limits and scheduling (pipe directory not mounted or "
          "not set, another CUDA_MPS_PIPE_DIRECTORY); 0 on GPUs MPS does not serve.", GPU, UUID),
    gauge("mps_process_outside_mps_info", "A compute process outside MPS on a GPU that MPS serves (value 1): its "
          "user, command, container and pod (empty where /proc and the container runtime show none).",
          GPU, UUID, OUTSIDE_PID, UID, USER,
          Label("command", INPUT, "/proc/PID/comm", f"one per process outside MPS; {CUT}"),
          Label("container_id", INPUT, "/proc/PID/cgroup (64 hex digits)", f"one per process outside MPS; {CUT}"),
          Label("pod_uid", INPUT, "/proc/PID/cgroup (a UUID)", f"one per process outside MPS; {CUT}"),
          Label("namespace", INPUT, _NAMES_SOURCE, f"one per process outside MPS in a pod; {CUT}"),
          Label("pod", INPUT, _NAMES_SOURCE, f"one per process outside MPS in a pod; {CUT}"),
          Label("container", INPUT, _NAMES_SOURCE, f"one per process outside MPS in a pod; {CUT}")),
    gauge("mps_process_outside_mps_memory_used_bytes", "Device memory of a compute process outside MPS on a GPU "
          "that MPS serves (NVML's compute process list).", GPU, UUID, OUTSIDE_PID),
)
DAEMON_METRICS = table(
    "MPS control daemon",
    gauge("mps_control_daemon_up", "1 if the MPS control daemon answered a control command in this scrape.", DAEMON),
    gauge("mps_control_daemon_info", "Facts about a watched MPS control daemon (value 1): claim_uid, the DRA "
          "resource claim it serves (joins kube-state-metrics' resource claim series; empty elsewhere); multiuser "
          "true where it was started with -M (no user queueing), false without, empty where its command line "
          "cannot be read.", DAEMON,
          Label("version", INPUT, "`nvidia-cuda-mps-control -v`", f"one per daemon; {CUT}"),
          Label("pipe_directory", INPUT, "flag, config file or discovery", f"one per daemon; {CUT}"),
          Label("log_directory", INPUT, "flag, config file or discovery", f"one per daemon; {CUT}"),
          Label("claim_uid", INPUT, "the DRA daemon directory's claim UID (a UUID; empty elsewhere)",
                "one per daemon"),
          Label("multiuser", FIXED, "`-M` on the daemon's command line (/proc)", "true, false or empty (not known)")),
    gauge("mps_default_active_thread_ratio", "get_default_active_thread_percentage / 100.", DAEMON),
    gauge("mps_default_pinned_memory_limit_bytes", "get_default_device_pinned_mem_limit; absent where none is set.",
          DAEMON, GPU),
    gauge("mps_default_client_priority", "get_default_client_priority (0 normal, 1 below normal): the priority of "
          "servers started from now on, and of their clients that set none; absent where the daemon does not know "
          "the command.", DAEMON),
)
SERVER_METRICS = table(
    "MPS servers",
    gauge("mps_server_info", "A running MPS server (value 1).", DAEMON, SERVER_PID, UID, USER),
    gauge("mps_server_status", "Server status as the daemon reports it: ACTIVE, INITIALIZING or FAULT (value 1).",
          DAEMON, SERVER_PID, SERVER_STATUS),
    gauge("mps_server_clients", "Client processes connected to the server.", DAEMON, SERVER_PID),
    gauge("mps_server_active_thread_ratio", "The server's active thread percentage now / 100: binds clients that "
          "connect from now on, not those already connected.", DAEMON, SERVER_PID),
    gauge("mps_server_pinned_memory_limit_bytes", "The server's pinned device memory limit now "
          "(get_device_pinned_mem_limit): binds clients that connect from now on, not those already connected; "
          "absent where none is set.", DAEMON, SERVER_PID, GPU),
    gauge("mps_server_memory_used_bytes", "Device memory held by the server process itself.",
          DAEMON, SERVER_PID, GPU, UUID),
    gauge("mps_server_sm_utilization_ratio", "NVML per-process SM utilization of the server PID; under MPS this is "
          "all of its clients' SM time.", DAEMON, SERVER_PID, GPU, UUID),
    gauge("mps_server_start_time_seconds", "Unix time the server became ready.", DAEMON, SERVER_PID),
    gauge("mps_server_priority", "The server's client priority, server.log's `Server Priority set to N` (the daemon "
          "default when it started): its clients without CUDA_MPS_CLIENT_PRIORITY run at it.", DAEMON, SERVER_PID),
)
CLIENT_METRICS = table(
    "MPS clients",
    gauge("mps_client_info", "A connected MPS client process (value 1); pid_namespace is the PID namespace `ps` "
          "shows (not a Kubernetes namespace); container_id and pod_uid empty where the cgroup shows none. "
          "namespace, pod and container (on every client series) name its pod, ECS task, Docker container or Slurm "
          "job, owner says which (docs/labels.md#owners); empty where none does.",
          DAEMON, SERVER_PID, *CLIENT, UID, USER,
          Label("command", INPUT, "`ps` COMMAND column, else /proc/PID/comm", f"one per running client; {CUT}"),
          Label("pid_namespace", INPUT, "`ps` NAMESPACE column (a PID namespace)", f"one per running client; {CUT}"),
          Label("container_id", INPUT, "/proc/PID/cgroup (64 hex digits)", f"one per running client; {CUT}"),
          Label("pod_uid", INPUT, "/proc/PID/cgroup (a UUID; a Slurm job), an ECS task's id", f"one per running client; {CUT}"), OWNER),
    gauge("mps_client_memory_used_bytes", "Device memory of the client, from NVML's MPS process list.",
          DAEMON, *CLIENT, GPU, UUID),
    gauge("mps_client_pinned_memory_limit_bytes", "Pinned memory limit that binds the client: its own "
          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, else its server's limit as it was when the client connected (MPS logs; "
          "the server's limit now where the logs do not show the connection); absent where none applies.",
          DAEMON, *CLIENT, GPU),
    gauge("mps_client_active_thread_ratio", "Active thread limit that binds the client / 100: the smaller of its "
          "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and its server's percentage when it connected (MPS logs; the server's "
          "now where the logs do not show the connection).", DAEMON, *CLIENT),
    gauge("mps_client_priority", "The client's priority in force (0 normal, 1 below normal): its "
          "CUDA_MPS_CLIENT_PRIORITY, else its server's (server.log), else the daemon default; absent where none is "
          "known.", DAEMON, *CLIENT),
    gauge("mps_client_start_time_seconds", "Unix time the client connected.", DAEMON, *CLIENT),
    gauge("mps_client_limit_source", "Where each limit in force for the client came from (value 1), one label per "
          "limit (pinned_memory, active_threads, priority) whose value is client (its own environment), "
          "server_at_connect (its server's as it connected: MPS logs), server_now (its server's now, where the logs "
          "do not reach back), daemon_default or none.", DAEMON, *CLIENT, *LIMIT_SOURCES),
    gauge("mps_client_limit_ignored", "A limit the client set in its environment that CUDA does not apply (value 1; "
          "the client runs as if it had set none): reason invisible_device (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names a "
          "device the client cannot see: every pinned limit of it is dropped), no_device (a size without a device), "
          "malformed, not_a_number or out_of_range.", DAEMON, *CLIENT, LIMIT, IGNORED_REASON),
)
POD_SUM_METRICS = table(
    "MPS clients summed per server and pod (--mps.client-granularity pod)",
    gauge("mps_pod_clients", "MPS client processes of the server in the pod (pod_uid, namespace and pod empty: processes in no pod); "
          "replaces the per-client series with --mps.client-granularity pod.", DAEMON, SERVER_PID, POD_UID, NAMESPACE, POD),
    gauge("mps_pod_client_memory_used_bytes", "Device memory of the server's clients in the pod, summed.",
          DAEMON, SERVER_PID, POD_UID, NAMESPACE, POD, GPU, UUID),
    gauge("mps_pod_client_pinned_memory_limit_bytes", "Pinned memory limits in force for the server's clients in "
          "the pod, summed (clients without a limit add nothing).", DAEMON, SERVER_PID, POD_UID, NAMESPACE, POD, GPU),
)
SERVER_SUM_METRICS = table(
    "MPS clients summed per server (--mps.client-granularity server)",
    gauge("mps_server_client_memory_used_bytes", "Device memory of the server's clients, summed (server_pid empty: "
          "clients NVML lists that no server's `ps` row names); with mps_server_clients, replaces the per-client "
          "series with --mps.client-granularity server.", DAEMON, SERVER_PID, GPU, UUID),
    gauge("mps_server_client_pinned_memory_limit_bytes", "Pinned memory limits in force for the server's clients, "
          "summed (clients without a limit add nothing).", DAEMON, SERVER_PID, GPU),
    gauge("mps_server_client_pinned_memory_usage_max_ratio", "The largest share of its pinned memory limit that one "
          "of the server's clients uses on the GPU (clients without a limit left out): what a sum would hide.",
          DAEMON, SERVER_PID, GPU),
    gauge("mps_server_clients_limit_ignored", "At --mps.client-granularity pod and server: the server's clients "
          "whose own limit CUDA does not apply, by limit and reason (as mps_client_limit_ignored); absent where none.",
          DAEMON, SERVER_PID, LIMIT, IGNORED_REASON),
)
EDGE_REASON = Label("reason", FIXED, "the exporter's exit tracker (exporter/exits.py)", ", ".join(EDGE_REASONS))
EXIT_OUTCOME = Label("outcome", FIXED, "the kernel's proc connector (exporter/exitstatus.py)", ", ".join(OUTCOMES))
EDGE_METRICS = table(
    "Clients at the edge of memory",
    counter("mps_client_exits_at_memory_limit_total", "MPS clients that exited while their last memory reading was "
            "at the edge: reason client_limit (within --mps.oom-margin-ratio of the pinned limit in force), "
            "device_full (else, the GPU's used memory at least --mps.device-full-ratio of its total); outcome failed "
            "(non-zero exit status or a signal), clean (status 0) or unknown (no kernel proc connector: not the host's "
            "PID namespace, or CAP_NET_ADMIN missing before Linux 6.6). MPS logs no out-of-memory: a failed exit here is most likely one. A client "
            "far from both is never counted. Rows of 0 for every daemon and GPU it serves.",
            DAEMON, GPU, EDGE_REASON, EXIT_OUTCOME),
    gauge("mps_client_memory_peak_bytes", "The most device memory the client has held on the GPU since the exporter "
          "first saw it (NVML's MPS process list, once per collection): against mps_client_pinned_memory_limit_bytes, "
          "its headroom; gone when it exits.", DAEMON, *CLIENT, GPU, UUID),
    gauge("mps_pod_client_memory_peak_bytes", "At --mps.client-granularity pod: the most device memory the server's "
          "clients in the pod have held at once on the GPU (summed per collection) while the pod has clients there.",
          DAEMON, SERVER_PID, POD_UID, NAMESPACE, POD, GPU, UUID),
)
COMMAND = Label("command", FIXED, "the exporter's read-only verbs (sources/control.py READ_ONLY_COMMANDS)",
                "one per read-only verb")
SELF_METRICS = table(
    "The exporter itself",
    gauge("mps_exporter_build_info", "Build facts (value 1).",
          Label("version", FIXED, "the exporter's own version", "one"),
          Label("python_version", FIXED, "the running Python", "one")),
    gauge("mps_exporter_collector_success", "1 if the collector's source answered in this scrape.", COLLECTOR),
    gauge("mps_exporter_collector_duration_seconds", "Time the collector took in this scrape.", COLLECTOR),
    gauge("mps_exporter_collector_last_success_timestamp_seconds", "Time of the collection whose reading of the "
          "source is the latest complete one. Older than the scrape when the source failed or was late: its series "
          "are then that reading, or absent.", COLLECTOR),
    gauge("mps_exporter_collector_refresh_interval_seconds", "Seconds between the background reads of the "
          "collector's source (--collector.refresh-interval; scrapes serve the latest one); 0: read in every "
          "scrape. The age of a served reading is the scrape's time less its last success timestamp.", COLLECTOR),
    histogram("mps_exporter_collector_read_duration_seconds", "Time each read of the source took, reads that "
              "finished after their scrape's deadline included.", COLLECTOR),
    counter("mps_exporter_control_commands_total", "Commands the exporter sent to the control daemon, by verb. MPS "
            "echoes each into control.log, which it never rotates (about 5 lines; ps one more per client): at a "
            "steady state the exporter sends get_server_list alone (docs/logs.md).", DAEMON, COMMAND),
    counter("mps_exporter_control_commands_unknown_total", "Commands of the exporter that the control daemon does "
            "not know, by verb: its `Unknown command` answers (drivers before client priorities or pinned memory "
            "limits), and each command the exporter did not send since because of one (asked again when the "
            "daemon restarts). Each costs its field (a limit, a percentage, a priority, a status), never the "
            "daemon's servers and clients.", DAEMON, COMMAND),
)


ACTIVITY_METRICS = {
    "sm_active": "mps_gpu_sm_active_ratio",
    "sm_occupancy": "mps_gpu_sm_occupancy_ratio",
    "tensor_active": "mps_gpu_tensor_active_ratio",
    "dram_active": "mps_gpu_dram_active_ratio",
}
MPS_SERVER_COMMAND = "nvidia-cuda-mps"  # comm of nvidia-cuda-mps-server, cut to 15 chars
NO_PROCESS = ProcessFacts(0)


OwnRender = Callable[[FamilyBuilder, Snapshot], None]


def render(snap: Snapshot, granularity: str = "client", own_renders: Sequence[OwnRender] = ()) -> FamilyBuilder:
    """granularity (--mps.client-granularity): "client", series per client process;
    "pod", the clients' memory, limits and counts summed per server and pod; "server",
    their memory and limits summed per server (config.GRANULARITIES). own_renders: what
    the sources render alone (sources.registry.own_renders()), given by the caller so that
    this join imports no source."""
    out = FamilyBuilder()
    render_self(out, snap)
    render_readings(out, snap, granularity, own_renders)
    return out


def render_readings(out: FamilyBuilder, snap: Snapshot, granularity: str = "client",
                    own_renders: Sequence[OwnRender] = (), memo: Optional["ClientTableMemo"] = None) -> None:
    """Everything but the exporter's own series: a function of `readings_key(snap)` alone.
    `memo`: the client tables of the last call, reused where their inputs are equal."""
    gpus = snap.nvml.gpus if snap.nvml else []
    server_pids = {s.pid for d in snap.daemons for s in d.servers}
    listed = {c.pid for d in snap.daemons for c in d.clients}
    clients = listed | {p.pid for gpu in gpus for p in gpu.mps_clients}
    for gpu in gpus:
        render_gpu(out, gpu, snap.nvml.driver_version if snap.nvml else "", snap.dcgm, server_pids, clients,
                   snap.processes)
    joined = _GpuJoin.of(gpus)
    unclaimed = [pid for pid in joined.mps_memory if pid not in listed]
    for daemon in snap.daemons:
        log_snap = snap.logs.get(daemon.name)
        render_daemon(out, daemon)
        servers = render_servers(out, daemon, log_snap, snap.processes, joined)
        unlisted = [pid for pid in unclaimed if _claims(daemon, snap.processes.get(pid), len(snap.daemons) == 1)]
        if granularity == "client" and memo is not None:
            memo.render_clients(out, daemon, servers, unlisted, log_snap, snap.processes, joined)
        elif granularity == "client":
            render_clients(out, daemon, servers, unlisted, log_snap, snap.processes, joined)
        else:
            render_sums(out, daemon, servers, unlisted, log_snap, snap.processes, joined, by_pod=granularity == "pod")
    if memo is not None:
        memo.keep_only({daemon.name for daemon in snap.daemons})
    if snap.edges is not None:
        render_edges(out, snap.edges, {g.index: g.uuid for g in gpus}, granularity)
    for name, log_snap in snap.logs.items():
        render_log_metrics(out, name, log_snap, snap.now)
    for render_own in own_renders:
        render_own(out, snap)


def readings_key(snap: Snapshot, granularity: str) -> Tuple[object, ...]:
    """What `render_readings` depends on: equal keys, equal families. The readings are
    never changed once read (every source returns new objects), and the clock enters
    only through the oldest queued client's wait."""
    waits = tuple(log.oldest_queued_wait(snap.now) for log in snap.logs.values() if log.pending)
    return (granularity, snap.nvml, snap.dcgm, snap.daemons, snap.processes, snap.logs, snap.extra, waits,
            snap.edges)


# ---------------------------------------------------------------- the exporter
def render_self(out: FamilyBuilder, snap: Snapshot) -> None:
    """The exporter's own series: they change in every scrape, so the encoded readings
    (collector.Exposition) leave them out and readings_key ignores them."""
    out.add("mps_exporter_build_info", 1, version=__version__, python_version=platform.python_version())
    for name, outcome in sorted(snap.outcomes.items()):
        out.add("mps_exporter_collector_success", int(outcome.success), collector=name)
        out.add("mps_exporter_collector_duration_seconds", outcome.duration_seconds, collector=name)
        out.add("mps_exporter_collector_last_success_timestamp_seconds", outcome.last_success_seconds, collector=name)
        out.add("mps_exporter_collector_refresh_interval_seconds", outcome.refresh_interval_seconds, collector=name)
    for name, hist in sorted(snap.read_durations.items()):
        out.add_histogram("mps_exporter_collector_read_duration_seconds", hist.cumulative(), hist.total, collector=name)
    for d in snap.daemons:
        for verb, sent in sorted(d.commands_sent.items()):
            out.add("mps_exporter_control_commands_total", sent, daemon=d.name, command=verb)
        for verb, unknown in sorted(d.commands_unknown.items()):
            out.add("mps_exporter_control_commands_unknown_total", unknown, daemon=d.name, command=verb)


# ---------------------------------------------------------------- GPUs
def _is_server(pid: int, server_pids: Set[int], processes: Mapping[int, ProcessFacts]) -> bool:
    return pid in server_pids or processes.get(pid, NO_PROCESS).command == MPS_SERVER_COMMAND


def outside_mps(gpu: GpuReading, server_pids: Set[int], clients: AbstractSet[int],
                processes: Mapping[int, ProcessFacts]) -> List[ProcessMemory]:
    """Compute processes on a GPU that an MPS server serves that are neither a server nor a
    client (`clients`: every daemon's `ps` and every GPU's MPS list): a CUDA process whose
    CUDA_MPS_PIPE_DIRECTORY reaches no daemon runs beside MPS, silently (issue 24)."""
    if gpu.mig_enabled or not (gpu.mps_clients or any(_is_server(p.pid, server_pids, processes)
                                                      for p in gpu.compute_processes)):
        return []
    own = {p.pid for p in gpu.mps_clients}
    return [p for p in gpu.compute_processes
            if p.pid not in own and p.pid not in clients and not _is_server(p.pid, server_pids, processes)]


def sharing_mode(gpu: GpuReading, server_pids: Set[int], processes: Mapping[int, ProcessFacts],
                 clients: AbstractSet[int] = frozenset()) -> str:
    """mixed: MPS serves the GPU and processes outside MPS run on it too (outside_mps)."""
    if gpu.mig_enabled:
        return "mig"
    pids = {p.pid for p in gpu.compute_processes}
    if gpu.mps_clients or any(_is_server(pid, server_pids, processes) for pid in pids):
        return "mixed" if outside_mps(gpu, server_pids, clients, processes) else "mps"
    if len(pids) > 1:
        return "time_slicing"
    return "exclusive" if pids else "idle"


def render_gpu(out: FamilyBuilder, gpu: GpuReading, driver: str, dcgm: DcgmReading, server_pids: Set[int],
               clients: AbstractSet[int], processes: Mapping[int, ProcessFacts]) -> None:
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
    activity = {**gpu.activity, **dcgm.get(gpu.index, {})}  # DCGM's profiling fields win over GPM
    for key, metric in ACTIVITY_METRICS.items():
        out.add(metric, activity.get(key), **g)
    mode = sharing_mode(gpu, server_pids, processes, clients)
    out.add("mps_gpu_sharing_mode", 1, **g, mode=mode)
    out.add("mps_gpu_compute_processes", len(gpu.compute_processes), **g)
    out.add("mps_gpu_clients", len(gpu.mps_clients), **g)
    outside = outside_mps(gpu, server_pids, clients, processes)
    out.add("mps_gpu_processes_outside_mps", len(outside), **g)
    for p in outside:
        proc = processes.get(p.pid) or ProcessFacts(p.pid)
        out.add("mps_process_outside_mps_info", 1, **g, pid=str(p.pid), uid="" if proc.uid is None else str(proc.uid),
                user=proc.user, command=proc.command, container_id=proc.container_id, pod_uid=proc.pod_uid,
                namespace=proc.namespace, pod=proc.pod, container=proc.container)
        out.add("mps_process_outside_mps_memory_used_bytes", p.used_bytes, **g, pid=str(p.pid))
    if mode not in ("mps", "mixed"):  # under MPS NVML gives all SM time to the server: no per-client number
        for pid, ratio in sm_utilization(gpu).items():
            out.add("mps_process_sm_utilization_ratio", ratio, **g, pid=str(pid))


def sm_utilization(gpu: GpuReading) -> Dict[int, float]:
    """Per compute process: its newest SM utilization sample since the last scrape.

    NVML returns samples only for processes that used the SMs, so a process on
    the GPU without a new sample was idle over the interval: 0, not absent
    (absent would make its series flap between scrapes).
    """
    latest: Dict[int, Tuple[int, float]] = {}
    for s in gpu.process_utilization:
        if s.pid not in latest or s.timestamp_us > latest[s.pid][0]:
            latest[s.pid] = (s.timestamp_us, s.sm_ratio)
    ratios = {p.pid: 0.0 for p in gpu.compute_processes}
    ratios.update({pid: ratio for pid, (_, ratio) in latest.items()})
    return ratios


@dataclass
class _GpuJoin:
    """The GPU facts the server and client tables look up by PID."""

    gpus: List[GpuReading]
    utilization: Dict[int, Dict[int, float]]  # gpu index -> pid -> SM ratio
    compute_memory: Dict[int, Dict[int, Optional[int]]]  # gpu index -> pid -> bytes
    mps_memory: Dict[int, List[Tuple[GpuReading, Optional[int]]]]  # client pid -> [(gpu, bytes)]

    @classmethod
    def of(cls, gpus: List[GpuReading]) -> "_GpuJoin":
        mps_memory: Dict[int, List[Tuple[GpuReading, Optional[int]]]] = {}
        for gpu in gpus:
            for p in gpu.mps_clients:
                mps_memory.setdefault(p.pid, []).append((gpu, p.used_bytes))
        return cls(gpus, {gpu.index: sm_utilization(gpu) for gpu in gpus},
                   {gpu.index: {p.pid: p.used_bytes for p in gpu.compute_processes} for gpu in gpus}, mps_memory)

    def daemon_devices(self, d: DaemonReading) -> List[VisibleDevice]:
        """The devices the daemon and its clients count from: its own CUDA_VISIBLE_DEVICES."""
        return visible_devices(d.visible_devices, [(g.index, g.uuid) for g in self.gpus])

    def gpu_for_device(self, device: str) -> Optional[GpuReading]:
        """`ps` prints a UUID prefix ("GPU-a20825ef-ef8f-4f37")."""
        return next((g for g in self.gpus if device and g.uuid.startswith(device)), None)


# ---------------------------------------------------------------- daemons
def _claims(d: DaemonReading, proc: Optional[ProcessFacts], only: bool) -> bool:
    """Whether an NVML MPS client that no daemon's `ps` listed (it connected after the `ps`,
    or the `ps` failed) is `d`'s: its pipe directory is d's, or, where that cannot be told,
    d is the only daemon watched. Never a daemon that is not running: a SIGKILLed daemon's
    clients stay in NVML's list, each a client of nothing (2 x H200, issue 38); nor where
    another daemon runs beside the one watched (its clients showed as this one's in that
    run). A daemon that did not answer (hung, an error) may still have its clients."""
    if not d.up and d.error is None:
        return False
    pipe = proc.mps_pipe if proc is not None else None
    if pipe is not None and d.pipe_identity is not None:
        return pipe == d.pipe_identity
    return only


def render_daemon(out: FamilyBuilder, d: DaemonReading) -> None:
    out.add("mps_control_daemon_up", int(d.up), daemon=d.name)
    multiuser = "" if d.multiuser is None else str(d.multiuser).lower()
    out.add("mps_control_daemon_info", 1, daemon=d.name, version=d.version, pipe_directory=d.pipe_directory,
            log_directory=d.log_directory, claim_uid=d.claim_uid, multiuser=multiuser)
    if d.default_active_thread_percentage is not None:
        out.add("mps_default_active_thread_ratio", d.default_active_thread_percentage / 100, daemon=d.name)
    for dev, limit in sorted(d.default_pinned_limits.items()):
        out.add("mps_default_pinned_memory_limit_bytes", limit, daemon=d.name, gpu=str(dev))
    out.add("mps_default_client_priority", d.default_client_priority, daemon=d.name)


# ---------------------------------------------------------------- servers
def render_servers(out: FamilyBuilder, d: DaemonReading, log_snap: Optional[LogSnapshot],
                   processes: Mapping[int, ProcessFacts], joined: _GpuJoin) -> Dict[int, Limits]:
    """The server table; returns each server's limits for the client table."""
    log_servers: Mapping[int, LogServer] = log_snap.servers if log_snap else {}
    # The daemon's list; when it did not answer, the logs' running servers that still run:
    # a SIGKILLed daemon and server leave no exit line, and a server the logs alone know
    # stayed in mps_server_info as long as the daemon's directory did (issue 38).
    servers = {s.pid: s for s in d.servers}
    if not d.up or d.error:
        for pid, running in log_servers.items():
            if running.running and pid not in servers and (
                    pid in processes or any(pid in memory for memory in joined.compute_memory.values())):
                servers[pid] = ServerFacts(pid=pid, status=None)
    clients_per_server: Dict[int, int] = {}
    for c in d.clients:
        clients_per_server[c.server_pid] = clients_per_server.get(c.server_pid, 0) + 1
    limits: Dict[int, Limits] = {}
    for pid, s in sorted(servers.items()):
        ls = log_servers.get(pid)
        proc = processes.get(pid)
        sp = {"daemon": d.name, "server_pid": str(pid)}
        uid = proc.uid if proc and proc.uid is not None else (ls.uid if ls else None)
        user = proc.user if proc and proc.user else ("" if uid is None else str(uid))
        out.add("mps_server_info", 1, **sp, uid="" if uid is None else str(uid), user=user)
        if s.status:
            out.add("mps_server_status", 1, **sp, status=s.status)
        out.add("mps_server_clients", clients_per_server.get(pid, 0), **sp)
        atp = s.active_thread_percentage
        if atp is None and ls is not None:
            atp = ls.active_thread_percentage
        out.add("mps_server_active_thread_ratio", None if atp is None else atp / 100, **sp)
        pinned = s.pinned_limits or (on_gpus(ls.pinned_limits, joined.daemon_devices(d)) if ls else {})
        limits[pid] = Limits(atp, pinned)
        for dev, limit in sorted(pinned.items()):
            out.add("mps_server_pinned_memory_limit_bytes", limit, **sp, gpu=str(dev))
        start = (ls.start_time if ls else None) or (proc.start_time_seconds if proc else None)
        out.add("mps_server_start_time_seconds", start, **sp)
        out.add("mps_server_priority", ls.priority if ls else None, **sp)
        for gpu in joined.gpus:
            g = {"gpu": str(gpu.index), "uuid": gpu.uuid}
            if pid in joined.compute_memory[gpu.index]:
                out.add("mps_server_memory_used_bytes", joined.compute_memory[gpu.index][pid], **sp, **g)
            out.add("mps_server_sm_utilization_ratio", joined.utilization[gpu.index].get(pid), **sp, **g)
    return limits


# ---------------------------------------------------------------- clients
@dataclass
class _ClientJoin:
    """What render_clients and render_sums show of one client."""

    memory: List[Tuple[GpuReading, Optional[int]]]  # NVML's MPS list: (GPU, bytes)
    gpus: List[GpuReading]  # the GPUs it is on: that list, else the device `ps` names
    limits: Limits  # in force
    sources: Dict[str, str]  # limits.LIMITS -> limits.SOURCES: where each limit in force came from
    ignored: Mapping[str, str]  # limit -> why the client's own setting is not in force
    priority: Optional[int]  # in force


def _client_in_force(pid: int, row: Optional[PsEntry], proc: ProcessFacts, server_limits: Mapping[int, Limits],
                     d: DaemonReading, joined: _GpuJoin, log_snap: Optional[LogSnapshot]) -> _ClientJoin:
    memory = joined.mps_memory.get(pid, [])
    client_gpus = [gpu for gpu, _ in memory]
    if row and not client_gpus:
        gpu = joined.gpu_for_device(row.device)
        client_gpus = [gpu] if gpu else []
    devices = joined.daemon_devices(d)
    own = own_limits(proc.environ, [(dev.index, dev.uuid) for dev in devices if dev.index is not None])
    server = None if row is None or row.server_pid is None else server_limits.get(row.server_pid, Limits())
    logged = log_snap.client_limits.get(pid) if log_snap is not None and server is not None else None
    in_force = client_limits(own.limits, server, Limits(d.default_active_thread_percentage, d.default_pinned_limits),
                             at_connect=None if logged is None else Limits(logged[0], on_gpus(logged[1], devices)))
    priority, priority_source = _client_priority(own.priority, None if row is None else row.server_pid, log_snap, d)
    return _ClientJoin(memory, client_gpus, in_force.limits, {**in_force.sources, lim.PRIORITY: priority_source},
                       own.ignored, priority)


def _client_priority(own: Optional[int], server_pid: Optional[int], log_snap: Optional[LogSnapshot],
                     d: DaemonReading) -> Tuple[Optional[int], str]:
    """The priority a client runs at and where it came from: its own
    CUDA_MPS_CLIENT_PRIORITY, else its server's (`Server Priority set to N`: the daemon
    default when the server started, which its clients inherit), else the daemon default now."""
    if own is not None:
        return own, lim.CLIENT
    server = log_snap.servers.get(server_pid) if log_snap is not None and server_pid is not None else None
    if server is not None and server.priority is not None:
        return server.priority, lim.SERVER_AT_CONNECT
    if d.default_client_priority is not None:
        return d.default_client_priority, lim.DAEMON_DEFAULT
    return None, lim.NONE


# A client's series come from what its process supplied (its environment, its command):
# one that cannot be rendered costs that client's series, never the scrape. Each kind of
# failure is logged once as a warning, then at debug level (a client lives for many scrapes).
MAX_FAILURES_WARNED = 64
_failures_warned: Set[Tuple[str, str]] = set()
_failures_lock = threading.Lock()


def client_left_out(d: DaemonReading, pid: int, e: Exception) -> None:
    """Log that client `pid` of daemon `d` is left out of the exposition, because of `e`."""
    kind = (type(e).__name__, str(e)[:200])
    with _failures_lock:
        first = kind not in _failures_warned and len(_failures_warned) < MAX_FAILURES_WARNED
        if first:
            _failures_warned.add(kind)
    log.log(logging.WARNING if first else logging.DEBUG,
            "daemon %s: client %d left out of the metrics (its series could not be rendered: %s: %s)%s",
            d.name, pid, kind[0], kind[1], "; further such failures are logged at debug level" if first else "")


def render_clients(out: FamilyBuilder, d: DaemonReading, server_limits: Mapping[int, Limits], unlisted: List[int],
                   log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts], joined: _GpuJoin) -> None:
    """Rows of the daemon's `ps`, plus the NVML MPS clients in `unlisted`. A client whose
    series cannot be rendered is left out whole (none of its series), and logged."""
    ps_rows = {c.pid: c for c in d.clients}
    for pid in sorted(set(ps_rows) | set(unlisted)):
        part = FamilyBuilder()
        try:
            render_client(part, d, pid, ps_rows.get(pid), processes.get(pid) or ProcessFacts(pid), server_limits,
                          joined, log_snap)
        except Exception as e:  # one client's data, never the scrape
            client_left_out(d, pid, e)
            continue
        for name, samples in part.parts():
            out.extend(name, samples)


def render_client(out: FamilyBuilder, d: DaemonReading, pid: int, row: Optional[PsEntry], proc: ProcessFacts,
                  server_limits: Mapping[int, Limits], joined: _GpuJoin, log_snap: Optional[LogSnapshot]) -> None:
    """One client's series. What it reads is what ClientTableMemo._inputs compares."""
    cp = {"daemon": d.name, "pid": str(pid), "namespace": proc.namespace, "pod": proc.pod,
          "container": proc.container}
    server_pid = row.server_pid if row else None
    out.add("mps_client_info", 1, **cp, server_pid="" if server_pid is None else str(server_pid),
            uid="" if proc.uid is None else str(proc.uid), user=proc.user,
            command=(row.command if row else "") or proc.command, pid_namespace=row.namespace if row else "",
            container_id=proc.container_id, pod_uid=proc.pod_uid, owner=proc.owner)
    c = _client_in_force(pid, row, proc, server_limits, d, joined, log_snap)
    for gpu, used in c.memory:
        out.add("mps_client_memory_used_bytes", used, **cp, gpu=str(gpu.index), uuid=gpu.uuid)
    for gpu in c.gpus:
        out.add("mps_client_pinned_memory_limit_bytes", c.limits.pinned_bytes.get(gpu.index), **cp,
                gpu=str(gpu.index))
    share = c.limits.thread_percentage
    out.add("mps_client_active_thread_ratio", None if share is None else share / 100, **cp)
    out.add("mps_client_priority", c.priority, **cp)
    out.add("mps_client_limit_source", 1, **cp, **c.sources)
    for limit, reason in c.ignored.items():
        out.add("mps_client_limit_ignored", 1, **cp, limit=limit, reason=reason)
    log_start = log_snap.client_start_times.get(pid) if log_snap else None
    out.add("mps_client_start_time_seconds", log_start or proc.start_time_seconds, **cp)


ClientParts = List[Tuple[str, List[Sample]]]


class ClientTableMemo:
    """Each client's series as last rendered, with what they were rendered from.

    The clients' series mostly stay the same from one scrape to the next while the GPU
    numbers and the log counters move; in a storm a few clients change at a time. The
    client table (six or more series a client) was most of a scrape's render with 48
    clients (issue 29). A client's series are reused where every input render_client
    reads is equal; the samples are shared, never changed."""

    def __init__(self) -> None:
        self._clients: Dict[str, Dict[int, Tuple[Tuple[object, ...], ClientParts]]] = {}  # daemon -> pid -> ...

    @staticmethod
    def _inputs(d: DaemonReading, pid: int, row: Optional[PsEntry], proc: ProcessFacts,
                server_limits: Mapping[int, Limits], joined: _GpuJoin, log_snap: Optional[LogSnapshot],
                shared: Tuple[object, ...]) -> Tuple[object, ...]:
        server_pid = row.server_pid if row else None
        logged = None if log_snap is None else (
            log_snap.client_start_times.get(pid), log_snap.client_limits.get(pid),
            None if server_pid is None else log_snap.servers.get(server_pid))
        memory = tuple((g.index, used) for g, used in joined.mps_memory.get(pid, ()))
        return (shared, row, proc, None if server_pid is None else server_limits.get(server_pid), memory, logged)

    def render_clients(self, out: FamilyBuilder, d: DaemonReading, server_limits: Mapping[int, Limits],
                       unlisted: List[int], log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts],
                       joined: _GpuJoin) -> None:
        # What every client of the daemon reads: its name and defaults, the GPUs, whether logs are read.
        shared = (d.name, d.default_active_thread_percentage, tuple(sorted(d.default_pinned_limits.items())),
                  d.default_client_priority, tuple((g.index, g.uuid) for g in joined.gpus), log_snap is None,
                  d.visible_devices)
        before = self._clients.get(d.name, {})
        now: Dict[int, Tuple[Tuple[object, ...], ClientParts]] = {}
        families: Dict[str, List[Sample]] = {}  # in the order render_clients adds them
        ps_rows = {c.pid: c for c in d.clients}
        for pid in sorted(set(ps_rows) | set(unlisted)):
            row, proc = ps_rows.get(pid), processes.get(pid) or ProcessFacts(pid)
            inputs = self._inputs(d, pid, row, proc, server_limits, joined, log_snap, shared)
            kept = before.get(pid)
            if kept is None or kept[0] != inputs:
                part = FamilyBuilder()
                try:
                    render_client(part, d, pid, row, proc, server_limits, joined, log_snap)
                    kept = (inputs, part.parts())
                except Exception as e:  # left out, and not tried again while its inputs stay
                    client_left_out(d, pid, e)
                    kept = (inputs, [])
            now[pid] = kept
            for name, samples in kept[1]:
                families.setdefault(name, []).extend(samples)
        self._clients[d.name] = now  # clients gone are forgotten
        for name, samples in families.items():
            out.extend(name, samples)

    def keep_only(self, names: AbstractSet[str]) -> None:
        """Forget the clients of daemons no longer read."""
        self._clients = {name: kept for name, kept in self._clients.items() if name in names}


def render_sums(out: FamilyBuilder, d: DaemonReading, server_limits: Mapping[int, Limits], unlisted: List[int],
                log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts], joined: _GpuJoin,
                by_pod: bool) -> None:
    """The clients render_clients would show, summed per server and (by_pod) pod: no pid
    label, so short-lived clients add no series. Per server alone, the fullest client's
    share of its limit is kept too: a sum over clients would hide one at its limit."""
    ps_rows = {c.pid: c for c in d.clients}
    counts: Dict[Tuple[str, str], int] = {}
    pod_names: Dict[str, Dict[str, str]] = {"": {"namespace": "", "pod": ""}}  # pod uid -> its names
    memory: Dict[Tuple[str, str, int], int] = {}  # (server, pod, gpu index) -> bytes
    limits: Dict[Tuple[str, str, int], int] = {}
    fullest: Dict[Tuple[str, str, int], float] = {}  # largest memory / limit of one client
    ignored: Dict[Tuple[str, str, str], int] = {}  # (server, limit, reason) -> clients
    for pid in sorted(set(ps_rows) | set(unlisted)):
        row = ps_rows.get(pid)
        proc = processes.get(pid) or ProcessFacts(pid)
        try:
            c = _client_in_force(pid, row, proc, server_limits, d, joined, log_snap)
        except Exception as e:  # one client's data, never the scrape: left out of every sum
            client_left_out(d, pid, e)
            continue
        key = ("" if row is None or row.server_pid is None else str(row.server_pid), proc.pod_uid if by_pod else "")
        counts[key] = counts.get(key, 0) + 1
        if by_pod and proc.pod_uid and proc.pod:
            pod_names[proc.pod_uid] = {"namespace": proc.namespace, "pod": proc.pod}
        for what, reason in c.ignored.items():
            ignored[(key[0], what, reason)] = ignored.get((key[0], what, reason), 0) + 1
        for gpu in c.gpus:
            limit = c.limits.pinned_bytes.get(gpu.index)
            if limit is not None:
                limits[key + (gpu.index,)] = limits.get(key + (gpu.index,), 0) + limit
        for gpu, n in c.memory:
            if n is None:
                continue
            memory[key + (gpu.index,)] = memory.get(key + (gpu.index,), 0) + n
            limit = c.limits.pinned_bytes.get(gpu.index)
            if limit:
                fullest[key + (gpu.index,)] = max(fullest.get(key + (gpu.index,), 0.0), n / limit)
    uuids = {gpu.index: gpu.uuid for gpu in joined.gpus}
    for (server_pid, what, reason), n in sorted(ignored.items()):
        out.add("mps_server_clients_limit_ignored", n, daemon=d.name, server_pid=server_pid, limit=what, reason=reason)
    if by_pod:
        for (server_pid, pod_uid), count in sorted(counts.items()):
            out.add("mps_pod_clients", count, daemon=d.name, server_pid=server_pid, pod_uid=pod_uid,
                    **pod_names.get(pod_uid, pod_names[""]))
        for (server_pid, pod_uid, index), total in sorted(memory.items()):
            out.add("mps_pod_client_memory_used_bytes", total, daemon=d.name, server_pid=server_pid,
                    pod_uid=pod_uid, **pod_names.get(pod_uid, pod_names[""]), gpu=str(index), uuid=uuids[index])
        for (server_pid, pod_uid, index), limit_sum in sorted(limits.items()):
            out.add("mps_pod_client_pinned_memory_limit_bytes", limit_sum, daemon=d.name, server_pid=server_pid,
                    pod_uid=pod_uid, **pod_names.get(pod_uid, pod_names[""]), gpu=str(index))
        return
    for (server_pid, _, index), total in sorted(memory.items()):
        out.add("mps_server_client_memory_used_bytes", total, daemon=d.name, server_pid=server_pid, gpu=str(index),
                uuid=uuids[index])
    for (server_pid, _, index), limit_sum in sorted(limits.items()):
        out.add("mps_server_client_pinned_memory_limit_bytes", limit_sum, daemon=d.name, server_pid=server_pid,
                gpu=str(index))
    for (server_pid, _, index), ratio in sorted(fullest.items()):
        out.add("mps_server_client_pinned_memory_usage_max_ratio", ratio, daemon=d.name, server_pid=server_pid,
                gpu=str(index))


# ---------------------------------------------------------------- memory at the edge
def render_edges(out: FamilyBuilder, edges: EdgeReport, uuids: Mapping[int, str], granularity: str) -> None:
    """The exit tracker's counts (every granularity: no client labels) and peaks (per
    client at client granularity, per server and pod at pod granularity)."""
    for (daemon, gpu, reason, outcome), n in edges.exits:
        out.add("mps_client_exits_at_memory_limit_total", n, daemon=daemon, gpu=str(gpu), reason=reason,
                outcome=outcome)
    if granularity == "client":
        for (daemon, pid, gpu), (namespace, pod, container, peak) in edges.peaks:
            out.add("mps_client_memory_peak_bytes", peak, daemon=daemon, pid=str(pid), namespace=namespace, pod=pod,
                    container=container, gpu=str(gpu), uuid=uuids.get(gpu, ""))
    elif granularity == "pod":
        for (daemon, server_pid, pod_uid, gpu), (namespace, pod, peak) in edges.pod_peaks:
            out.add("mps_pod_client_memory_peak_bytes", peak, daemon=daemon, server_pid=server_pid, pod_uid=pod_uid,
                    namespace=namespace, pod=pod, gpu=str(gpu), uuid=uuids.get(gpu, ""))

@dataclass(frozen=True)
class ClientMemory:
    """One client's memory reading on one GPU with the pinned limit in force there: what
    the exit tracker (exits.py) keeps of each client between collections."""

    daemon: str
    pid: int
    gpu: int
    used_bytes: int
    limit_bytes: Optional[int]
    gpu_used_bytes: Optional[int]
    gpu_total_bytes: Optional[int]
    server_pid: str  # "" where no server is known
    pod_uid: str
    namespace: str
    pod: str
    container: str


def client_memory(snap: Snapshot) -> List[ClientMemory]:
    """Every client's memory reading (NVML's MPS list) with its limit in force, by the same
    join as the client series (_client_in_force): a client is at its limit here exactly
    where mps_client_pinned_memory_limit_bytes says so."""
    gpus = snap.nvml.gpus if snap.nvml else []
    joined = _GpuJoin.of(gpus)
    listed = {c.pid for d in snap.daemons for c in d.clients}
    unclaimed = [pid for pid in joined.mps_memory if pid not in listed]
    found: List[ClientMemory] = []
    for d in snap.daemons:
        log_snap = snap.logs.get(d.name)
        servers = render_servers(FamilyBuilder(), d, log_snap, snap.processes, joined)
        ps_rows = {c.pid: c for c in d.clients}
        unlisted = [pid for pid in unclaimed if _claims(d, snap.processes.get(pid), len(snap.daemons) == 1)]
        for pid in sorted((set(ps_rows) | set(unlisted)) & set(joined.mps_memory)):
            row, proc = ps_rows.get(pid), snap.processes.get(pid) or ProcessFacts(pid)
            try:
                c = _client_in_force(pid, row, proc, servers, d, joined, log_snap)
            except Exception as e:  # as in the client table: that client alone is left out
                client_left_out(d, pid, e)
                continue
            for gpu, used in c.memory:
                if used is None or not gpu.up:
                    continue
                found.append(ClientMemory(
                    d.name, pid, gpu.index, used, c.limits.pinned_bytes.get(gpu.index), gpu.memory_used_bytes,
                    gpu.memory_total_bytes, "" if row is None or row.server_pid is None else str(row.server_pid),
                    proc.pod_uid, proc.namespace, proc.pod, proc.container))
    return found
