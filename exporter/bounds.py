"""Where every label value comes from, and what bounds it. Declared once, here.

Any process on a node can write to the MPS log files, and users choose their
processes' names and cgroups: a label taken from there could otherwise grow the
series without bound (3,000 random exit statuses once made 3,001 series of
mps_server_exits_total). Every (metric, label) of the contract has exactly one
entry in LABELS (tests/test_bounds.py checks it against exporter/contract.py),
and docs/labels.md is `python -m mps_exporter.bounds` (checked by the same test).

The code that makes a label from input uses what is declared here:
`exit_status()`, `command_verb()`, and FamilyBuilder cuts every INPUT label value
to MAX_LABEL_CHARS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Dict, FrozenSet, Tuple

# Where a label's value comes from.
CONFIG = "configuration"  # the operator's flags or config file
FIXED = "fixed"  # a closed set in the code
DEVICE = "device"  # NVML: the GPUs and driver of the node
INPUT = "input"  # what processes and users on the node write: MPS logs, control output, /proc

OTHER = "other"  # the value of everything past a bound
MAX_LABEL_CHARS = 128  # any INPUT label value is cut to this many characters

# mps_server_exits_total{status}: what wait() can report is 0..255; anything else is "other".
EXIT_STATUSES = frozenset(str(n) for n in range(256))

# mps_control_commands_total{command}: MPS verbs are lower-case words; the first
# MAX_COMMAND_VERBS distinct ones are kept, the rest (typos in a control session) count as "other".
MAX_COMMAND_VERBS = 64
_VERB = re.compile(r"[a-z][a-z0-9_]{0,47}")


def exit_status(status: int) -> str:
    value = str(status)
    return value if value in EXIT_STATUSES else OTHER


def command_verb(verb: str, known: Collection[str]) -> str:
    """The label of a `Cmd:` verb, given the verbs already counted."""
    if not _VERB.fullmatch(verb):
        return OTHER
    if verb not in known and len(known) >= MAX_COMMAND_VERBS:
        return OTHER
    return verb


@dataclass(frozen=True)
class LabelBound:
    label: str
    metrics: Tuple[str, ...]  # the metrics whose `label` this entry covers
    origin: str  # CONFIG, FIXED, DEVICE or INPUT
    source: str  # where the value comes from
    bound: str  # what keeps the number of values (and their length) bounded


_GPU_METRICS = ("mps_gpu_info", "mps_gpu_up", "mps_gpu_memory_total_bytes", "mps_gpu_memory_used_bytes",
                "mps_gpu_utilization_ratio", "mps_gpu_memory_utilization_ratio", "mps_gpu_sm_active_ratio",
                "mps_gpu_sm_occupancy_ratio", "mps_gpu_tensor_active_ratio", "mps_gpu_dram_active_ratio",
                "mps_gpu_power_watts", "mps_gpu_temperature_celsius", "mps_gpu_sharing_mode",
                "mps_gpu_compute_processes", "mps_gpu_clients", "mps_process_sm_utilization_ratio")
# --mps.client-granularity pod and server: the clients summed per server and pod, or per server.
_POD_METRICS = ("mps_pod_clients", "mps_pod_client_memory_used_bytes", "mps_pod_client_pinned_memory_limit_bytes")
_SUM_METRICS = _POD_METRICS + ("mps_server_client_memory_used_bytes", "mps_server_client_pinned_memory_limit_bytes",
                               "mps_server_client_pinned_memory_usage_max_ratio")
_PER_GPU = ("mps_server_memory_used_bytes", "mps_server_sm_utilization_ratio", "mps_client_memory_used_bytes",
            "mps_pod_client_memory_used_bytes", "mps_server_client_memory_used_bytes")
_DAEMON_METRICS = (
    "mps_control_daemon_up", "mps_control_daemon_info", "mps_default_active_thread_ratio",
    "mps_default_pinned_memory_limit_bytes", "mps_server_info", "mps_server_status", "mps_server_clients",
    "mps_server_active_thread_ratio", "mps_server_pinned_memory_limit_bytes", "mps_server_memory_used_bytes",
    "mps_server_sm_utilization_ratio", "mps_server_start_time_seconds", "mps_client_info",
    "mps_client_memory_used_bytes", "mps_client_pinned_memory_limit_bytes", "mps_client_active_thread_ratio",
    "mps_client_start_time_seconds", "mps_client_priority", "mps_queued_clients", "mps_queued_client_oldest_wait_seconds",
    "mps_client_queue_wait_seconds", "mps_client_queue_wait_implausible_total", "mps_queued_clients_gone_total",
    "mps_server_handoffs_total",
    "mps_server_shutdown_deferrals_total", "mps_client_rejections_total", "mps_server_client_limit",
    "mps_client_connections_total", "mps_client_disconnections_total",
    "mps_server_starts_total", "mps_server_exits_total", "mps_server_exits_with_clients_total",
    "mps_server_start_failures_total",
    "mps_fatal_gpu_errors_total", "mps_control_commands_total", "mps_log_lines_total",
    "mps_log_unrecognized_lines_total", "mps_log_truncated_lines_total", "mps_log_read_errors_total",
    "mps_log_last_line_timestamp_seconds", "mps_exporter_control_commands_total") + _SUM_METRICS
_SERVER_METRICS = ("mps_server_info", "mps_server_status", "mps_server_clients", "mps_server_active_thread_ratio",
                   "mps_server_pinned_memory_limit_bytes", "mps_server_memory_used_bytes",
                   "mps_server_sm_utilization_ratio", "mps_server_start_time_seconds", "mps_client_info") + _SUM_METRICS
_CLIENT_METRICS = ("mps_client_info", "mps_client_memory_used_bytes", "mps_client_pinned_memory_limit_bytes",
                   "mps_client_active_thread_ratio", "mps_client_start_time_seconds", "mps_client_priority")
_LOG_FILE_METRICS = ("mps_log_lines_total", "mps_log_unrecognized_lines_total", "mps_log_truncated_lines_total",
                     "mps_log_read_errors_total", "mps_log_last_line_timestamp_seconds")
_CUT = f"cut to {MAX_LABEL_CHARS} characters"

LABELS: Tuple[LabelBound, ...] = (
    LabelBound("gpu", _GPU_METRICS + _PER_GPU + ("mps_default_pinned_memory_limit_bytes",
                                                  "mps_server_pinned_memory_limit_bytes",
                                                  "mps_client_pinned_memory_limit_bytes",
                                                  "mps_pod_client_pinned_memory_limit_bytes",
                                                  "mps_server_client_pinned_memory_limit_bytes",
                                                  "mps_server_client_pinned_memory_usage_max_ratio"),
               DEVICE, "NVML device index; pinned limits: the device ordinal MPS names",
               "the node's GPUs (log-only ordinals: those of running servers)"),
    LabelBound("uuid", _GPU_METRICS + _PER_GPU, DEVICE, "NVML", "one per GPU"),
    LabelBound("name", ("mps_gpu_info",), DEVICE, "NVML", "one per GPU"),
    LabelBound("driver_version", ("mps_gpu_info",), DEVICE, "NVML", "one per node"),
    LabelBound("compute_mode", ("mps_gpu_info",), DEVICE, "NVML", "NVML's compute modes"),
    LabelBound("mig_mode", ("mps_gpu_info",), DEVICE, "NVML", "enabled or disabled"),
    LabelBound("mode", ("mps_gpu_sharing_mode",), FIXED, "the exporter's classification",
               "mps, time_slicing, exclusive, mig, idle"),
    LabelBound("pid", ("mps_process_sm_utilization_ratio",), INPUT, "NVML's process list of a GPU not under MPS",
               "processes running on the GPU now; gone when they end"),
    LabelBound("daemon", _DAEMON_METRICS, CONFIG, "`--config.file` daemon names (default `default`)",
               "the configured daemons"),
    LabelBound("version", ("mps_control_daemon_info",), INPUT, "`nvidia-cuda-mps-control -v`",
               f"one per daemon; {_CUT}"),
    LabelBound("pipe_directory", ("mps_control_daemon_info",), CONFIG, "flag or config file", "one per daemon"),
    LabelBound("log_directory", ("mps_control_daemon_info",), CONFIG, "flag or config file", "one per daemon"),
    LabelBound("server_pid", _SERVER_METRICS, INPUT,
               "control daemon `get_server_list` / `ps`, else the logs' running servers",
               "running servers (the logs remember at most 1024)"),
    LabelBound("uid", ("mps_server_info", "mps_client_info"), INPUT, "/proc/PID/status, else the logs",
               "one per running server or client"),
    LabelBound("user", ("mps_server_info", "mps_client_info"), INPUT, "passwd name of the uid (else the uid)",
               f"one per running server or client; {_CUT}"),
    LabelBound("status", ("mps_server_status",), FIXED, "control daemon `get_server_status`",
               "ACTIVE, INITIALIZING, FAULT (anything else is a control error)"),
    LabelBound("status", ("mps_server_exits_total",), INPUT, "control.log `Server S exited with status X`",
               "0 to 255 (what wait() reports), everything else `other`: at most 257 per daemon"),
    LabelBound("pid", _CLIENT_METRICS, INPUT, "control daemon `ps`, NVML's MPS client list",
               "running clients (MPS admits at most 48 per GPU; the logs remember at most 4096)"),
    LabelBound("command", ("mps_client_info",), INPUT, "`ps` COMMAND column, else /proc/PID/comm",
               f"one per running client; {_CUT}"),
    LabelBound("pid_namespace", ("mps_client_info",), INPUT, "`ps` NAMESPACE column (a PID namespace)",
               f"one per running client; {_CUT}"),
    LabelBound("container_id", ("mps_client_info",), INPUT, "/proc/PID/cgroup (64 hex digits)",
               f"one per running client; {_CUT}"),
    LabelBound("pod_uid", ("mps_client_info",), INPUT, "/proc/PID/cgroup (a UUID)", f"one per running client; {_CUT}"),
    LabelBound("pod_uid", _POD_METRICS, INPUT, "/proc/PID/cgroup of the server's clients (a UUID, or empty)",
               f"pods with MPS clients running now, per server; {_CUT}"),
    LabelBound("reason", ("mps_queued_clients", "mps_client_queue_wait_seconds",
                          "mps_client_queue_wait_implausible_total"), FIXED, "the log state machine",
               "server_starting, user_switch"),
    LabelBound("reason", ("mps_client_rejections_total",), FIXED, "the log state machine (server.log refusals)",
               "client_limit, invalid_credentials, other"),
    LabelBound("command", ("mps_control_commands_total",), INPUT, "control.log `Cmd:<verb>`",
               f"`[a-z][a-z0-9_]{{0,47}}`, the first {MAX_COMMAND_VERBS} distinct verbs, then `other`: "
               f"at most {MAX_COMMAND_VERBS + 1} per daemon"),
    LabelBound("command", ("mps_exporter_control_commands_total",), FIXED,
               "the exporter's read-only verbs (sources/mps_control.py READ_ONLY_COMMANDS)",
               "one per read-only verb"),
    LabelBound("file", _LOG_FILE_METRICS, FIXED, "the log pipeline", "control, server"),
    LabelBound("reason", ("mps_log_read_errors_total",), FIXED, "the log follower",
               "missing_directory, not_a_directory, permission_denied, not_regular_file, io_error, internal_error"),
    LabelBound("version", ("mps_exporter_build_info",), FIXED, "the exporter's own version", "one"),
    LabelBound("python_version", ("mps_exporter_build_info",), FIXED, "the running Python", "one"),
    LabelBound("collector", ("mps_exporter_collector_success", "mps_exporter_collector_duration_seconds",
                             "mps_exporter_collector_last_success_timestamp_seconds",
                             "mps_exporter_collector_read_duration_seconds"), FIXED,
               "the exporter's collectors", "nvml, dcgm, control, proc, logs"),
)

# metric -> its labels whose values FamilyBuilder cuts to MAX_LABEL_CHARS
INPUT_LABELS: Dict[str, FrozenSet[str]] = {}
for _b in LABELS:
    if _b.origin == INPUT:
        for _m in _b.metrics:
            INPUT_LABELS[_m] = INPUT_LABELS.get(_m, frozenset()) | {_b.label}


def markdown() -> str:
    """The table of docs/labels.md."""
    rows = ["| label | metrics | origin | source | bound |", "| --- | --- | --- | --- | --- |"]
    for b in LABELS:
        metrics = ", ".join(b.metrics) if len(b.metrics) <= 4 else f"{len(b.metrics)} metrics ({b.metrics[0]}, ...)"
        rows.append(f"| {b.label} | {metrics} | {b.origin} | {b.source} | {b.bound} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
