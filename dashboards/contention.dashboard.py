"""Contention: clients waiting for servers, handoffs between users, saturation."""

from alerts.expressions import queue_wait_quantile
from dashboards.common import build, m, row, target, timeseries

DAEMON_LEGEND = "{{instance}} {{daemon}}"


def wait_quantile(q: float) -> str:
    return queue_wait_quantile(m, q, "$__rate_interval", by="instance, daemon, reason")


dashboard = build(
    title="MPS / Contention",
    uid="mps-contention",
    description="Clients queued behind other users' servers, how long they wait, server handoffs and GPU saturation.",
    panels=[
        row("Queue"),
        timeseries("Queued clients",
                   "Clients on the daemon's pending list: user_switch waits for another user's server to drain, "
                   "server_starting for its own server to start.",
                   "none", [target(m("mps_queued_clients"), DAEMON_LEGEND + " {{reason}}")], stacked=True),
        timeseries("Oldest queued client", "Age of the oldest pending client; 0 when none waits.", "s",
                   [target(m("mps_queued_client_oldest_wait_seconds"), DAEMON_LEGEND)]),
        timeseries("Queue wait",
                   "Time from 'pushed to pending list' to admission, 50th and 95th percentile by reason.",
                   "s", [target(wait_quantile(0.5), "p50 " + DAEMON_LEGEND + " {{reason}}"),
                         target(wait_quantile(0.95), "p95 " + DAEMON_LEGEND + " {{reason}}")]),
        timeseries("Leaving the queue", "Clients admitted after waiting on the pending list, per second, beside "
                   "those pushed onto it (entering). "
                   "Implausible: waits below 0 or above a day (a clock step, a corrupt timestamp), left out of the "
                   "wait histogram. Gone: queued clients whose process was gone before a server took them (killed "
                   "or cancelled while waiting; MPS may then hang, see the runbook's MpsClientsRefused).",
                   "cps", [target(f"sum by (instance, daemon, reason) "
                                  f"(rate({m('mps_client_queue_wait_seconds', '_count')}[$__rate_interval]))",
                                  DAEMON_LEGEND + " {{reason}}"),
                           target(f"sum by (instance, daemon, reason) "
                                  f"(rate({m('mps_client_queue_wait_implausible_total')}[$__rate_interval]))",
                                  DAEMON_LEGEND + " implausible {{reason}}"),
                           target(f"rate({m('mps_queued_clients_gone_total')}[$__rate_interval])",
                                  DAEMON_LEGEND + " gone"),
                           target(f"rate({m('mps_client_queue_pushes_total')}[$__rate_interval])",
                                  DAEMON_LEGEND + " entering")]),
        row("Handoffs"),
        timeseries("Server handoffs",
                   "Servers shut down so that another user's server could start, per second: users taking turns "
                   "on the same GPUs.",
                   "cps", [target(f"rate({m('mps_server_handoffs_total')}[$__rate_interval])", DAEMON_LEGEND)]),
        timeseries("Shutdown deferrals",
                   "'Server will not shutdown' answers per second: a server still had active clients while another "
                   "user waited.",
                   "cps", [target(f"rate({m('mps_server_shutdown_deferrals_total')}[$__rate_interval])",
                                  DAEMON_LEGEND)]),
        timeseries("Connections the control daemon could not accept",
                   "control.log 'Unable to accept connection' per second: a client or control command that "
                   "connected got no answer (seen as 208 clients arrived at once on four GPUs).",
                   "cps", [target(f"rate({m('mps_control_accept_failures_total')}[$__rate_interval])",
                                  DAEMON_LEGEND)]),
        row("Refusals and deaths"),
        timeseries("Refused clients",
                   "Clients an MPS server refused, per interval, by reason (client_limit: 'Maximum number of "
                   "clients (N) reached'; each refused process fails after about half a minute with "
                   "cudaErrorDevicesUnavailable), beside the limit the last refusal named and the largest number of "
                   "clients per server now.",
                   "none", [target(f"increase({m('mps_client_rejections_total')}[$__rate_interval])",
                                   DAEMON_LEGEND + " refused ({{reason}})"),
                            target(m("mps_server_client_limit"), DAEMON_LEGEND + " limit"),
                            target(f"max by (instance, daemon) ({m('mps_server_clients')})",
                                   DAEMON_LEGEND + " clients of the fullest server")], w=12),
        timeseries("Servers that exited with clients",
                   "MPS servers that exited while clients were still connected, per interval (killed or crashed: "
                   "their clients lost their work), beside all server exits by status.",
                   "none", [target(f"increase({m('mps_server_exits_with_clients_total')}[$__rate_interval])",
                                   DAEMON_LEGEND + " with clients"),
                            target(f"sum by (instance, daemon, status) "
                                   f"(increase({m('mps_server_exits_total')}[$__rate_interval]))",
                                   DAEMON_LEGEND + " all, status {{status}}")], w=12),
        row("Saturation and faults"),
        timeseries("SM active", "Share of SMs busy per GPU (NVML GPM or DCGM); compare with the clients sharing it.",
                   "percentunit", [target(m("mps_gpu_sm_active_ratio"), "{{instance}} GPU {{gpu}}")],
                   max_one=True, w=8),
        timeseries("Clients sharing each GPU", "MPS clients holding memory on each GPU.", "none",
                   [target(f"count by (instance, gpu) ({m('mps_client_memory_used_bytes')})",
                           "{{instance}} GPU {{gpu}}")], w=8),
        timeseries("Servers by status", "MPS servers by status: ACTIVE, INITIALIZING, FAULT.", "none",
                   [target(f"sum by (instance, daemon, status) ({m('mps_server_status')})",
                           DAEMON_LEGEND + " {{status}}")], w=8, stacked=True),
        timeseries("Fatal GPU errors", "Fatal GPU errors MPS servers handled, per interval (MPS logs).", "none",
                   [target(f"increase({m('mps_fatal_gpu_errors_total')}[$__rate_interval])", DAEMON_LEGEND)],
                   w=12),
        timeseries("Clients ended by an operator",
                   "Client processes ended with terminate_client, per interval (server.log): they fail with their "
                   "next CUDA call; `mps-exporter status` lists them under EVENTS.", "none",
                   [target(f"increase({m('mps_clients_terminated_total')}[$__rate_interval])", DAEMON_LEGEND)],
                   w=12),
    ],
)
