"""The contract's families of one collection: a view of its rows (join.py).

A pure function of a `Snapshot`: no I/O, no clock, so golden tests and replay
produce the same exposition the live exporter did. One part per table of the
contract: the exporter itself, GPUs, daemons, servers, clients, logs. Each joined
metric is declared here and emitted by one line from a row field; the pod and server
granularities are folds over the client rows.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import platform
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import __version__
from .contract import (CLIENT_PID, CUT, DAEMON, DEVICE, FIXED, GPU, INPUT, SERVER_PID, UID, USER, UUID, Label,
                       counter, gauge, histogram, table)
from .families import FamilyBuilder, SeriesSink
from prometheus_client.samples import Sample
from . import limits as lim
from .exitstatus import OUTCOMES
from .logs.render import render_log_metrics
from .runtime_metadata import CONTAINER, NAMES_SOURCE as _NAMES_SOURCE, NAMESPACE, OWNER, POD
from .join import (ClientMemory, ClientRow, DaemonRow, GpuRow, Rows, ServerRow, client_left_out, client_memory,
                   reading_fields, rows_of, sharing_mode, sm_utilization)
from .model import EDGE_REASONS, EdgeReport, LogSnapshot, Outcome, Snapshot

__all__ = ["ClientMemory", "FamilyBuilder", "Outcome", "Snapshot", "client_memory", "readings_key", "render",
           "render_readings", "sharing_mode", "sm_utilization"]

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
    gauge("mps_client_pinned_memory_usage_ratio", "Device memory of the client over the pinned memory limit that "
          "binds it on that GPU (mps_client_memory_used_bytes / mps_client_pinned_memory_limit_bytes, from the same "
          "reading); absent where no limit applies.", DAEMON, *CLIENT, GPU, UUID),
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
    counter("mps_client_exits_at_memory_limit_total", "MPS clients that exited while a memory reading of their last 30 s was "
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
            "not know, by verb: its `Unknown command` answers (R470: ps, get_server_status, pinned memory "
            "limits, the default client priority; R535: get_server_status), and each command the exporter did not "
            "send since because of one (asked again when the daemon restarts). Each costs its field (a limit, a "
            "percentage, a priority, a status; without ps a client's command and PID namespace), never the "
            "daemon's servers and clients.", DAEMON, COMMAND),
)


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
    `memo`: the client tables of the last call, reused where their rows are equal."""
    rows = rows_of(snap)
    render_rows(out, rows, granularity, memo)
    if snap.edges is not None:
        render_edges(out, snap.edges, rows.uuids, granularity, memo)
    if memo is None:
        for name, log_snap in snap.logs.items():
            render_log_metrics(out, name, log_snap, snap.now)
    else:
        memo.render_logs(out, snap.logs, snap.now)
    for render_own in own_renders:
        render_own(out, snap)


def render_rows(out: FamilyBuilder, rows: Rows, granularity: str = "client",
                memo: Optional["ClientTableMemo"] = None) -> None:
    """The joined tables: GPUs, daemons, servers, and the clients at `granularity`."""
    uuids = rows.uuids
    for gpu in rows.gpus:
        emit_gpu(out, gpu, None if memo is None else memo.gpus.setdefault((gpu.index, gpu.uuid), {}))
    clients = memo if memo is not None else ClientTableMemo()
    for d in rows.daemons:
        emit_daemon(out, d)
        for server in d.servers:
            emit_server(out, server, uuids)
        if granularity == "client":
            clients.render_clients(out, d, uuids)
        else:
            emit_sums(out, d, fold_clients(d.clients, by_pod=granularity == "pod"), uuids)
    if memo is not None:
        memo.keep_only({d.name for d in rows.daemons}, {(g.index, g.uuid) for g in rows.gpus})


def readings_key(snap: Snapshot, granularity: str) -> Tuple[object, ...]:
    """What `render_readings` depends on: equal keys, equal families. The readings are
    never changed once read (every source returns new objects), and the clock enters
    only through the oldest queued client's wait."""
    waits = tuple(log.oldest_queued_wait(snap.now) for log in snap.logs.values() if log.pending)
    return (granularity, snap.nvml, snap.dcgm, snap.daemons, snap.processes, snap.logs, snap.extra, waits,
            snap.edges)


