"""An example counted MPS log event, as a contributor would add one (issue 39): a control.log
line `Client P timed out waiting for server`, counted in mps_client_wait_timeouts_total,
on the contention dashboard and alerted on by MpsClientWaitTimedOut.
tests/test_example_log_event.py makes these edits in a copy of the repository and runs the
suite there.

Each edit is (file, anchor, text): `text` goes right after the one place `anchor` is in
`file`. PRODUCT lists the edits in exporter/: the event type, the parser rule, the handler
line and the declaration, nothing else."""

from __future__ import annotations

from typing import List, Tuple

LINE = "Client 4242 timed out waiting for server"
METRIC = "mps_client_wait_timeouts_total"

PRODUCT: List[Tuple[str, str, str]] = [
    # The event type.
    ("exporter/logs/events.py", "# ----------------------------------------------------------------- both\n", '''\
class ClientWaitTimedOut(NamedTuple):
    """`Client P timed out waiting for server` (an example: MPS prints no such line)."""

    ts: float
    pid: int
    client_pid: int


'''),
    ("exporter/logs/events.py", "ServerPriority, ClientTerminated, Noise,\n", "    ClientWaitTimedOut,\n"),
    # The parser rule.
    ("exporter/logs/parser.py", "    ClientPushed, ClientRejected, ClientTerminated, ", "ClientWaitTimedOut, "),
    ("exporter/logs/parser.py", "_CONTROL_RULES: Dict[str, List[_Rule]] = {\n", '''\
    "Client": _rules(
        (r"Client (\\d{1,10}) timed out waiting for server$",
         lambda ts, pid, m: ClientWaitTimedOut(ts, pid, int(m.group(1)))),
    ),
'''),
    # The handler line.
    ("exporter/logs/state.py", "    ClientPushed, ClientRejected, ClientTerminated, ", "ClientWaitTimedOut, "),
    ("exporter/logs/state.py", '            ShutdownDeferred: self._counter("mps_server_shutdown_deferrals_total"),\n',
     f'            ClientWaitTimedOut: self._counter("{METRIC}"),\n'),
    # The declaration.
    ("exporter/logs/render.py", '"`MPS server requesting client {PID: P, ...} to exit`): they fail with their next CUDA call.", DAEMON),\n',
     f'    counter("{METRIC}", "Clients that gave up waiting for a server (control.log `Client P timed out '
     'waiting for server`).", DAEMON),\n'),
]

# What every metric and alert needs beside the code: a panel, a place in the versioning
# policy, an alert with its threshold, runbook section and rule tests.
ELSEWHERE: List[Tuple[str, str, str]] = [
    ("docs/versioning.md", "- `mps_clients_terminated_total`\n", f"- `{METRIC}`\n"),
    ("dashboards/contention.dashboard.py",
     "[target(f\"increase({m('mps_clients_terminated_total')}[$__rate_interval])\", DAEMON_LEGEND)],\n"
     "                   w=12),\n", f'''\
        timeseries("Clients that timed out waiting", "Clients that gave up waiting for a server, per interval.",
                   "none", [target(f"increase({{m('{METRIC}')}}[$__rate_interval])", DAEMON_LEGEND)], w=24),
'''),
    ("alerts/config.py", 'FATAL_ERROR_WINDOW = "10m"\n', '''
# Any client that timed out waiting for a server in this window alerts.
CLIENT_WAIT_TIMEOUT_WINDOW = "10m"
'''),
    ("alerts/definitions.py", 'every client of the affected server lost its work."),\n', f'''\
    Alert(
        "ClientWaitTimedOut", "contention",
        f"increase({{job('{METRIC}')}}[{{C.CLIENT_WAIT_TIMEOUT_WINDOW}}]) > 0", "0m", "warning",
        "An MPS client timed out waiting for a server.",
        f"{{{{{{{{ $value | printf \\"%.0f\\" }}}}}}}} client(s) of daemon {{lbl('daemon')}} on {{NODE}} timed out "
        f"waiting for a server in the last {{C.CLIENT_WAIT_TIMEOUT_WINDOW}}."),
'''),
    ("alerts/runbook.md", "at hardware, drain the node and follow the hardware procedure.\n", '''
## MpsClientWaitTimedOut

**Meaning.** A client gave up waiting for an MPS server in the last 10 minutes.

**Impact.** The client failed to start its work.

**Diagnose.** `grep -n "timed out waiting" "$CUDA_MPS_LOG_DIRECTORY"/control.log`.

**Mitigate.** Find what held the server (dashboard *Contention*, panel *Clients that timed out waiting*).
'''),
    ("alerts/tests/contention.yaml", "      - alertname: MpsFatalGpuError\n        eval_time: 5m\n        exp_alerts: []\n\n",
     f'''\
  # --- MpsClientWaitTimedOut --------------------------------------------------
  - name: a client timed out waiting
    interval: 1m
    input_series:
      - series: '{METRIC}{{job="mps-exporter", instance="gpu-node-1:10138", daemon="default"}}'
        values: '0 0 1 1 1'
    alert_rule_test:
      - alertname: MpsClientWaitTimedOut
        eval_time: 3m
        exp_alerts:
          - exp_labels:
              severity: warning
              job: mps-exporter
              instance: gpu-node-1:10138
              daemon: default
            exp_annotations:
              summary: An MPS client timed out waiting for a server.
              description: "1 client(s) of daemon default on gpu-node-1:10138 timed out waiting for a server in the last 10m."
              runbook_url: https://github.com/mps-exporter/mps-exporter/blob/main/alerts/runbook.md#mpsclientwaittimedout
  - name: no new client timed out
    interval: 1m
    input_series:
      - series: '{METRIC}{{job="mps-exporter", instance="gpu-node-1:10138", daemon="default"}}'
        values: '3x10'
    alert_rule_test:
      - alertname: MpsClientWaitTimedOut
        eval_time: 5m
        exp_alerts: []

'''),
]
