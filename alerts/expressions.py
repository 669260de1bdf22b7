"""PromQL written once, for the alerts, the recording rules and the dashboards.

Each expression takes a `Selector`: a function from a metric name (plus an
optional suffix such as `_bucket` and extra matchers) to a series selector.
Alerts and recording rules pass `job`, which applies config.JOB_SELECTOR;
dashboards pass their own (dashboards.common.m), which applies the dashboard
variables. So a threshold, window or join is stated in one place and the
selector is applied to every series either of them reads.
"""

from __future__ import annotations

from typing import Callable, List

from . import config as C

# (name, suffix="", **matchers) -> 'name_suffix{...}'; see matchers() for the values.
Selector = Callable[..., str]

# The labels that identify one exporter target, as a PromQL label list.
TARGET = ", ".join(C.TARGET_LABELS)


def matchers(**extra: str) -> List[str]:
    """PromQL matchers from keyword arguments: reason="user_switch" ->
    reason="user_switch"; a value led by an operator keeps it: status="!=0" ->
    status!="0" (also =~ and !~)."""
    out = []
    for label, value in extra.items():
        op = next((o for o in ("=~", "!=", "!~") if value.startswith(o)), "=")
        out.append(f'{label}{op}"{value[len(op):] if op != "=" else value}"')
    return out


def job(name: str, suffix: str = "", **extra: str) -> str:
    """The alerts' and recording rules' selector: config.JOB_SELECTOR plus `extra`."""
    return f"{name}{suffix}{{{', '.join([C.JOB_SELECTOR] + matchers(**extra))}}}"


# ------------------------------------------------------------------ memory
def gpu_memory_ratio(sel: Selector) -> str:
    """Share of each GPU's memory in use."""
    return f"{sel('mps_gpu_memory_used_bytes')} / {sel('mps_gpu_memory_total_bytes')}"


def memory_fill_prediction(sel: Selector) -> str:
    """Used memory MEMORY_FILL_HORIZON_SECONDS ahead, from the trend over MEMORY_FILL_WINDOW."""
    return (f"predict_linear({sel('mps_gpu_memory_used_bytes')}[{C.MEMORY_FILL_WINDOW}], "
            f"{C.MEMORY_FILL_HORIZON_SECONDS})")


def pod_client_memory_ratio(sel: Selector) -> str:
    """--mps.client-granularity pod: the share of the summed limits a pod's clients use,
    per server, pod and GPU (the exporter serves both sums, not their ratio)."""
    return (f"{sel('mps_pod_client_memory_used_bytes')}\n  / on({TARGET}, daemon, server_pid, pod_uid, gpu) "
            f"group_left\n  {sel('mps_pod_client_pinned_memory_limit_bytes')}")


def client_memory_ratio(sel: Selector) -> str:
    """Each client's memory against the pinned limit that binds it, as the exporter serves
    it (it knows both: no join, no record); from exporters with --mps.client-granularity
    pod, per server, pod and GPU."""
    return f"{sel('mps_client_pinned_memory_usage_ratio')}\nor\n  {pod_client_memory_ratio(sel)}"


# ------------------------------------------------------------------- joins
CLIENT_INFO_LABELS = "server_pid, uid, user, command, container_id, pod_uid"


def client_info_join(sel: Selector, labels: str = CLIENT_INFO_LABELS) -> str:
    """`* ...` that adds the client's `labels` from mps_client_info to a per-client series."""
    return f"* on({TARGET}, daemon, pid) group_left({labels}) {sel('mps_client_info')}"


def server_info_join(sel: Selector, labels: str = "uid, user") -> str:
    """`* ...` that adds the server's `labels` from mps_server_info to a per-server series."""
    return f"* on({TARGET}, daemon, server_pid) group_left({labels}) {sel('mps_server_info')}"


# --------------------------------------------------------------- queueing
def queue_wait_quantile(sel: Selector, q: float, window: str, by: str = "") -> str:
    """The q-quantile of the time clients waited on the pending list, over `window`;
    `by`: keep only these labels (plus le) before taking the quantile."""
    rate = f"rate({sel('mps_client_queue_wait_seconds', '_bucket')}[{window}])"
    if by:
        rate = f"sum by ({by}, le) ({rate})"
    return f"histogram_quantile({q}, {rate})"


# ------------------------------------------------------------------ events
def counted_in(sel: Selector, name: str, window: str, **extra: str) -> str:
    """How much a counter grew in `window`, including a series that first appeared in it:
    a counter the exporter creates at its first event (an Xid code) starts at 1, where
    increase() sees no growth."""
    series = sel(name, **extra)
    return f"increase({series}[{window}]) > 0\nor\n({series} unless {series} offset {window})"