# ---------------------------------------------------------------- the exporter
def render_self(out: SeriesSink, snap: Snapshot) -> None:
    """The exporter's own series: they change in every scrape, so the encoded readings
    (collector.Exposition) leave them out and readings_key ignores them; their values
    are written into the last encoding of the same series (a SeriesRecorder's shape)."""
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
def emit_gpu(out: FamilyBuilder, g: GpuRow, kept: Optional[Dict[str, Sample]] = None) -> None:
    """The GPU's series. `kept`: the GPU's samples labelled by it alone as last emitted,
    reused where their value is the same (the GPU's numbers move a few at a time)."""
    ids = {"gpu": g.index, "uuid": g.uuid}

    def value(name: str, number: Optional[float]) -> None:  # a series labelled by the GPU alone
        if kept is None or number is None:
            out.add(name, number, **ids)
            return
        last = kept.get(name)
        number = float(number)
        if last is None or number != number:
            out.add(name, number, **ids)
            if number == number:
                kept[name] = out.last(name)
            return
        if last.value != number or math.copysign(1.0, last.value) != math.copysign(1.0, number):
            last = kept[name] = last._replace(value=number)  # the same labels
        out.extend(name, (last,))

    value("mps_gpu_up", int(g.up))
    if not g.up:  # NVML did not answer for it: nothing else is known
        return
    out.add("mps_gpu_info", 1, **ids, name=g.name, driver_version=g.driver_version, compute_mode=g.compute_mode,
            mig_mode=g.mig_mode)
    value("mps_gpu_memory_total_bytes", g.memory_total_bytes)
    value("mps_gpu_memory_used_bytes", g.memory_used_bytes)
    value("mps_gpu_utilization_ratio", g.utilization_ratio)
    value("mps_gpu_memory_utilization_ratio", g.memory_utilization_ratio)
    value("mps_gpu_power_watts", g.power_watts)
    value("mps_gpu_temperature_celsius", g.temperature_celsius)
    value("mps_gpu_sm_active_ratio", g.sm_active_ratio)
    value("mps_gpu_sm_occupancy_ratio", g.sm_occupancy_ratio)
    value("mps_gpu_tensor_active_ratio", g.tensor_active_ratio)
    value("mps_gpu_dram_active_ratio", g.dram_active_ratio)
    out.add("mps_gpu_sharing_mode", 1, **ids, mode=g.sharing_mode)
    value("mps_gpu_compute_processes", g.compute_processes)
    value("mps_gpu_clients", g.clients)
    value("mps_gpu_processes_outside_mps", len(g.outside_mps))
    for p in g.outside_mps:
        out.add("mps_process_outside_mps_info", 1, **ids, pid=p.pid, uid=p.uid, user=p.user, command=p.command,
                container_id=p.container_id, pod_uid=p.pod_uid, namespace=p.namespace, pod=p.pod,
                container=p.container)
        out.add("mps_process_outside_mps_memory_used_bytes", p.memory_used_bytes, **ids, pid=p.pid)
    for pid, ratio in g.process_sm_utilization.items():
        out.add("mps_process_sm_utilization_ratio", ratio, **ids, pid=pid)


# ---------------------------------------------------------------- daemons
def _flag(value: Optional[bool]) -> str:
    return "" if value is None else str(value).lower()


def emit_daemon(out: FamilyBuilder, d: DaemonRow) -> None:
    out.add("mps_control_daemon_up", int(d.up), daemon=d.name)
    out.add("mps_control_daemon_info", 1, daemon=d.name, version=d.version, pipe_directory=d.pipe_directory,
            log_directory=d.log_directory, claim_uid=d.claim_uid, multiuser=_flag(d.multiuser))
    out.add("mps_default_active_thread_ratio", d.default_active_thread_ratio, daemon=d.name)
    for gpu, limit in d.default_pinned_memory_limit_bytes.items():
        out.add("mps_default_pinned_memory_limit_bytes", limit, daemon=d.name, gpu=gpu)
    out.add("mps_default_client_priority", d.default_client_priority, daemon=d.name)


