"""MPS servers and clients: who runs what, with which limits."""

from alerts.expressions import client_info_join
from dashboards.common import (CLIENT_INFO_JOIN, SERVER_INFO_JOIN, build, m, row, row_query, stat, table, target,
                               timeseries)

SERVER_LEGEND = "{{instance}} {{daemon}} server {{server_pid}} ({{user}})"

dashboard = build(
    title="MPS / Servers and clients",
    uid="mps-servers-clients",
    description="MPS control daemons, their servers and every client: user, command, container, memory against "
                "its pinned limit and active thread share.",
    panels=[
        row("Control daemons"),
        stat("Daemons up", "Watched MPS control daemons that answered a control command in the last scrape "
             "(red: none did).", "none", [target(f"sum({m('mps_control_daemon_up')})")], good_from=1),
        stat("Servers", "MPS servers running now, over the selected daemons.", "none",
             [target(f"count({m('mps_server_info')})")]),
        stat("Clients", "MPS client processes connected now, over the selected daemons.", "none",
             [target(f"count({m('mps_client_info')})")]),
        stat("Default active thread share",
             "get_default_active_thread_percentage / 100: the SM share new servers give each client.",
             "percentunit", [target(m("mps_default_active_thread_ratio"))]),
        table("Daemons",
              "One row per watched control daemon: MPS version, pipe and log directories, default limits and "
              "the default client priority (0 normal, 1 below normal).",
              [row_query(m("mps_control_daemon_info")),
               row_query(m("mps_default_active_thread_ratio")),
               row_query(m("mps_default_pinned_memory_limit_bytes")),
               row_query(m("mps_default_client_priority"))],
              units={"Value #B": "percentunit", "Value #C": "bytes", "Value #D": "none"},
              rename={"Value #B": "default thread share", "Value #C": "default pinned limit",
                      "Value #D": "default priority"},
              hide=["Value #A"], h=5),
        row("Servers"),
        table("Servers",
              "One row per MPS server: its user, status (ACTIVE, INITIALIZING, FAULT), clients, active thread "
              "share, own device memory, uptime and the priority its clients run at unless they set their own.",
              [row_query(m("mps_server_info")),
               row_query(m("mps_server_status")),
               row_query(m("mps_server_clients")),
               row_query(m("mps_server_active_thread_ratio")),
               row_query(f"sum without(gpu, uuid) ({m('mps_server_memory_used_bytes')})"),
               row_query(f"time() - {m('mps_server_start_time_seconds')}"),
               row_query(m("mps_server_priority"))],
              units={"Value #C": "none", "Value #D": "percentunit", "Value #E": "bytes", "Value #F": "s",
                     "Value #G": "none"},
              rename={"Value #C": "clients", "Value #D": "thread share", "Value #E": "server memory",
                      "Value #F": "uptime", "Value #G": "priority"},
              hide=["Value #A", "Value #B"], h=6),
        timeseries("Clients per server", "Client processes connected to each MPS server.", "none",
                   [target(f"{m('mps_server_clients')} {SERVER_INFO_JOIN}", SERVER_LEGEND)]),
        timeseries("Server pinned memory limits",
                   "Pinned device memory limit of each server, per device (absent where none is set).",
                   "bytes", [target(m("mps_server_pinned_memory_limit_bytes"),
                                    "{{instance}} {{daemon}} server {{server_pid}} GPU {{gpu}}")]),
        row("Clients"),
        table("Clients",
              "One row per MPS client and GPU: user, command, container and pod, device memory against the "
              "pinned limit that binds it (its own, else its server's when it connected), its active thread "
              "share and the priority it runs at (its CUDA_MPS_CLIENT_PRIORITY, else its server's).",
              [row_query(m("mps_client_info")),
               row_query(m("mps_client_memory_used_bytes")),
               row_query(m("mps_client_pinned_memory_limit_bytes")),
               row_query(m("mps_client_pinned_memory_usage_ratio")),
               row_query(m("mps_client_active_thread_ratio")),
               row_query(f"time() - {m('mps_client_start_time_seconds')}"),
               row_query(m("mps_client_priority"))],
              units={"Value #B": "bytes", "Value #C": "bytes", "Value #D": "percentunit", "Value #E": "percentunit",
                     "Value #F": "s", "Value #G": "none"},
              rename={"Value #B": "memory", "Value #C": "pinned limit", "Value #D": "memory / limit",
                      "Value #E": "thread share", "Value #F": "connected for", "Value #G": "priority"},
              hide=["Value #A"], h=10),
        table("Client limits: where they come from",
              "Per client, for each limit (pinned memory, thread share, priority), where the one in force comes from "
              "(client: its own environment; server_at_connect: its server's when it connected; server_now; "
              "daemon_default; none) and, where the client set one that CUDA drops, why (e.g. invisible_device: "
              "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names a device it cannot see, and no pinned limit binds it).",
              [row_query(m("mps_client_limit_source")),
               row_query(m("mps_client_limit_ignored"))],
              units={}, rename={"pinned_memory": "pinned memory from", "active_threads": "thread share from",
                                "priority": "priority from", "limit": "own setting ignored", "reason": "why"},
              hide=["Value #A", "Value #B"], h=8),
        timeseries("Clients whose own limit is ignored, per server",
                   "Per MPS server, the clients that set a limit in their environment that CUDA does not apply "
                   "(which clients: the table above), at every --mps.client-granularity.",
                   "none", [target(f"sum by (instance, daemon, server_pid, limit, reason) "
                                   f"({m('mps_client_limit_ignored')} {client_info_join(m, 'server_pid')})\n"
                                   f"or\n{m('mps_server_clients_limit_ignored')}",
                                   "{{instance}} server {{server_pid}} {{limit}} ({{reason}})")], w=24),
        timeseries("Client memory", "Device memory of each MPS client.", "bytes",
                   [target(f"{m('mps_client_memory_used_bytes')} {CLIENT_INFO_JOIN}",
                           "{{instance}} GPU {{gpu}} pid {{pid}} {{command}} ({{user}})")]),
        timeseries("Client active thread share",
                   "The active thread limit that applies to each client (its own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                   "or its server's, whichever is smaller).",
                   "percentunit", [target(f"{m('mps_client_active_thread_ratio')} {CLIENT_INFO_JOIN}",
                                          "{{instance}} pid {{pid}} {{command}} ({{user}})")], max_one=True),
        table("Clients per server and pod (--mps.client-granularity pod)",
              "From exporters run with --mps.client-granularity pod, which sum their clients per MPS server and "
              "pod instead of one series set per client: client count, device memory and pinned limits in force, "
              "per server, pod (empty: processes outside pods) and GPU.",
              [row_query(m("mps_pod_clients")),
               row_query(m("mps_pod_client_memory_used_bytes")),
               row_query(m("mps_pod_client_pinned_memory_limit_bytes"))],
              units={"Value #A": "none", "Value #B": "bytes", "Value #C": "bytes"},
              rename={"Value #A": "clients", "Value #B": "memory", "Value #C": "pinned limits"}, h=8),
        table("Clients per server (--mps.client-granularity server)",
              "From exporters run with --mps.client-granularity server, which sum their clients per MPS server: "
              "device memory and pinned limits in force, summed per server and GPU, and the share of its limit "
              "the fullest client uses (a sum would hide one client at its limit).",
              [row_query(m("mps_server_client_memory_used_bytes")),
               row_query(m("mps_server_client_pinned_memory_limit_bytes")),
               row_query(m("mps_server_client_pinned_memory_usage_max_ratio"))],
              units={"Value #A": "bytes", "Value #B": "bytes", "Value #C": "percentunit"},
              rename={"Value #A": "memory", "Value #B": "pinned limits", "Value #C": "fullest client / its limit"},
              h=8),
        row("Lifecycle"),
        timeseries("Client connections", "Client processes connecting and disconnecting, per second (MPS logs).",
                   "cps", [target(f"rate({m('mps_client_connections_total')}[$__rate_interval])",
                                  "connect {{instance}} {{daemon}}"),
                           target(f"rate({m('mps_client_disconnections_total')}[$__rate_interval])",
                                  "disconnect {{instance}} {{daemon}}")]),
        timeseries("Server starts and exits",
                   "Servers that became ready, exited (by exit status) or failed to start, per second (MPS logs).",
                   "cps", [target(f"rate({m('mps_server_starts_total')}[$__rate_interval])",
                                  "start {{instance}} {{daemon}}"),
                           target(f"rate({m('mps_server_exits_total')}[$__rate_interval])",
                                  "exit status {{status}} {{instance}} {{daemon}}"),
                           target(f"rate({m('mps_server_start_failures_total')}[$__rate_interval])",
                                  "start failure {{instance}} {{daemon}}")]),
    ],
)
