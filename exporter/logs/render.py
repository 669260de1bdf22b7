"""A LogSnapshot -> the "Queueing and contention" and "From the MPS logs" families.

The per-server facts the logs carry (start time, uid, thread percentage, pinned
limits) are not rendered here: the collector joins them into the server and
client tables when the control daemon is slow or gone.
"""

from __future__ import annotations

from ..families import FamilyBuilder
from .events import FILES
from .follower import READ_ERROR_REASONS
from .state import REASONS, REJECTION_REASONS, LogSnapshot


def render_log_metrics(out: FamilyBuilder, daemon: str, snap: LogSnapshot, now: float) -> None:
    for reason in REASONS:
        out.add("mps_queued_clients", snap.queued.get(reason, 0), daemon=daemon, reason=reason)
        hist = snap.queue_wait[reason]
        out.add_histogram("mps_client_queue_wait_seconds", hist.cumulative(), hist.total,
                          daemon=daemon, reason=reason)
        out.add("mps_client_queue_wait_implausible_total", hist.implausible, daemon=daemon, reason=reason)
    out.add("mps_queued_client_oldest_wait_seconds", snap.oldest_queued_wait(now), daemon=daemon)
    out.add("mps_queued_clients_gone_total", snap.queued_gone, daemon=daemon)
    out.add("mps_server_handoffs_total", snap.handoffs, daemon=daemon)
    out.add("mps_server_shutdown_deferrals_total", snap.shutdown_deferrals, daemon=daemon)
    for reason in REJECTION_REASONS:  # client_limit always (from 0, so rate() sees the first one)
        n = snap.rejections.get(reason, 0)
        if n or reason == "client_limit":
            out.add("mps_client_rejections_total", n, daemon=daemon, reason=reason)
    out.add("mps_server_client_limit", snap.client_limit, daemon=daemon)

    out.add("mps_client_connections_total", snap.client_connections, daemon=daemon)
    out.add("mps_client_disconnections_total", snap.client_disconnections, daemon=daemon)
    out.add("mps_server_starts_total", snap.server_starts, daemon=daemon)
    for status, n in sorted(snap.server_exits.items()):
        out.add("mps_server_exits_total", n, daemon=daemon, status=status)
    out.add("mps_server_exits_with_clients_total", snap.exits_with_clients, daemon=daemon)
    out.add("mps_server_start_failures_total", snap.server_start_failures, daemon=daemon)
    out.add("mps_fatal_gpu_errors_total", snap.fatal_gpu_errors, daemon=daemon)
    for verb, n in sorted(snap.commands.items()):
        out.add("mps_control_commands_total", n, daemon=daemon, command=verb)
    for file in FILES:
        out.add("mps_log_lines_total", snap.lines.get(file, 0), daemon=daemon, file=file)
        out.add("mps_log_unrecognized_lines_total", snap.unrecognized.get(file, 0), daemon=daemon, file=file)
        out.add("mps_log_truncated_lines_total", snap.truncated.get(file, 0), daemon=daemon, file=file)
        out.add("mps_log_last_line_timestamp_seconds", snap.last_line_times.get(file), daemon=daemon, file=file)
        for reason in READ_ERROR_REASONS:
            out.add("mps_log_read_errors_total", snap.read_errors.get((file, reason), 0), daemon=daemon,
                    file=file, reason=reason)