# ---------------------------------------------------------------- servers
def emit_server(out: FamilyBuilder, s: ServerRow, uuids: Mapping[int, str]) -> None:
    sp = {"daemon": s.daemon, "server_pid": s.pid}
    out.add("mps_server_info", 1, **sp, uid=s.uid, user=s.user)
    out.add("mps_server_status", 1 if s.status else None, **sp, status=s.status)
    out.add("mps_server_clients", s.clients, **sp)
    out.add("mps_server_active_thread_ratio", s.active_thread_ratio, **sp)
    for gpu, limit in s.pinned_memory_limit_bytes.items():
        out.add("mps_server_pinned_memory_limit_bytes", limit, **sp, gpu=gpu)
    out.add("mps_server_start_time_seconds", s.start_time, **sp)
    out.add("mps_server_priority", s.priority, **sp)
    for gpu, uuid in uuids.items():
        out.add("mps_server_memory_used_bytes", s.memory_used_bytes.get(gpu), **sp, gpu=gpu, uuid=uuid)
        out.add("mps_server_sm_utilization_ratio", s.sm_utilization_ratio.get(gpu), **sp, gpu=gpu, uuid=uuid)


# ---------------------------------------------------------------- clients
def client_labels(c: ClientRow) -> Dict[str, object]:
    """The labels of every per-client series."""
    return {"daemon": c.daemon, "pid": c.pid, "namespace": c.namespace, "pod": c.pod, "container": c.container}


def emit_client(out: FamilyBuilder, c: ClientRow, uuids: Mapping[int, str]) -> None:
    cp = client_labels(c)
    out.add("mps_client_info", 1, **cp, server_pid=c.server_pid, uid=c.uid, user=c.user, command=c.command,
            pid_namespace=c.pid_namespace, container_id=c.container_id, pod_uid=c.pod_uid, owner=c.owner)
    emit_client_readings(out, c, cp, uuids)
    for gpu, limit in c.pinned_memory_limit_bytes.items():
        out.add("mps_client_pinned_memory_limit_bytes", limit, **cp, gpu=gpu)
    out.add("mps_client_active_thread_ratio", c.active_thread_ratio, **cp)
    out.add("mps_client_priority", c.priority, **cp)
    out.add("mps_client_limit_source", 1, **cp, **c.limit_sources)
    for what, reason in c.ignored_limits.items():
        out.add("mps_client_limit_ignored", 1, **cp, limit=what, reason=reason)
    out.add("mps_client_start_time_seconds", c.start_time, **cp)


def _reading_values(c: ClientRow) -> Iterator[Tuple[str, int, float]]:
    """(family, GPU index, value) of each series of the client's READING fields (join.py)
    alone: what moves while the rest of its row stands still."""
    for gpu, used in c.memory_used_bytes.items():
        yield "mps_client_memory_used_bytes", gpu, used
        limit = c.pinned_memory_limit_bytes.get(gpu)
        if limit:  # the rules' and alerts' ratio, without a join in Prometheus (issue 44)
            yield "mps_client_pinned_memory_usage_ratio", gpu, used / limit


def emit_client_readings(out: FamilyBuilder, c: ClientRow, cp: Mapping[str, object], uuids: Mapping[int, str]) -> None:
    for name, gpu, value in _reading_values(c):
        out.add(name, value, **cp, gpu=gpu, uuid=uuids[gpu])


ClientParts = List[Tuple[str, List[Sample]]]
# A client row's fields but its READING ones, as a tuple.
_facts = operator.attrgetter(*(f.name for f in dataclasses.fields(ClientRow) if f.name not in reading_fields(ClientRow)))


@dataclass
class _Rendered:
    row: ClientRow
    parts: ClientParts
    readings: FrozenSet[str]  # the families of emit_client_readings among the parts
    _reading_samples: Optional[Dict[Tuple[str, str], Sample]] = None

    def reading_samples(self) -> Dict[Tuple[str, str], Sample]:
        """The samples of the reading families by (family, GPU label)."""
        if self._reading_samples is None:
            self._reading_samples = {(name, str(sample.labels["gpu"])): sample for name, samples in self.parts
                                     if name in self.readings for sample in samples}
        return self._reading_samples


