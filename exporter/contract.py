"""The metric contract as data: the one source of metric names, types, labels and help.

Every family the exporter publishes is declared here once: name, type, help and
label names. The collector builds families only through `FamilyBuilder`, which
refuses undeclared names and wrong label sets, so the exposition cannot drift
from the contract. README's metric table is generated from this module
(`mps-exporter metrics --markdown`) and a test compares it with METRICS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

GAUGE = "gauge"
COUNTER = "counter"
HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    labels: Tuple[str, ...]
    help: str
    table: str
    label_set: FrozenSet[str] = frozenset()  # the labels as a set, for the per-sample check


def _specs(table: str, *rows: Tuple[str, str, str, str]) -> Dict[str, MetricSpec]:
    out = {}
    for name, mtype, labels, help_text in rows:
        names = tuple(l.strip() for l in labels.split(",") if l.strip())
        out[name] = MetricSpec(name, mtype, names, help_text, table, frozenset(names))
    return out


GPU = "gpu, uuid"

METRICS: Dict[str, MetricSpec] = {}
METRICS.update(_specs(
    "GPU",
    ("mps_gpu_info", GAUGE, "gpu, uuid, name, driver_version, compute_mode, mig_mode", "Static facts about a GPU (value 1)."),
    ("mps_gpu_up", GAUGE, GPU, "1 if NVML answered for this GPU in this scrape."),
    ("mps_gpu_memory_total_bytes", GAUGE, GPU, "Total device memory."),
    ("mps_gpu_memory_used_bytes", GAUGE, GPU, "Used device memory."),
    ("mps_gpu_utilization_ratio", GAUGE, GPU, "NVML GPU utilization: share of time any kernel ran. Saturates with one tiny kernel stream; not a contention signal under MPS."),
    ("mps_gpu_memory_utilization_ratio", GAUGE, GPU, "NVML memory controller busy ratio."),
    ("mps_gpu_sm_active_ratio", GAUGE, GPU, "Share of SMs busy over the last interval (NVML GPM or DCGM field 1002)."),
    ("mps_gpu_sm_occupancy_ratio", GAUGE, GPU, "SM occupancy over the last interval (NVML GPM or DCGM field 1003)."),
    ("mps_gpu_tensor_active_ratio", GAUGE, GPU, "Tensor pipe activity over the last interval (NVML GPM any-tensor or DCGM field 1004)."),
    ("mps_gpu_dram_active_ratio", GAUGE, GPU, "DRAM bandwidth activity over the last interval (NVML GPM or DCGM field 1005)."),
    ("mps_gpu_power_watts", GAUGE, GPU, "Power draw."),
    ("mps_gpu_temperature_celsius", GAUGE, GPU, "GPU core temperature."),
    ("mps_gpu_sharing_mode", GAUGE, "gpu, uuid, mode", "How the GPU is shared: mps, time_slicing, exclusive, mig or idle (value 1)."),
    ("mps_gpu_compute_processes", GAUGE, GPU, "Compute processes NVML lists on the GPU (MPS server and clients included)."),
    ("mps_gpu_clients", GAUGE, GPU, "MPS client processes on the GPU (NVML's MPS process list), at every --mps.client-granularity."),
    ("mps_process_sm_utilization_ratio", GAUGE, "gpu, uuid, pid", "Per-process SM utilization on GPUs not under MPS (under MPS NVML attributes it all to the server)."),
))
METRICS.update(_specs(
    "MPS control daemon",
    ("mps_control_daemon_up", GAUGE, "daemon", "1 if the MPS control daemon answered a control command in this scrape."),
    ("mps_control_daemon_info", GAUGE, "daemon, version, pipe_directory, log_directory", "Facts about a watched MPS control daemon (value 1)."),
    ("mps_default_active_thread_ratio", GAUGE, "daemon", "get_default_active_thread_percentage / 100."),
    ("mps_default_pinned_memory_limit_bytes", GAUGE, "daemon, gpu", "get_default_device_pinned_mem_limit; absent where none is set."),
))
METRICS.update(_specs(
    "MPS servers",
    ("mps_server_info", GAUGE, "daemon, server_pid, uid, user", "A running MPS server (value 1)."),
    ("mps_server_status", GAUGE, "daemon, server_pid, status", "Server status as the daemon reports it: ACTIVE, INITIALIZING or FAULT (value 1)."),
    ("mps_server_clients", GAUGE, "daemon, server_pid", "Client processes connected to the server."),
    ("mps_server_active_thread_ratio", GAUGE, "daemon, server_pid", "The server's active thread percentage now / 100: binds clients that connect from now on, not those already connected."),
    ("mps_server_pinned_memory_limit_bytes", GAUGE, "daemon, server_pid, gpu", "The server's pinned device memory limit now (get_device_pinned_mem_limit): binds clients that connect from now on, not those already connected; absent where none is set."),
    ("mps_server_memory_used_bytes", GAUGE, "daemon, server_pid, gpu, uuid", "Device memory held by the server process itself."),
    ("mps_server_sm_utilization_ratio", GAUGE, "daemon, server_pid, gpu, uuid", "NVML per-process SM utilization of the server PID; under MPS this is all of its clients' SM time."),
    ("mps_server_start_time_seconds", GAUGE, "daemon, server_pid", "Unix time the server became ready."),
))
METRICS.update(_specs(
    "MPS clients",
    ("mps_client_info", GAUGE, "daemon, server_pid, pid, uid, user, command, pid_namespace, container_id, pod_uid", "A connected MPS client process (value 1); pid_namespace is the PID namespace `ps` shows (not a Kubernetes namespace); container_id and pod_uid empty where the cgroup shows none."),
    ("mps_client_memory_used_bytes", GAUGE, "daemon, pid, gpu, uuid", "Device memory of the client, from NVML's MPS process list."),
    ("mps_client_pinned_memory_limit_bytes", GAUGE, "daemon, pid, gpu", "Pinned memory limit that binds the client: its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, else its server's limit as it was when the client connected (MPS logs; the server's limit now where the logs do not show the connection); absent where none applies."),
    ("mps_client_active_thread_ratio", GAUGE, "daemon, pid", "Active thread limit that binds the client / 100: the smaller of its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and its server's percentage when it connected (MPS logs; the server's now where the logs do not show the connection)."),
    ("mps_client_priority", GAUGE, "daemon, pid", "The client's CUDA_MPS_CLIENT_PRIORITY (0 normal, 1 below normal); absent where unset or unreadable."),
    ("mps_client_start_time_seconds", GAUGE, "daemon, pid", "Unix time the client connected."),
))
METRICS.update(_specs(
    "MPS clients summed per server and pod (--mps.client-granularity pod)",
    ("mps_pod_clients", GAUGE, "daemon, server_pid, pod_uid", "MPS client processes of the server in the pod (pod_uid empty: processes in no pod); replaces the per-client series with --mps.client-granularity pod."),
    ("mps_pod_client_memory_used_bytes", GAUGE, "daemon, server_pid, pod_uid, gpu, uuid", "Device memory of the server's clients in the pod, summed."),
    ("mps_pod_client_pinned_memory_limit_bytes", GAUGE, "daemon, server_pid, pod_uid, gpu", "Pinned memory limits in force for the server's clients in the pod, summed (clients without a limit add nothing)."),
))
METRICS.update(_specs(
    "MPS clients summed per server (--mps.client-granularity server)",
    ("mps_server_client_memory_used_bytes", GAUGE, "daemon, server_pid, gpu, uuid", "Device memory of the server's clients, summed (server_pid empty: clients NVML lists that no server's `ps` row names); with mps_server_clients, replaces the per-client series with --mps.client-granularity server."),
    ("mps_server_client_pinned_memory_limit_bytes", GAUGE, "daemon, server_pid, gpu", "Pinned memory limits in force for the server's clients, summed (clients without a limit add nothing)."),
    ("mps_server_client_pinned_memory_usage_max_ratio", GAUGE, "daemon, server_pid, gpu", "The largest share of its pinned memory limit that one of the server's clients uses on the GPU (clients without a limit left out): what a sum would hide."),
))
METRICS.update(_specs(
    "Queueing and contention",
    ("mps_queued_clients", GAUGE, "daemon, reason", "Clients on the daemon's pending list: reason server_starting (no server yet, same user) or user_switch (another user's server must drain first)."),
    ("mps_queued_client_oldest_wait_seconds", GAUGE, "daemon", "Age of the oldest pending client; 0 when none (a push dated more than a day back or in the future, a corrupt line or a clock step, is left out, as in mps_client_queue_wait_implausible_total)."),
    ("mps_client_queue_wait_seconds", HISTOGRAM, "daemon, reason", "Time from 'pushed to pending list' to admission."),
    ("mps_queued_clients_gone_total", COUNTER, "daemon", "Queued clients whose process was gone before a server took them (killed or cancelled while waiting): the logs never say so, the exporter asks /proc where it shares the daemon's PID namespace."),
    ("mps_client_queue_wait_implausible_total", COUNTER, "daemon, reason", "Queue waits outside 0 s to 1 day (a clock step or a corrupt timestamp): counted here instead of in mps_client_queue_wait_seconds."),
    ("mps_server_handoffs_total", COUNTER, "daemon", "Servers shut down so that another user's server could start."),
    ("mps_server_shutdown_deferrals_total", COUNTER, "daemon", "'Server will not shutdown' answers while another user waits."),
    ("mps_client_rejections_total", COUNTER, "daemon, reason", "Client connections a server refused (server.log); reason client_limit: 'Maximum number of clients (N) reached' (the client fails with cudaErrorDevicesUnavailable after about 28 s); invalid_credentials: 'User did not send valid credentials' (driver 580: the connection of a client killed while queued, handed to its user's new server)."),
    ("mps_server_client_limit", GAUGE, "daemon", "Clients per device the server accepts, as its last refusal said ('Maximum number of clients (N) reached'); absent until a refusal."),
))
METRICS.update(_specs(
    "From the MPS logs",
    ("mps_client_connections_total", COUNTER, "daemon", "Client processes that connected (once per process, whatever its contexts)."),
    ("mps_client_disconnections_total", COUNTER, "daemon", "Client processes that disconnected."),
    ("mps_server_starts_total", COUNTER, "daemon", "Servers that became ready."),
    ("mps_server_exits_total", COUNTER, "daemon, status", "Servers that exited, by exit status."),
    ("mps_server_exits_with_clients_total", COUNTER, "daemon", "Servers that exited while clients were still connected (killed or crashed under them: the clients lost their work). control.log says 'exited with status 0' for these too."),
    ("mps_server_start_failures_total", COUNTER, "daemon", "Servers that failed to start."),
    ("mps_fatal_gpu_errors_total", COUNTER, "daemon", "Fatal GPU errors a server handled."),
    ("mps_control_commands_total", COUNTER, "daemon, command", "Commands the control daemon received, by verb (the exporter's own included)."),
    ("mps_log_lines_total", COUNTER, "daemon, file", "Log lines read (file control or server)."),
    ("mps_log_unrecognized_lines_total", COUNTER, "daemon, file", "Log lines no rule matched."),
    ("mps_log_truncated_lines_total", COUNTER, "daemon, file", "Log lines longer than the line cap; cut to the cap before parsing."),
    ("mps_log_last_line_timestamp_seconds", GAUGE, "daemon, file", "Time written on the newest line read from the file: a log that stopped moving. control.log also logs the exporter's own commands."),
    ("mps_log_read_errors_total", COUNTER, "daemon, file, reason", "Times reading a log file began to fail: reason missing_directory, not_a_directory, permission_denied, not_regular_file, io_error or internal_error. While one lasts, collector_success{collector=\"logs\"} is 0."),
))
METRICS.update(_specs(
    "The exporter itself",
    ("mps_exporter_build_info", GAUGE, "version, python_version", "Build facts (value 1)."),
    ("mps_exporter_collector_success", GAUGE, "collector", "1 if the collector's source answered in this scrape."),
    ("mps_exporter_collector_duration_seconds", GAUGE, "collector", "Time the collector took in this scrape."),
    ("mps_exporter_collector_last_success_timestamp_seconds", GAUGE, "collector", "Time of the collection whose reading of the source is the latest complete one. Older than the scrape when the source failed or was late: its series are then that reading, or absent."),
    ("mps_exporter_collector_read_duration_seconds", HISTOGRAM, "collector", "Time each read of the source took, reads that finished after their scrape's deadline included."),
    ("mps_exporter_control_commands_total", COUNTER, "daemon, command", "Commands the exporter sent to the control daemon, by verb. MPS echoes each into control.log, which it never rotates (about 5 lines; ps one more per client): at a steady state the exporter sends get_server_list alone (docs/logs.md)."),
))

# Histogram buckets of mps_exporter_collector_read_duration_seconds: 1 ms to 10 s.
READ_DURATION_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Histogram buckets of mps_client_queue_wait_seconds: 50 ms to 10 min.
QUEUE_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)
# A queue wait longer than this, or negative, is a clock step or a corrupt timestamp.
MAX_PLAUSIBLE_QUEUE_WAIT = 86400.0


def markdown_table() -> str:
    """The contract as README's Markdown tables (`mps-exporter metrics`)."""
    rows: List[str] = []
    table: Optional[str] = None
    for spec in METRICS.values():
        if spec.table != table:
            table = spec.table
            rows += ["", f"### {table}", "", "| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
        rows.append(f"| {spec.name} | {spec.type} | {', '.join(spec.labels)} | {spec.help} |")
    return "\n".join(rows).lstrip("\n") + "\n"
