"""One definition per recording rule, in three groups (generate.py writes them):

- `rules` (Prometheus' evaluation interval): cheap per-target series the alerts read;
- `heavy` (config.HEAVY_RULES_INTERVAL): quantiles, the hourly max that keeps
  alerts from reading a day of raw samples, and the sums per Kubernetes pod (the
  exporter puts `namespace`, `pod`, `container` on its client series: no rule reads
  kube-state-metrics). No record copies a served series: each client's memory
  against its limit is the exporter's own `mps_client_pinned_memory_usage_ratio`,
  which the alert and the dashboards read (expressions.client_memory_ratio);
- `fleet` (config.FLEET_RULES_INTERVAL): per node and per GPU model;
- `fleet-totals` (the same interval): the fleet totals summed from `fleet`'s per-node
  records. With `fleet`, the only series the fleet dashboard reads.

New names follow `level:metric:operations` (Prometheus' recording rule
convention): the labels kept, the metric, what was done to it. No record reads
another record of its own group: Prometheus runs a group's rules in order, but
vmalert and Mimir do not promise that a rule sees the value another rule of the
same group wrote in the same round ("don't rely on chaining of recording rules").
A record that reads another goes into a later group; `check()` refuses one that
does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Set, Tuple

from . import config as C
from .expressions import TARGET as T
from .expressions import gpu_memory_ratio, job
from .expressions import queue_wait_quantile

RULES, HEAVY, FLEET, FLEET_TOTALS = "rules", "heavy", "fleet", "fleet-totals"
# In the order of the rule file (promtool evaluates them in this order, one after the other).
RECORDING_GROUPS = {RULES: None, HEAVY: C.HEAVY_RULES_INTERVAL, FLEET: C.FLEET_RULES_INTERVAL,
                    FLEET_TOTALS: C.FLEET_RULES_INTERVAL}
FLEET_GROUPS = (FLEET, FLEET_TOTALS)  # what the fleet dashboard reads


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    why: str  # one line, written as a comment next to the rule
    group: str = RULES
    # For a `max_over_time(raw[step])` record: Grafana-managed rules, which cannot
    # rely on recording rules, read `raw[step]` where an alert ranges over the record.
    raw_range: Optional[Tuple[str, str]] = None  # (raw selector, step)


# ------------------------------------------------------------------ names
GPU_MEMORY_USAGE = "mps:gpu_memory_usage:ratio"
QUEUE_WAIT_P95 = "mps:client_queue_wait_seconds:p95"
DAEMON_UP_MAX = f"instance_daemon:mps_control_daemon_up:max{C.DAEMON_SEEN_STEP}"
POD_MEMORY = "namespace_pod_gpu:mps_client_memory_used_bytes:sum"
POD_LIMIT = "namespace_pod_gpu:mps_client_pinned_memory_limit_bytes:sum"
POD_THREADS = "namespace_pod:mps_client_active_thread_ratio:sum"
NODE_MODES = "instance_mode:mps_gpu_sharing_mode:sum"
MODEL_MODES = "name_mode:mps_gpu_sharing_mode:sum"
FLEET_MODES = "fleet_mode:mps_gpu_sharing_mode:sum"
NODE_QUEUED = "instance:mps_queued_clients:sum"
FLEET_QUEUED_NODES = "fleet:mps_nodes_with_queued_clients:count"
NODE_FAULTS = "instance:mps_servers_in_fault:count"
FLEET_FAULTS = "fleet:mps_servers_in_fault:count"
NODE_FATAL = "instance:mps_fatal_gpu_errors:rate5m"
FLEET_FATAL = "fleet:mps_fatal_gpu_errors:rate5m"
NODE_REFUSALS = "instance:mps_client_rejections:rate5m"
FLEET_REFUSALS = "fleet:mps_client_rejections:rate5m"
NODE_DEATHS = "instance:mps_server_exits_with_clients:rate5m"
FLEET_DEATHS = "fleet:mps_server_exits_with_clients:rate5m"
NODE_HEADROOM = "instance:mps_gpu_memory_headroom:min_ratio"
FLEET_LOW_HEADROOM = "fleet:mps_gpus_low_memory_headroom:count"
MODEL_MEMORY_USED = "name:mps_gpu_memory_used_bytes:sum"
MODEL_MEMORY_TOTAL = "name:mps_gpu_memory_total_bytes:sum"
NODE_CLIENTS = "instance:mps_server_clients:sum"
FLEET_CLIENTS = "fleet:mps_server_clients:sum"
EXPORTERS = "job:mps_exporters:count"
EXPORTERS_UP = "job:mps_exporters_up:sum"

# ------------------------------------------------------- building blocks


def _per_pod(metric: str, by: str, summed: str = "") -> str:
    """Sum of a per-client series over each pod's clients, by `by`; or, from exporters
    with --mps.client-granularity pod, of the `summed` series (already per pod). The
    exporter names the pods itself: no join. `unless on(pod) vector(0)` drops the sums of
    clients in no pod (pod empty), as a `pod!=""` matcher would, without that matcher's
    cost: it merges the postings of every pod name Prometheus holds (every pod of the
    cluster, kube-state-metrics' too), per rule and round (issue 44, fleet bench)."""
    expr = f"sum by ({T}, {by}) ({job(metric)})"
    if summed:
        expr = f"(\n  {expr}\nor\n  sum by ({T}, {by}) ({job(summed)})\n)"
    return f"{expr}\nunless on(pod) vector(0)"


def _fleet_count(expr: str) -> str:
    """A count that is 0, not absent, when nothing matches (a fleet panel shows 0)."""
    return f"count({expr}) or vector(0)"


RECORDINGS: Tuple[Recording, ...] = (
    # rules ---------------------------------------------------------------
    Recording(GPU_MEMORY_USAGE, gpu_memory_ratio(job), "share of each GPU's memory in use"),
    # heavy ---------------------------------------------------------------
    Recording(DAEMON_UP_MAX, f"max_over_time({job('mps_control_daemon_up')}[{C.DAEMON_SEEN_STEP}])",
              f"1 if the control daemon answered within the last {C.DAEMON_SEEN_STEP}: alerts range over this "
              f"record, not over a day of raw samples", HEAVY,
              raw_range=(job("mps_control_daemon_up"), C.DAEMON_SEEN_STEP)),
    Recording(QUEUE_WAIT_P95, queue_wait_quantile(job, 0.95, C.QUEUE_WAIT_WINDOW),
              f"p95 of the time clients waited on the pending list, over {C.QUEUE_WAIT_WINDOW}, by daemon and reason",
              HEAVY),
    Recording(POD_MEMORY, _per_pod("mps_client_memory_used_bytes", "namespace, pod, gpu",
                                   "mps_pod_client_memory_used_bytes"),
              "device memory of each pod's MPS clients, per node and GPU", HEAVY),
    Recording(POD_LIMIT, _per_pod("mps_client_pinned_memory_limit_bytes", "namespace, pod, gpu",
                                  "mps_pod_client_pinned_memory_limit_bytes"),
              "pinned memory limits in force for each pod's MPS clients, summed per node and GPU", HEAVY),
    Recording(POD_THREADS, _per_pod("mps_client_active_thread_ratio", "namespace, pod"),
              "active thread shares of each pod's MPS clients, summed per node", HEAVY),
    # fleet ---------------------------------------------------------------
    Recording(NODE_MODES, f"sum by ({T}, mode) ({job('mps_gpu_sharing_mode')})",
              "GPUs of each node by sharing mode (mps, time_slicing, exclusive, mig, idle)", FLEET),
    Recording(MODEL_MODES,
              f"sum by (name, mode) (\n  {job('mps_gpu_sharing_mode')}\n"
              f"  * on({T}, gpu) group_left(name) {job('mps_gpu_info')}\n)",
              "GPUs of each model by sharing mode, over the fleet", FLEET),
    Recording(FLEET_MODES, f"sum by (mode) ({NODE_MODES})", "GPUs by sharing mode, over the fleet", FLEET_TOTALS),
    Recording(NODE_QUEUED, f"sum by ({T}) ({job('mps_queued_clients')})", "clients queued on each node", FLEET),
    Recording(FLEET_QUEUED_NODES, _fleet_count(f"{NODE_QUEUED} > 0"), "nodes with queued clients", FLEET_TOTALS),
    Recording(NODE_FAULTS, f"count by ({T}) ({job('mps_server_status', status='FAULT')} == 1)",
              "MPS servers in FAULT on each node (absent where none)", FLEET),
    Recording(FLEET_FAULTS, f"sum({NODE_FAULTS}) or vector(0)", "MPS servers in FAULT over the fleet", FLEET_TOTALS),
    Recording(NODE_FATAL, f"sum by ({T}) (rate({job('mps_fatal_gpu_errors_total')}[5m]))",
              "fatal GPU errors per second on each node", FLEET),
    Recording(FLEET_FATAL, f"sum({NODE_FATAL}) or vector(0)", "fatal GPU errors per second over the fleet", FLEET_TOTALS),
    Recording(NODE_REFUSALS, f"sum by ({T}) (rate({job('mps_client_rejections_total')}[5m]))",
              "client connections MPS servers refused per second on each node", FLEET),
    Recording(FLEET_REFUSALS, f"sum({NODE_REFUSALS}) or vector(0)",
              "client connections refused per second over the fleet", FLEET_TOTALS),
    Recording(NODE_DEATHS, f"sum by ({T}) (rate({job('mps_server_exits_with_clients_total')}[5m]))",
              "MPS servers per second that exited under connected clients, on each node", FLEET),
    Recording(FLEET_DEATHS, f"sum({NODE_DEATHS}) or vector(0)",
              "MPS servers per second that exited under connected clients, over the fleet", FLEET_TOTALS),
    Recording(NODE_HEADROOM, f"min by ({T}) (1 - {GPU_MEMORY_USAGE})",
              "share of memory free on each node's fullest GPU", FLEET),
    Recording(FLEET_LOW_HEADROOM, _fleet_count(f"{GPU_MEMORY_USAGE} > {1 - C.LOW_MEMORY_HEADROOM_RATIO:g}"),
              f"GPUs with less than {C.LOW_MEMORY_HEADROOM_RATIO:.0%} of their memory free, over the fleet", FLEET),
    Recording(MODEL_MEMORY_USED,
              f"sum by (name) (\n  {job('mps_gpu_memory_used_bytes')}\n"
              f"  * on({T}, gpu) group_left(name) {job('mps_gpu_info')}\n)",
              "device memory used, per GPU model, over the fleet", FLEET),
    Recording(MODEL_MEMORY_TOTAL,
              f"sum by (name) (\n  {job('mps_gpu_memory_total_bytes')}\n"
              f"  * on({T}, gpu) group_left(name) {job('mps_gpu_info')}\n)",
              "device memory, per GPU model, over the fleet", FLEET),
    Recording(NODE_CLIENTS, f"sum by ({T}) ({job('mps_server_clients')})",
              "MPS clients connected on each node", FLEET),
    Recording(FLEET_CLIENTS, f"sum({NODE_CLIENTS}) or vector(0)", "MPS clients connected over the fleet", FLEET_TOTALS),
    Recording(EXPORTERS, f"count by (job) ({job('up')})", "mps-exporter targets", FLEET),
    Recording(EXPORTERS_UP, f"sum by (job) ({job('up')})", "mps-exporter targets scraped successfully", FLEET),
)


def reads(expr: str) -> Set[str]:
    """The records of RECORDINGS an expression reads."""
    names = set(re.findall(r"(?<![\w:])([a-zA-Z_][\w]*:[\w:]*)", expr))
    return names & {r.record for r in RECORDINGS}


def check() -> None:
    """Every record in a known group, and none reads a record of its own group."""
    group_of = {r.record: r.group for r in RECORDINGS}
    for r in RECORDINGS:
        if r.group not in RECORDING_GROUPS:
            raise ValueError(f"{r.record}: group {r.group!r} not in {tuple(RECORDING_GROUPS)}")
        same = sorted(n for n in reads(r.expr) if group_of[n] == r.group)
        if same:
            raise ValueError(f"{r.record} reads {same} of its own group {r.group!r}: move it to a later group")