class ClientTableMemo:
    """Each client's series as last rendered, with the row they were rendered from.

    The clients' rows mostly stay the same from one scrape to the next while the GPU
    numbers and the log counters move; in a storm a few clients change at a time, and on
    a busy node their memory moves and nothing else. A client's series are reused where its
    row is equal; where only its READING fields moved, those families alone are emitted
    again. The samples are shared, never changed."""

    def __init__(self) -> None:
        self._clients: Dict[str, Dict[int, _Rendered]] = {}  # daemon -> pid -> ...
        # daemon -> its client rows and their families, for the very same rows again (the
        # join keeps a daemon's tuple while nothing it is derived from changed)
        self._tables: Dict[str, Tuple[Tuple[ClientRow, ...], ClientParts]] = {}
        self._uuids: Dict[int, str] = {}
        # The exit tracker's peak of each client, its sample by (peak entry, GPU UUID).
        self.peaks: Dict[Tuple[object, ...], Sample] = {}
        # The last edges rendered (the report, the UUIDs, the granularity) and their families.
        self.edges: Optional[Tuple[EdgeReport, Dict[int, str], str]] = None
        self.edge_parts: ClientParts = []
        # Each GPU's (index, UUID) samples labelled by it alone, as emit_gpu last emitted them.
        self.gpus: Dict[Tuple[int, str], Dict[str, Sample]] = {}
        # daemon -> its log pipeline's snapshot last rendered, and its families (render_logs)
        self.logs: Dict[str, Tuple[LogSnapshot, ClientParts]] = {}

    def render_logs(self, out: FamilyBuilder, logs: Mapping[str, LogSnapshot], now: float) -> None:
        """Each daemon's log families; daemons no longer read are forgotten. The pipeline
        publishes a new snapshot when lines change it, so the very same one with nobody
        queued (whose series alone follow the clock) gives the samples of last time: a
        scrape whose GPU readings moved renders them again, not the log counters that did
        not (issue 44)."""
        before, self.logs = self.logs, {}
        for daemon, snap in logs.items():
            kept = before.get(daemon)
            if kept is None or kept[0] is not snap or snap.pending:
                part = FamilyBuilder()
                render_log_metrics(part, daemon, snap, now)
                kept = (snap, part.parts())
            self.logs[daemon] = kept
            for name, samples in kept[1]:
                out.extend(name, samples)

    def render_clients(self, out: FamilyBuilder, d: DaemonRow, uuids: Mapping[int, str]) -> None:
        """The daemon's client rows. A client whose series cannot be rendered is left out
        whole (none of its series), and logged; not tried again while its row stays."""
        if uuids != self._uuids:  # the memory series carry the GPUs' UUIDs
            self._clients, self._tables, self._uuids = {}, {}, dict(uuids)
        table = self._tables.get(d.name)
        if table is not None and table[0] is d.clients:
            for name, samples in table[1]:
                out.extend(name, samples)
            return
        before = self._clients.get(d.name, {})
        now: Dict[int, _Rendered] = {}
        families: Dict[str, List[Sample]] = {}  # in the order emit_client adds them
        for c in d.clients:
            kept = before.get(c.pid)
            if kept is None or (kept.row is not c and kept.row != c):
                kept = _render_client(c, uuids, kept)
            now[c.pid] = kept
            for name, samples in kept.parts:
                families.setdefault(name, []).extend(samples)
        self._clients[d.name] = now  # clients gone are forgotten
        self._tables[d.name] = (d.clients, list(families.items()))
        for name, samples in families.items():
            out.extend(name, samples)

    def keep_only(self, names: AbstractSet[str], gpus: AbstractSet[Tuple[int, str]] = frozenset()) -> None:
        """Forget the clients of daemons no longer read, and the GPUs no longer there."""
        self._clients = {name: kept for name, kept in self._clients.items() if name in names}
        self._tables = {name: kept for name, kept in self._tables.items() if name in names}
        self.gpus = {gpu: kept for gpu, kept in self.gpus.items() if gpu in gpus}


def _moved_readings(c: ClientRow, uuids: Mapping[int, str], before: _Rendered) -> Optional[_Rendered]:
    """The client rendered with its last samples' labels and the new values of its reading
    families, where the same series are emitted as before (the same families on the same
    GPUs); None where they are not, for the whole render to build them."""
    last = before.reading_samples()
    moved: Dict[str, List[Sample]] = {name: [] for name in before.readings}
    now: Dict[Tuple[str, str], Sample] = {}
    for name, gpu, value in _reading_values(c):
        value = float(value)
        if value != value:  # NaN: FamilyBuilder.add leaves it out
            return None
        sample = last.get((name, str(gpu)))
        if sample is None:
            return None
        now[name, str(gpu)] = sample = Sample(sample.name, sample.labels, value, None)
        moved[name].append(sample)
    if len(now) != len(last):
        return None
    return _Rendered(c, [(name, moved[name] if name in moved else samples) for name, samples in before.parts],
                     before.readings, now)


