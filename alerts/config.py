"""The one configuration of the alerts, recording rules and dashboards (the
mixin `_config`): every selector, window, threshold and duration they use, with
the reason for it. alerts/expressions.py applies the selector to every series
an alert or recording rule reads; the dashboards build their selectors from
the same labels.

Change a value here, run `make generate`, commit the regenerated files.
"""

import re
from pathlib import Path


def _project_url(name: str) -> str:
    """A URL of [project.urls] in pyproject.toml, where it is declared once."""
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(rf'^{name} = "([^"]+)"$', text, re.MULTILINE)
    if found is None:
        raise ValueError(f"pyproject.toml names no {name} URL under [project.urls]")
    return found.group(1)


# Prometheus job of the exporter's targets (mixin `jobSelector`): every raw series
# an alert or recording rule reads is selected with it, and the dashboards' job
# variable lists only jobs it matches. The Helm chart's ServiceMonitor and the
# example scrape config both use this job name.
JOB_SELECTOR = 'job="mps-exporter"'

# Labels that identify one exporter target. Joins between the exporter's own
# series match on these plus the series' own keys (daemon, pid, gpu, ...).
# On Kubernetes the scrape may add `node`; joins keep it because group_left
# keeps every label of the left-hand side.
TARGET_LABELS = ("job", "instance")

# The label that names the machine in alert descriptions. `instance` always
# exists; set "node" where relabeling adds a node name.
NODE_LABEL = "instance"

# Where each alert's runbook_url points (mixin `runbookURLPattern`): `%s` becomes
# the alert's anchor, its name lower-cased. The default is alerts/runbook.md at the
# project's Source URL (pyproject.toml), a link no scrape configuration can break: one
# built from `instance` (the exporter's own /runbook) broke wherever relabeling makes
# `instance` a host or node name, as every documented set-up does. Point it at your own
# copy (wiki, git host) with RUNBOOK_URL_PATTERN in the environment of `make
# generate`, or change it here (docs/deploy.md, "Runbook links").
RUNBOOK_URL_PATTERN = f"{_project_url('Source')}/blob/main/alerts/runbook.md#%s"

# Prefix of every alert name.
ALERT_PREFIX = "Mps"

# ------------------------------------------------------------ recording rules
# Joins over every client and quantiles over histograms cost the most per
# evaluation: they get their own group at this interval (alerts reading them
# have `for:` durations of minutes anyway). The fleet aggregates, read by the
# fleet dashboard, are evaluated as often.
HEAVY_RULES_INTERVAL = "1m"
FLEET_RULES_INTERVAL = "1m"

# The fleet dashboard counts GPUs with less than this share of memory free.
LOW_MEMORY_HEADROOM_RATIO = 0.1

# ---------------------------------------------------------------- contention
# MPS runs one user's server per GPU at a time; a client of another user waits
# on the daemon's pending list until the running server has no clients left.
# Waiting this long means someone's job is stalled behind another user's.
QUEUED_BEHIND_USER_FOR = "1m"

# p95 of the time a client spends pending before admission, over QUEUE_WAIT_WINDOW.
# The recorded capture shows a 12.9 s wait for one user switch; half a minute at
# p95 means users keep waiting for each other's servers to drain.
QUEUE_WAIT_P95_SECONDS = 30
QUEUE_WAIT_WINDOW = "10m"
QUEUE_WAIT_FOR = "5m"

# A client refused at the client limit hangs about 20-30 s and then fails with
# cudaErrorDevicesUnavailable (4 of 52 clients on an H100, tests/gpu/reports/
# h100-edges.md): every refusal is a job that did not run. Any refusal in the
# window fires.
CLIENT_REFUSAL_WINDOW = "10m"

# A server that exits while clients are connected (SIGKILL, OOM killer, a crash)
# takes their work with it (cudaErrorMpsRpcFailure in each client).
SERVER_DEATH_WINDOW = "10m"

