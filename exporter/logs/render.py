"""A LogSnapshot -> the "Queueing and contention" and "From the MPS logs" families.

The per-server facts the logs carry (start time, uid, thread percentage, pinned
limits) are not rendered here: the collector joins them into the server and
client tables when the control daemon is slow or gone.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

from ..contract import (COUNTER, DAEMON, DECLARED, FIXED, INPUT, MAX_COMMAND_VERBS, Label, MetricSpec, counter, gauge,
                        histogram, table)
from ..families import FamilyBuilder
from ..model import REASONS, REJECTION_REASONS, LogSnapshot
from .events import FILES, READ_ERROR_REASONS, STATE_FILE_ERROR_REASONS

QUEUE_REASON = Label("reason", FIXED, "the log state machine", "server_starting, user_switch")
REJECTION_REASON = Label("reason", FIXED, "the log state machine (server.log refusals)",
                         "client_limit, invalid_credentials, other")
EXIT_STATUS = Label("status", INPUT, "control.log `Server S exited with status X`",
                    "0 to 255 (what wait() reports), everything else `other`: at most 257 per daemon")
COMMAND_VERB = Label("command", INPUT, "control.log `Cmd:<verb>`",
                     f"`[a-z][a-z0-9_]{{0,47}}`, the first {MAX_COMMAND_VERBS} distinct verbs, then `other`: "
                     f"at most {MAX_COMMAND_VERBS + 1} per daemon")
FILE = Label("file", FIXED, "the log pipeline", "control, server")
STATE_FILE_ERROR_REASON = Label("reason", FIXED, "the state file's checks", ", ".join(STATE_FILE_ERROR_REASONS))
READ_ERROR_REASON = Label("reason", FIXED, "the log follower",
                          "missing_directory, not_a_directory, permission_denied, not_regular_file, io_error, "
                          "internal_error")

QUEUE_METRICS = table(
    "Queueing and contention",
    gauge("mps_queued_clients", "Clients on the daemon's pending list: reason server_starting (no server yet, same "
          "user) or user_switch (another user's server must drain first).", DAEMON, QUEUE_REASON),
    histogram("mps_client_queue_wait_seconds", "Time from 'pushed to pending list' to admission.",
              DAEMON, QUEUE_REASON),
    counter("mps_client_queue_wait_implausible_total", "Queue waits outside 0 s to 1 day (a clock step or a corrupt "
            "timestamp): counted here instead of in mps_client_queue_wait_seconds.", DAEMON, QUEUE_REASON),
    gauge("mps_queued_client_oldest_wait_seconds", "Age of the oldest pending client; 0 when none (a push dated more "
          "than a day back or in the future, a corrupt line or a clock step, is left out, as in "
          "mps_client_queue_wait_implausible_total).", DAEMON),
    counter("mps_client_queue_pushes_total", "Clients the daemon pushed to its pending list to wait for a server "
            "('pushed to pending list'), whatever became of them: admitted (mps_client_queue_wait_seconds_count), "
            "gone, or still waiting.", DAEMON),
    counter("mps_queued_clients_gone_total", "Queued clients whose process was gone before a server took them "
            "(killed or cancelled while waiting): the logs never say so, the exporter asks /proc where it shares "
            "the daemon's PID namespace.", DAEMON),
    counter("mps_server_handoffs_total", "Servers shut down so that another user's server could start.", DAEMON),
    counter("mps_control_accept_failures_total", "Connections the control daemon could not accept (control.log "
            "'Unable to accept connection'): a client or control command that connected then got no answer.", DAEMON),
    counter("mps_server_shutdown_deferrals_total", "'Server will not shutdown' answers while another user waits.",
            DAEMON),
    counter("mps_client_rejections_total", "Client connections a server refused (server.log); reason client_limit: "
            "'Maximum number of clients (N) reached' or 'Reached maximum number of device connections' (the client fails with cudaErrorDevicesUnavailable after about "
            "28 s); invalid_credentials: 'User did not send valid credentials' (driver 580: the connection of a "
            "client killed while queued, handed to its user's new server).", DAEMON, REJECTION_REASON),
    gauge("mps_server_client_limit", "Clients per device the server accepts, as MPS enforced it at its last "
          "refusal: N of 'Maximum number of clients (N) reached', or the clients connected when it refused one with "
          "'Reached maximum number of device connections' (clients that raise CUDA_DEVICE_MAX_CONNECTIONS); absent "
          "until a refusal.", DAEMON),
)
LOG_METRICS = table(
    "From the MPS logs",
    counter("mps_client_connections_total", "Client processes that connected (once per process, whatever its "
            "contexts).", DAEMON),
    counter("mps_client_disconnections_total", "Client processes that disconnected.", DAEMON),
    counter("mps_server_starts_total", "Servers that became ready.", DAEMON),
    counter("mps_server_exits_total", "Servers that exited, by exit status.", DAEMON, EXIT_STATUS),
    counter("mps_server_exits_with_clients_total", "Servers that exited while clients were still connected (killed "
            "or crashed under them: the clients lost their work). control.log says 'exited with status 0' for these "
            "too.", DAEMON),
    counter("mps_server_start_failures_total", "Servers that failed to start.", DAEMON),
    counter("mps_fatal_gpu_errors_total", "Fatal GPU errors a server handled (13.x `Server is handling a fatal GPU "
            "error.`, 11.x/12.x the same behind `Volta MPS: `).", DAEMON),
    counter("mps_clients_terminated_total", "Client processes an operator ended with `terminate_client` (server.log "
            "`MPS server requesting client {PID: P, ...} to exit`): they fail with their next CUDA call.", DAEMON),
    counter("mps_control_commands_total", "Commands the control daemon received, by verb (the exporter's own "
            "included).", DAEMON, COMMAND_VERB),
    counter("mps_log_lines_total", "Log lines read (file control or server).", DAEMON, FILE),
    counter("mps_log_unrecognized_lines_total", "Log lines no rule matched.", DAEMON, FILE),
    counter("mps_log_truncated_lines_total", "Log lines longer than the line cap; cut to the cap before parsing.",
            DAEMON, FILE),
    gauge("mps_log_last_line_timestamp_seconds", "Time written on the newest line read from the file: a log that "
          "stopped moving. control.log also logs the exporter's own commands.", DAEMON, FILE),
    counter("mps_log_rotation_gaps_total", "Rotations after which lines of the file are missing: it was truncated "
            "(copytruncate) and no rotated copy beside it (control.log.1, a dated name) held the part not read yet, "
            "because it was compressed or removed first. Keep delaycompress (docs/logs.md, \"Rotation\").",
            DAEMON, FILE),
    counter("mps_exporter_state_file_errors_total", "Times the state file (--mps.state-file) was not trusted or not "
            "written: reason unreadable, shape, negative_counter, position (an offset past its file or other bytes "
            "before it), save_failed. Each doubt means the logs were read from their beginning instead.",
            STATE_FILE_ERROR_REASON),
    counter("mps_log_read_errors_total", "Times reading a log file began to fail: reason missing_directory, "
            "not_a_directory, permission_denied, not_regular_file, io_error or internal_error. While one lasts, "
            "collector_success{collector=\"logs\"} is 0.", DAEMON, FILE, READ_ERROR_REASON),
)


Emit = Callable[[FamilyBuilder, str, LogSnapshot, float], None]


def _queued(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for reason in REASONS:
        out.add("mps_queued_clients", snap.queued.get(reason, 0), daemon=daemon, reason=reason)


def _queue_wait(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for reason in REASONS:
        hist = snap.queue_wait[reason]
        out.add_histogram("mps_client_queue_wait_seconds", hist.cumulative(), hist.total, daemon=daemon, reason=reason)


def _implausible(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for reason in REASONS:
        out.add("mps_client_queue_wait_implausible_total", snap.queue_wait[reason].implausible, daemon=daemon,
                reason=reason)


def _rejections(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for reason in REJECTION_REASONS:  # client_limit always (from 0, so rate() sees the first one)
        n = snap.rejections.get(reason, 0)
        if n or reason == "client_limit":
            out.add("mps_client_rejections_total", n, daemon=daemon, reason=reason)


def _one(name: str, value: Callable[[LogSnapshot, float], Optional[float]]) -> Emit:
    def emit(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
        out.add(name, value(snap, now), daemon=daemon)
    return emit


def _by_label(name: str, label: str, counts: Callable[[LogSnapshot], Mapping[str, int]]) -> Emit:
    """One series per value of `label` the map holds, in sorted order."""
    def emit(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
        for value, n in sorted(counts(snap).items()):
            out.add(name, n, daemon=daemon, **{label: value})
    return emit


def _by_file(name: str, counts: Callable[[LogSnapshot], Mapping[str, Optional[float]]], missing: Optional[float] = 0) -> Emit:
    def emit(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
        values = counts(snap)
        for file in FILES:
            out.add(name, values.get(file, missing), daemon=daemon, file=file)
    return emit


def _read_errors(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for file in FILES:
        for reason in READ_ERROR_REASONS:
            out.add("mps_log_read_errors_total", snap.read_errors.get((file, reason), 0), daemon=daemon,
                    file=file, reason=reason)


def _elsewhere(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    """Rendered once for every daemon: render_state_file_errors."""


# How the families that are more than a counted event are emitted. Every other
# declaration above is a counted event: its count is LogSnapshot.counts[its name].
_EMIT: Dict[str, Emit] = {
    "mps_queued_clients": _queued,
    "mps_client_queue_wait_seconds": _queue_wait,
    "mps_client_queue_wait_implausible_total": _implausible,
    "mps_queued_client_oldest_wait_seconds": _one("mps_queued_client_oldest_wait_seconds",
                                                  lambda snap, now: snap.oldest_queued_wait(now)),
    # One series: a push's reason may still change while it waits (server_starting becomes
    # user_switch when the daemon shuts a server down for it), and a counter never goes down.
    "mps_client_queue_pushes_total": _one("mps_client_queue_pushes_total", lambda snap, now: sum(snap.pushes.values())),
    "mps_client_rejections_total": _rejections,
    "mps_server_client_limit": _one("mps_server_client_limit", lambda snap, now: snap.client_limit),
    "mps_server_exits_total": _by_label("mps_server_exits_total", "status", lambda snap: snap.server_exits),
    "mps_control_commands_total": _by_label("mps_control_commands_total", "command", lambda snap: snap.commands),
    "mps_log_lines_total": _by_file("mps_log_lines_total", lambda snap: snap.lines),
    "mps_log_unrecognized_lines_total": _by_file("mps_log_unrecognized_lines_total", lambda snap: snap.unrecognized),
    "mps_log_truncated_lines_total": _by_file("mps_log_truncated_lines_total", lambda snap: snap.truncated),
    "mps_log_last_line_timestamp_seconds": _by_file("mps_log_last_line_timestamp_seconds",
                                                    lambda snap: snap.last_line_times, None),
    "mps_log_rotation_gaps_total": _by_file("mps_log_rotation_gaps_total", lambda snap: snap.rotation_gaps),
    "mps_log_read_errors_total": _read_errors,
    "mps_exporter_state_file_errors_total": _elsewhere,
}


def _counted_events(specs: Iterable[MetricSpec]) -> Tuple[str, ...]:
    """The declarations _EMIT does not name: each must be a counter of one daemon's events."""
    specs = tuple(specs)
    unknown = set(_EMIT) - {spec.name for spec in specs}
    if unknown:
        raise ValueError(f"emitters of families not declared here: {sorted(unknown)}")
    counted = tuple(spec.name for spec in specs if spec.name not in _EMIT)
    odd = [DECLARED[n] for n in counted if DECLARED[n].type != COUNTER or DECLARED[n].labels != (DAEMON.name,)]
    if odd:
        raise ValueError(f"{odd[0].name}: a counted log event is a counter labelled daemon only; "
                         "give other families an emitter in _EMIT")
    return counted


COUNTED_EVENTS = _counted_events(QUEUE_METRICS + LOG_METRICS)
_RENDER = tuple((spec.name, _EMIT.get(spec.name)) for spec in QUEUE_METRICS + LOG_METRICS)


def render_log_metrics(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    """Every family above in declaration order (the exposition's order)."""
    counts = snap.counts
    for name, emit in _RENDER:
        if emit is None:
            out.add(name, counts.get(name, 0), daemon=daemon)
        else:
            emit(out, daemon, snap, now)


def render_state_file_errors(out: FamilyBuilder, snaps: Iterable[LogSnapshot]) -> None:
    """Once for the state file the pipelines share (0 without one, as with a good one)."""
    errors = None
    for snap in snaps:
        errors = snap.state_file_errors or errors or {}
    if errors is not None:
        for reason in STATE_FILE_ERROR_REASONS:
            out.add("mps_exporter_state_file_errors_total", errors.get(reason, 0), reason=reason)