def _render_client(c: ClientRow, uuids: Mapping[int, str], before: Optional[_Rendered]) -> _Rendered:
    try:
        if before is not None and before.parts and _facts(before.row) == _facts(c):
            rendered = _moved_readings(c, uuids, before)
            if rendered is not None:  # only values moved: the labels checked before serve
                return rendered
        readings = FamilyBuilder()
        emit_client_readings(readings, c, client_labels(c), uuids)
        moved = dict(readings.parts())
        if before is not None and before.parts and frozenset(moved) == before.readings and \
                _facts(before.row) == _facts(c):
            return _Rendered(c, [(name, moved.get(name, samples)) for name, samples in before.parts], before.readings)
        part = FamilyBuilder()
        emit_client(part, c, uuids)
        return _Rendered(c, part.parts(), frozenset(moved))
    except Exception as e:  # left out, and not tried again while its row stays
        client_left_out(c.daemon, c.pid, e)
        return _Rendered(c, [], frozenset())


# ---------------------------------------------------------------- the clients summed
@dataclass
class ClientSums:
    """The client rows of a daemon folded per (server pid, pod uid) (pod uid "" per server)."""

    by_pod: bool
    counts: Dict[Tuple[str, str], int] = field(default_factory=dict)
    pod_names: Dict[str, Dict[str, str]] = field(default_factory=lambda: {"": {"namespace": "", "pod": ""}})
    memory: Dict[Tuple[str, str, int], int] = field(default_factory=dict)  # (server, pod, gpu index) -> bytes
    limits: Dict[Tuple[str, str, int], int] = field(default_factory=dict)
    fullest: Dict[Tuple[str, str, int], float] = field(default_factory=dict)  # largest memory / limit of one client
    ignored: Dict[Tuple[str, str, str], int] = field(default_factory=dict)  # (server, limit, reason) -> clients


def fold_clients(clients: Sequence[ClientRow], by_pod: bool) -> ClientSums:
    """The clients summed per server and (by_pod) pod: no pid label, so short-lived clients
    add no series. The fullest client's share of its limit is kept too: a sum over clients
    would hide one at its limit."""
    sums = ClientSums(by_pod)
    for c in clients:
        key = ("" if c.server_pid is None else str(c.server_pid), c.pod_uid if by_pod else "")
        sums.counts[key] = sums.counts.get(key, 0) + 1
        if by_pod and c.pod_uid and c.pod:
            sums.pod_names[c.pod_uid] = {"namespace": c.namespace, "pod": c.pod}
        for what, reason in c.ignored_limits.items():
            sums.ignored[(key[0], what, reason)] = sums.ignored.get((key[0], what, reason), 0) + 1
        for gpu, limit in c.pinned_memory_limit_bytes.items():
            sums.limits[key + (gpu,)] = sums.limits.get(key + (gpu,), 0) + limit
        for gpu, used in c.memory_used_bytes.items():
            sums.memory[key + (gpu,)] = sums.memory.get(key + (gpu,), 0) + used
            bound = c.pinned_memory_limit_bytes.get(gpu)
            if bound:
                sums.fullest[key + (gpu,)] = max(sums.fullest.get(key + (gpu,), 0.0), used / bound)
    return sums


def emit_sums(out: FamilyBuilder, d: DaemonRow, sums: ClientSums, uuids: Mapping[int, str]) -> None:
    for (server_pid, what, reason), n in sorted(sums.ignored.items()):
        out.add("mps_server_clients_limit_ignored", n, daemon=d.name, server_pid=server_pid, limit=what, reason=reason)
    if sums.by_pod:
        emit_pod_sums(out, d, sums, uuids)
    else:
        emit_server_sums(out, d, sums, uuids)