# MPS admits at most 48 client processes per device (Volta and later, driver 580), fewer
# where clients raise CUDA_DEVICE_MAX_CONNECTIONS: the exporter publishes the ceiling a
# refusal showed (mps_server_client_limit) and the alert uses it. Warn before new clients
# start failing to connect.
MAX_CLIENTS_PER_DEVICE = 48
CLIENT_LIMIT_WARNING_RATIO = 0.9
CLIENT_LIMIT_FOR = "5m"

# A GPU whose SMs are busy most of the time while several clients share it:
# each client gets less than it would alone. SM active (GPM/DCGM), not NVML
# "GPU utilization", which saturates with one tiny kernel stream.
SATURATION_SM_ACTIVE_RATIO = 0.9
SATURATION_MIN_CLIENTS = 2
SATURATION_FOR = "15m"

# A server in FAULT refuses new clients until all of its clients have exited.
SERVER_FAULT_FOR = "1m"

# Any fatal GPU error a server handled in this window alerts.
FATAL_ERROR_WINDOW = "10m"

# Servers that exit with a non-zero status, or fail to start, more than this
# many times in SERVER_LOOP_WINDOW are in a loop (a normal user switch exits 0).
SERVER_LOOP_WINDOW = "15m"
SERVER_CRASHES_MAX = 2
SERVER_START_FAILURES_MAX = 2

# The daemon counts as "ran before" if it answered at any time in this window:
# exporters on machines where MPS was never started stay quiet. Read from the
# recorded hourly max (DAEMON_SEEN_STEP), never a day of raw samples.
DAEMON_SEEN_WINDOW = "1d"
DAEMON_SEEN_STEP = "1h"
DAEMON_DOWN_FOR = "2m"

# ----------------------------------------------------------------------- OOM
# Share of a client's pinned device memory limit (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
# or its server's) in use: allocations beyond the limit fail with out-of-memory.
CLIENT_MEMORY_LIMIT_RATIO = 0.9
CLIENT_MEMORY_FOR = "2m"

# A client's own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT / CUDA_MPS_ACTIVE_THREAD_PERCENTAGE that
# CUDA drops (a device the client cannot see, a bare size, a value outside 0-100): the
# setting is fixed for the process's life, so one scrape would do; a minute keeps a
# client that exits at once quiet.
CLIENT_LIMIT_IGNORED_FOR = "1m"

# A compute process outside MPS on a GPU that MPS serves (pipe directory not mounted or
# not set, another CUDA_MPS_PIPE_DIRECTORY). While it starts, an MPS client can show in
# NVML's compute list before its MPS list (seconds; hundreds of ms per NVML call while
# dozens of clients start): long enough to skip that.
OUTSIDE_MPS_FOR = "2m"

# MPS clients that exited at the edge of memory (mps_client_exits_at_memory_limit_total):
# outcome failed (a non-zero status or a signal) or unknown (no kernel connector) in the
# window. An exit is an event, not a state: no `for`, the window is how long the alert
# stays after the last one (a few evaluation intervals past a 1 m scrape).
EDGE_EXIT_OUTCOMES = ("failed", "unknown")
EDGE_EXIT_WINDOW = "10m"
EDGE_EXIT_FOR = "0m"

# The Kubernetes dashboard's suggested pinned memory limit: a client's (or pod's) peak
# memory over its life plus this share, rounded up to SUGGESTED_LIMIT_STEP_BYTES (a size
# MPS takes as written: 2304M). 20 %: a client that died on H100 asking 1 GiB more at
# 1.9 GiB of a 2 GiB limit (issue 40) asked for half its limit at once; a workload's
# peak seen by a collection a second misses the allocations of the last second, and
# 20 % above the peak leaves room for one more such step in most workloads, not in
# that one. Size from a peak that covers the workload's whole life (a full epoch, not
# the first minutes).
SUGGESTED_LIMIT_MARGIN_RATIO = 0.2
SUGGESTED_LIMIT_STEP_BYTES = 256 << 20

# Share of a GPU's memory in use: the next client's allocation may fail.
GPU_MEMORY_FULL_RATIO = 0.95
GPU_MEMORY_FULL_FOR = "5m"