def emit_pod_sums(out: FamilyBuilder, d: DaemonRow, sums: ClientSums, uuids: Mapping[int, str]) -> None:
    names = sums.pod_names
    for (server_pid, pod_uid), count in sorted(sums.counts.items()):
        out.add("mps_pod_clients", count, daemon=d.name, server_pid=server_pid, pod_uid=pod_uid,
                **names.get(pod_uid, names[""]))
    for (server_pid, pod_uid, gpu), total in sorted(sums.memory.items()):
        out.add("mps_pod_client_memory_used_bytes", total, daemon=d.name, server_pid=server_pid, pod_uid=pod_uid,
                **names.get(pod_uid, names[""]), gpu=gpu, uuid=uuids[gpu])
    for (server_pid, pod_uid, gpu), limit_sum in sorted(sums.limits.items()):
        out.add("mps_pod_client_pinned_memory_limit_bytes", limit_sum, daemon=d.name, server_pid=server_pid,
                pod_uid=pod_uid, **names.get(pod_uid, names[""]), gpu=gpu)


def emit_server_sums(out: FamilyBuilder, d: DaemonRow, sums: ClientSums, uuids: Mapping[int, str]) -> None:
    for (server_pid, _, gpu), total in sorted(sums.memory.items()):
        out.add("mps_server_client_memory_used_bytes", total, daemon=d.name, server_pid=server_pid, gpu=gpu,
                uuid=uuids[gpu])
    for (server_pid, _, gpu), limit_sum in sorted(sums.limits.items()):
        out.add("mps_server_client_pinned_memory_limit_bytes", limit_sum, daemon=d.name, server_pid=server_pid,
                gpu=gpu)
    for (server_pid, _, gpu), ratio in sorted(sums.fullest.items()):
        out.add("mps_server_client_pinned_memory_usage_max_ratio", ratio, daemon=d.name, server_pid=server_pid,
                gpu=gpu)


# ---------------------------------------------------------------- memory at the edge
def render_edges(out: FamilyBuilder, edges: EdgeReport, uuids: Mapping[int, str], granularity: str,
                 memo: Optional["ClientTableMemo"] = None) -> None:
    """The exit tracker's counts (every granularity: no client labels) and peaks (per
    client at client granularity, per server and pod at pod granularity). `memo`: the
    peaks' samples of the last call, reused where a client's peak and names stayed, and
    the last call's families, for the very same report (the tracker's, while nothing in
    it changed)."""
    if memo is None:
        _render_edges(out, edges, uuids, granularity, None)
        return
    last = memo.edges
    if last is None or last[0] is not edges or last[1:] != (uuids, granularity):
        own = FamilyBuilder()
        _render_edges(own, edges, uuids, granularity, memo)
        memo.edges, memo.edge_parts = (edges, dict(uuids), granularity), own.parts()
    for name, samples in memo.edge_parts:
        out.extend(name, samples)


def _render_edges(out: FamilyBuilder, edges: EdgeReport, uuids: Mapping[int, str], granularity: str,
                  memo: Optional["ClientTableMemo"]) -> None:
    for (daemon, gpu, reason, outcome), n in edges.exits:
        out.add("mps_client_exits_at_memory_limit_total", n, daemon=daemon, gpu=str(gpu), reason=reason,
                outcome=outcome)
    if granularity == "client":
        name = "mps_client_memory_peak_bytes"
        peaks = memo.peaks if memo is not None else {}
        now: Dict[Tuple[object, ...], Sample] = {}
        for entry in edges.peaks:
            (daemon, pid, gpu), (namespace, pod, container, peak) = entry
            key = (entry, uuids.get(gpu, ""))
            sample = peaks.get(key)
            if sample is None:
                one = FamilyBuilder()
                one.add(name, peak, daemon=daemon, pid=str(pid), namespace=namespace, pod=pod, container=container,
                        gpu=str(gpu), uuid=key[1])
                built = one.parts()
                if not built:
                    continue
                sample = built[0][1][0]
            now[key] = sample
        if now:
            out.extend(name, list(now.values()))
        if memo is not None:
            memo.peaks = now  # the clients gone are forgotten
    elif granularity == "pod":
        for (daemon, server_pid, pod_uid, gpu), (namespace, pod, peak) in edges.pod_peaks:
            out.add("mps_pod_client_memory_peak_bytes", peak, daemon=daemon, server_pid=server_pid, pod_uid=pod_uid,
                    namespace=namespace, pod=pod, gpu=str(gpu), uuid=uuids.get(gpu, ""))