# Linear fit of used memory over MEMORY_FILL_WINDOW predicts the GPU full within
# MEMORY_FILL_HORIZON_SECONDS; below MEMORY_FILL_MIN_RATIO usage, growth is
# noise (model loading), not a leak.
MEMORY_FILL_WINDOW = "30m"
MEMORY_FILL_HORIZON_SECONDS = 4 * 3600
MEMORY_FILL_MIN_RATIO = 0.5
MEMORY_FILL_FOR = "10m"

# ----------------------------------------------------------------------- Xid
# NVIDIA's Xid catalogue (https://docs.nvidia.com/deploy/xid-errors/), the codes by what
# they ask of an operator: the one list the alerts, their descriptions and the runbook
# follow. A code in neither list (45, preemptive cleanup after an earlier error, comes
# with every killed context) shows on the dashboards and in `mps-exporter status` only.
#
# Critical: the GPU itself is in trouble; it needs a reset, a reboot or service, and
# every MPS client on it has lost (or will lose) its work.
XID_CRITICAL = {
    "48": "double-bit ECC error",
    "62": "internal micro-controller halt",
    "64": "ECC page retirement or row remapping failure",
    "74": "NVLink error",
    "79": "GPU has fallen off the bus",
    "95": "uncontained ECC error",
    "119": "GSP RPC timeout",
    "120": "GSP error",
}
# Warning: an application's fault (or, for 94, a contained memory error that ended the
# application): the GPU goes on, but under MPS the clients of the same server lose their
# work with it (MpsFatalGpuError names them from the MPS logs).
XID_APPLICATION = {
    "13": "graphics engine exception",
    "31": "GPU memory page fault (MMU fault)",
    "43": "GPU stopped processing",
    "94": "contained ECC error",
}
# An Xid seen within this window alerts (no `for:`: the event is the news).
XID_WINDOW = "5m"
# A GPU whose Xid events cannot be registered (not supported, no permission) for this
# long: the Xid alerts above are blind there.
XID_UNREGISTERED_FOR = "10m"

# ------------------------------------------------------------------ exporter
# A collector that keeps failing leaves the metrics it owns missing, and the
# alerts on them silent.
COLLECTOR_FAILING_FOR = "5m"
TARGET_DOWN_FOR = "5m"

# Series that are simply absent make every rule on them quiet, and read as healthy
# (issue 43): a target that answers without the exporter's own series (another program
# on the port, a metric_relabel_configs that drops them), or a control collector that
# watches no MPS control daemon at all (--mps.discover finding none: a wrong root or an
# unmounted directory), so that MpsControlDaemonDown can never fire. Longer than
# TARGET_DOWN_FOR: a daemon that the device plugin restarts is found again within
# seconds (--mps.discover-interval), a node that starts its daemon late within minutes.
NO_DATA_FOR = "10m"

# A reading is stale when a scrape serves it older than this many of its collector's
# refresh intervals (mps_exporter_collector_refresh_interval_seconds; 0 for a source read
# in every scrape) plus the slack: the slowest read a scrape waits for
# (--scrape.max-duration, 5 s) and a storm's slowest NVML read (1.5 s), rounded up.
READINGS_STALE_INTERVALS = 3
READINGS_STALE_SLACK_SECONDS = 10
READINGS_STALE_FOR = "5m"

# A log file that began to fail in this window (missing or unreadable log directory,
# a FIFO or device in place of a log, permission denied) alerts at once: the
# queueing and fault metrics from that file stop. One that lasts also fails the
# logs collector (COLLECTOR_FAILING_FOR).
LOG_READ_ERRORS_WINDOW = "10m"

# -------------------------------------------------------------------- Grafana
# Grafana-managed alert rules: the folder and the UID of the Prometheus data
# source they query (Grafana expands $VAR / ${VAR} from the environment in
# provisioning files, so "${PROMETHEUS_DATASOURCE_UID}" would also work).
GRAFANA_FOLDER = "MPS"
GRAFANA_DATASOURCE_UID = "prometheus"
GRAFANA_EVALUATION_INTERVAL = "1m"
