"""One definition per alert (recording rules: recordings.py); generate.py turns them into
Prometheus rule files, a PrometheusRule and Grafana-managed alert rules.

Descriptions are Go templates (Prometheus and Grafana both use them): `lbl(x)`
writes `{{ $labels.x }}`, VALUE the alert's value. Thresholds and selectors come
from config.py only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from . import config as C
from .expressions import TARGET as T
from .expressions import client_info_join, counted_in, job, memory_fill_prediction, pod_client_memory_ratio
from .expressions import server_info_join
from .recordings import (  # noqa: F401 (RECORDINGS, Recording: generate.py's and the tests' view of the rules)
    DAEMON_UP_MAX,
    GPU_MEMORY_USAGE,
    QUEUE_WAIT_P95,
    RECORDINGS,
    Recording,
)
from .recordings import check as check_recordings

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True)
class Alert:
    name: str  # without the prefix
    group: str  # contention | xid | oom | exporter
    expr: str
    for_: str
    severity: str
    summary: str  # static sentence
    description: str  # Go template

    @property
    def alertname(self) -> str:
        return C.ALERT_PREFIX + self.name

    @property
    def anchor(self) -> str:
        # GitHub's anchor for the heading "## <alertname>".
        return self.alertname.lower()


def lbl(name: str) -> str:
    return "{{ $labels.%s }}" % name


NODE = lbl(C.NODE_LABEL)
VALUE = "{{ $value }}"
# ", pod <namespace>/<pod>" where the alert has them (the exporter names the pod), else nothing.
IN_POD = "{{ with $labels.pod }}, pod {{ $labels.namespace }}/{{ . }}{{ end }}"
# The client; or (--mps.client-granularity server) the fullest client of a server, marked
# clients="fullest"; or (--mps.client-granularity pod) a pod's clients together.
CLIENTS = ("{{ if $labels.pid }}MPS client {{ $labels.pid }} ({{ $labels.command }}, user {{ $labels.user }}"
           + IN_POD + "){{ else if $labels.clients }}The fullest MPS client"
           "{{ else }}The MPS clients of pod {{ with $labels.pod }}{{ $labels.namespace }}/{{ . }}"
           "{{ else }}UID {{ $labels.pod_uid }}{{ end }} (together){{ end }}")
# Each client's memory over the pinned limit that binds it, as the exporter serves it.
CLIENT_RATIO = job("mps_client_pinned_memory_usage_ratio")
# --mps.client-granularity server: per server and GPU, the client nearest its limit.
FULLEST_CLIENT = f'label_replace({job("mps_server_client_pinned_memory_usage_max_ratio")}, "clients", "fullest", "", "")'


def with_server_user(expr: str) -> str:
    """Adds the server's `user`/`uid` from mps_server_info; keeps the series
    when the info is missing (an alert must not vanish with a failed `ps`)."""
    return (f"({expr})\n  {server_info_join(job)}\n"
            f"or on({T}, daemon, server_pid)\n  ({expr})")


def xid_codes(codes: Dict[str, str]) -> str:
    """The regex of an xid matcher for these codes."""
    return "|".join(codes)


def xid_meaning(codes: Dict[str, str]) -> str:
    """A Go template naming the alert's Xid code from config.py's list."""
    branches = [f'{{{{ {"if" if i == 0 else "else if"} eq $labels.xid "{code}" }}}}{meaning}'
                for i, (code, meaning) in enumerate(codes.items())]
    return "".join(branches) + "{{ end }}"


def xid_alert(name: str, codes: Dict[str, str], severity: str, summary: str, consequence: str) -> Alert:
    return Alert(
        name, "xid", counted_in(job, "mps_gpu_xid_errors_total", C.XID_WINDOW, xid=f"=~{xid_codes(codes)}"),
        "0m", severity, summary,
        f"GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} reported Xid {lbl('xid')} ({xid_meaning(codes)}) "
        f"{{{{ $value | printf \"%.0f\" }}}} time(s) in the last {C.XID_WINDOW}: {consequence}")


# -------------------------------------------------------------------- alerts

ALERTS: Tuple[Alert, ...] = (
    # contention ----------------------------------------------------------
    Alert(
        "ClientsQueuedBehindOtherUser", "contention",
        # A daemon started with -M runs one server for every user: nobody queues behind another user.
        f"{job('mps_queued_clients', reason='user_switch')} > 0\n"
        f"unless on({T}, daemon) {job('mps_control_daemon_info', multiuser='true')}",
        C.QUEUED_BEHIND_USER_FOR, "warning",
        "MPS clients are waiting for another user's MPS server to drain.",
        f"{VALUE} client(s) of MPS control daemon {lbl('daemon')} on {NODE} have waited more than "
        f"{C.QUEUED_BEHIND_USER_FOR} on the pending list: MPS runs one user's server per GPU and "
        f"admits them only when the other user's clients have all exited."),
    Alert(
        "QueueWaitHigh", "contention",
        f"{QUEUE_WAIT_P95} > {C.QUEUE_WAIT_P95_SECONDS}", C.QUEUE_WAIT_FOR, "warning",
        "MPS clients wait long before they are admitted.",
        f"The p95 wait of MPS clients on the pending list (reason {lbl('reason')}) of daemon "
        f"{lbl('daemon')} on {NODE} is {{{{ $value | humanizeDuration }}}} over the last "
        f"{C.QUEUE_WAIT_WINDOW} (threshold {C.QUEUE_WAIT_P95_SECONDS}s)."),
    Alert(
        "ServerNearClientLimit", "contention",
        # The ceiling MPS enforced where a refusal showed it (fewer than 48 when clients raise
        # CUDA_DEVICE_MAX_CONNECTIONS: 15 at 8, issue 38), else the default.
        with_server_user(
            f"{job('mps_server_clients')}\n  >= on({T}, daemon) group_left()\n"
            f"  ceil({C.CLIENT_LIMIT_WARNING_RATIO} * ({job('mps_server_client_limit')}\n"
            f"    or on({T}, daemon) count by ({T}, daemon) ({job('mps_server_clients')}) * 0 "
            f"+ {C.MAX_CLIENTS_PER_DEVICE}))"),
        C.CLIENT_LIMIT_FOR, "warning",
        "An MPS server is close to the most clients MPS admits per device.",
        f"MPS server {lbl('server_pid')} of user {lbl('user')} (daemon {lbl('daemon')}) on {NODE} has "
        f"{VALUE} clients, at least {C.CLIENT_LIMIT_WARNING_RATIO:.0%} of what MPS admits per device "
        f"({C.MAX_CLIENTS_PER_DEVICE}, or fewer where a refusal showed it: mps_server_client_limit); "
        f"new clients beyond that fail to connect."),
    Alert(
        "ClientsRefused", "contention",
        f"increase({job('mps_client_rejections_total')}[{C.CLIENT_REFUSAL_WINDOW}]) > 0", "0m", "warning",
        "MPS servers refuse new clients.",
        f"An MPS server of daemon {lbl('daemon')} on {NODE} refused {{{{ $value | printf \"%.0f\" }}}} "
        f"client(s) ({lbl('reason')}) in the last {C.CLIENT_REFUSAL_WINDOW}: each refused process failed "
        f"with 'CUDA-capable device(s) is/are busy or unavailable' after about half a minute."),
    Alert(
        "GpuSaturatedShared", "contention",
        f"{job('mps_gpu_sm_active_ratio')} > {C.SATURATION_SM_ACTIVE_RATIO}\n"
        f"and {job('mps_gpu_clients')} >= {C.SATURATION_MIN_CLIENTS}", C.SATURATION_FOR, "warning",
        "A GPU shared by several MPS clients is saturated.",
        f"GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} has had {{{{ $value | humanizePercentage }}}} "
        f"of its SMs active for {C.SATURATION_FOR} while at least {C.SATURATION_MIN_CLIENTS} MPS clients "
        f"share it: each client runs slower than it would alone."),
    Alert(
        "ServerFault", "contention",
        with_server_user(f"{job('mps_server_status', status='FAULT')} == 1"), C.SERVER_FAULT_FOR, "critical",
        "An MPS server is in FAULT state.",
        f"MPS server {lbl('server_pid')} of user {lbl('user')} (daemon {lbl('daemon')}) on {NODE} is in "
        f"FAULT: it refuses new clients until all of its clients have exited."),
    Alert(
        "FatalGpuError", "contention",
        f"increase({job('mps_fatal_gpu_errors_total')}[{C.FATAL_ERROR_WINDOW}]) > 0", "0m", "critical",
        "An MPS server handled a fatal GPU error.",
        f"MPS control daemon {lbl('daemon')} on {NODE} logged {{{{ $value | printf \"%.0f\" }}}} fatal GPU "
        f"error(s) in the last {C.FATAL_ERROR_WINDOW}: every client of the affected server lost its work."),
    Alert(
        "ServerExitedWithClients", "contention",
        f"increase({job('mps_server_exits_with_clients_total')}[{C.SERVER_DEATH_WINDOW}]) > 0", "0m", "critical",
        "An MPS server exited while clients were connected.",
        f"{{{{ $value | printf \"%.0f\" }}}} MPS server(s) of daemon {lbl('daemon')} on {NODE} exited with "
        f"clients still connected in the last {C.SERVER_DEATH_WINDOW} (killed or crashed; control.log "
        f"says 'exited with status 0' all the same): those clients lost their work."),
    Alert(
        "ServerCrashLooping", "contention",
        f"sum without(status) (increase({job('mps_server_exits_total', status='!=0')}[{C.SERVER_LOOP_WINDOW}])) "
        f"> {C.SERVER_CRASHES_MAX}", "0m", "warning",
        "MPS servers keep exiting with an error.",
        f"MPS servers of daemon {lbl('daemon')} on {NODE} exited {{{{ $value | printf \"%.0f\" }}}} times "
        f"with a non-zero status in the last {C.SERVER_LOOP_WINDOW}."),
    Alert(
        "ServerStartFailing", "contention",
        f"increase({job('mps_server_start_failures_total')}[{C.SERVER_LOOP_WINDOW}]) > {C.SERVER_START_FAILURES_MAX}",
        "0m", "critical",
        "MPS servers keep failing to start.",
        f"MPS control daemon {lbl('daemon')} on {NODE} failed to start a server "
        f"{{{{ $value | printf \"%.0f\" }}}} times in the last {C.SERVER_LOOP_WINDOW}: its clients cannot run."),
    Alert(
        "ProcessOutsideMps", "contention",
        f"{job('mps_process_outside_mps_info')}", C.OUTSIDE_MPS_FOR, "warning",
        "A CUDA process runs outside MPS on a GPU that MPS serves.",
        f"Process {lbl('pid')} ({lbl('command')}, user {lbl('user')}{IN_POD}) "
        f"has run on GPU {lbl('gpu')} ({lbl('uuid')}) of {NODE} beside MPS, not through it, for "
        f"{C.OUTSIDE_MPS_FOR}: no MPS limit binds it and it time-slices the GPU with the MPS server. Usually its "
        f"CUDA_MPS_PIPE_DIRECTORY is unset, different, or not mounted into its container."),
    Alert(
        "ControlDaemonDown", "contention",
        f"{job('mps_control_daemon_up')} == 0\n"
        f"and on({T}, daemon) max_over_time({DAEMON_UP_MAX}[{C.DAEMON_SEEN_WINDOW}]) == 1",
        C.DAEMON_DOWN_FOR, "critical",
        "An MPS control daemon that was running no longer answers.",
        f"MPS control daemon {lbl('daemon')} on {NODE} answered within the last {C.DAEMON_SEEN_WINDOW} but "
        f"has not answered for {C.DAEMON_DOWN_FOR}: new CUDA processes run without MPS or fail."),
    # Xid -----------------------------------------------------------------
    xid_alert("GpuXidCritical", C.XID_CRITICAL, "critical", "A GPU reported an Xid error that needs a reset or service.",
              "the GPU needs a reset, a reboot or service, and the work of every MPS client on it is lost. "
              "Drain the node."),
    xid_alert("GpuXidApplication", C.XID_APPLICATION, "warning", "A GPU reported an Xid error caused by an application.",
              "an application faulted; under MPS the other clients of its server lose their work with it "
              "(mps-exporter status names them beside the Xid)."),
    # OOM -----------------------------------------------------------------
    Alert(
        "ClientNearMemoryLimit", "oom",
        # The exporter's own ratio (no record copies it every round, issue 44); the client's user
        # and command joined to the few series over the line; without mps_client_info it alerts
        # all the same. Then the granularities that serve no client: pod (its sums' ratio), server.
        f"({CLIENT_RATIO} > {C.CLIENT_MEMORY_LIMIT_RATIO}) {client_info_join(job)}\n"
        f"or on({T}, daemon, pid, gpu)\n{CLIENT_RATIO} > {C.CLIENT_MEMORY_LIMIT_RATIO}\n"
        f"or\n{pod_client_memory_ratio(job)} > {C.CLIENT_MEMORY_LIMIT_RATIO}\n"
        f"or\n{FULLEST_CLIENT} > {C.CLIENT_MEMORY_LIMIT_RATIO}",
        C.CLIENT_MEMORY_FOR, "warning",
        "An MPS client is close to its pinned device memory limit.",
        f"{CLIENTS} of server {lbl('server_pid')} "
        f"on GPU {lbl('gpu')} of {NODE} uses {{{{ $value | humanizePercentage }}}} of its pinned device "
        f"memory limit: its next allocations fail with out-of-memory."),
    Alert(
        "ClientLimitIgnored", "oom",
        f"{job('mps_client_limit_ignored')}\n  {client_info_join(job)}\n"
        f"or\n{job('mps_server_clients_limit_ignored')} > 0", C.CLIENT_LIMIT_IGNORED_FOR, "warning",
        "An MPS client set a limit that CUDA does not apply.",
        "{{ if $labels.pid }}MPS client "
        f"{lbl('pid')} ({lbl('command')}, user {lbl('user')})"
        "{{ else }}{{ $value }} MPS client(s){{ end }}"
        f" of server {lbl('server_pid')} on {NODE} "
        f"set its {lbl('limit')} limit in its environment, but "
        f"CUDA drops it ({lbl('reason')}): the client runs as if it had set none, and may take the whole GPU."),
    Alert(
        "ClientExitedAtMemoryLimit", "oom",
        # round: increase() extrapolates one exit to 1.1 over the window; the count is whole.
        f"round(sum by ({T}, daemon, gpu, reason, outcome) (increase("
        f"{job('mps_client_exits_at_memory_limit_total', outcome='=~' + '|'.join(C.EDGE_EXIT_OUTCOMES))}"
        f"[{C.EDGE_EXIT_WINDOW}]))) > 0", C.EDGE_EXIT_FOR, "warning",
        "MPS clients exited at the edge of device memory, most likely of out-of-memory.",
        f"{VALUE} MPS client(s) of daemon {lbl('daemon')} on GPU {lbl('gpu')} of {NODE} exited "
        f"in the last {C.EDGE_EXIT_WINDOW} while their memory was "
        "{{ if eq $labels.reason \"client_limit\" }}at their pinned memory limit"
        "{{ else }}on a nearly full GPU{{ end }} (outcome "
        f"{lbl('outcome')}): MPS logs no out-of-memory, but that is how such clients die."),
    Alert(
        "GpuMemoryNearFull", "oom",
        f"{GPU_MEMORY_USAGE} > {C.GPU_MEMORY_FULL_RATIO}", C.GPU_MEMORY_FULL_FOR, "warning",
        "A GPU's memory is almost full.",
        f"GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} has {{{{ $value | humanizePercentage }}}} of its "
        f"memory in use: the next allocation of any client may fail with out-of-memory."),
    Alert(
        "GpuMemoryFillingUp", "oom",
        f"{memory_fill_prediction(job)}\n"
        f"  > {job('mps_gpu_memory_total_bytes')}\n"
        f"and {GPU_MEMORY_USAGE} > {C.MEMORY_FILL_MIN_RATIO}", C.MEMORY_FILL_FOR, "warning",
        "A GPU's memory is predicted to fill up.",
        f"At the rate of the last {C.MEMORY_FILL_WINDOW}, GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} runs "
        f"out of memory within {C.MEMORY_FILL_HORIZON_SECONDS // 3600}h (predicted "
        f"{{{{ $value | humanize1024 }}}}B used)."),
    # exporter ------------------------------------------------------------
    Alert(
        "ExporterCollectorFailing", "exporter",
        f"{job('mps_exporter_collector_success')} == 0", C.COLLECTOR_FAILING_FOR, "warning",
        "An mps-exporter collector keeps failing.",
        f"Collector {lbl('collector')} of the mps-exporter on {NODE} has failed for "
        f"{C.COLLECTOR_FAILING_FOR}: its metrics are missing and the alerts built on them are silent."),
    Alert(
        "ExporterReadingsStale", "exporter",
        f"timestamp({job('mps_exporter_collector_last_success_timestamp_seconds')})\n"
        f"  - {job('mps_exporter_collector_last_success_timestamp_seconds')}\n"
        f"> on({T}, collector)\n"
        f"  {C.READINGS_STALE_INTERVALS} * {job('mps_exporter_collector_refresh_interval_seconds')} "
        f"+ {C.READINGS_STALE_SLACK_SECONDS}",
        C.READINGS_STALE_FOR, "warning",
        "An mps-exporter serves old readings of a source.",
        f"The {lbl('collector')} readings the mps-exporter on {NODE} serves have been more than "
        f"{C.READINGS_STALE_INTERVALS} refresh intervals + {C.READINGS_STALE_SLACK_SECONDS} s old for "
        f"{C.READINGS_STALE_FOR} (now {{{{ $value | humanizeDuration }}}}): its metrics show the past, and "
        f"alerts built on them fire late or not at all."),
    Alert(
        "ExporterLogReadErrors", "exporter",
        f"increase({job('mps_log_read_errors_total')}[{C.LOG_READ_ERRORS_WINDOW}]) > 0", "0m", "warning",
        "The mps-exporter cannot read an MPS log file.",
        f"Reading {lbl('file')}.log of MPS control daemon {lbl('daemon')} on {NODE} began to fail "
        f"({lbl('reason')}) in the last {C.LOG_READ_ERRORS_WINDOW}: queueing, fault and server metrics from "
        f"that file stop while it lasts."),
    Alert(
        "GpuUnreachable", "exporter",
        f"{job('mps_gpu_up')} == 0", C.COLLECTOR_FAILING_FOR, "warning",
        "NVML does not answer for a GPU.",
        f"NVML has not answered for GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} for "
        f"{C.COLLECTOR_FAILING_FOR}: the GPU may have fallen off the bus."),
    Alert(
        "ExporterXidEventsUnregistered", "exporter",
        f"{job('mps_gpu_xid_events_registered')} == 0", C.XID_UNREGISTERED_FOR, "info",
        "The mps-exporter receives no Xid events of a GPU.",
        f"NVML refused to register GPU {lbl('gpu')} ({lbl('uuid')}) on {NODE} for Xid events (not supported, "
        f"or no permission): its Xid errors are not counted and MpsGpuXidCritical cannot fire for it."),
    Alert(
        "ExporterTargetDown", "exporter",
        f"{job('up')} == 0", C.TARGET_DOWN_FOR, "warning",
        "Prometheus cannot scrape an mps-exporter.",
        f"Prometheus has not scraped the mps-exporter on {NODE} for {C.TARGET_DOWN_FOR}: "
        f"no MPS alert fires for this machine."),
    # Absent data (issue 43): a rule on a series that is not there never fires.
    Alert(
        "ExporterMetricsMissing", "exporter",
        f"{job('up')} == 1\nunless on({T}) {job('mps_exporter_collector_success')}", C.NO_DATA_FOR, "warning",
        "A scraped mps-exporter target has none of the exporter's own series.",
        f"Prometheus scrapes {NODE} (job {lbl('job')}) successfully but has found no "
        f"mps_exporter_collector_success series there for {C.NO_DATA_FOR}: the target is not an mps-exporter, "
        f"or relabeling drops its series. Every MPS alert of this machine is silent."),
    Alert(
        "ExporterNoControlDaemon", "exporter",
        f"group by ({T}) ({job('mps_exporter_collector_success', collector='control')})\n"
        f"unless on({T}) {job('mps_control_daemon_up')}", C.NO_DATA_FOR, "warning",
        "An mps-exporter watches no MPS control daemon.",
        f"The control collector of the mps-exporter on {NODE} runs, but there has been no "
        f"mps_control_daemon_up series for {C.NO_DATA_FOR}: it watches no MPS control daemon (discovery "
        f"finds none, or none is configured), so MpsControlDaemonDown and the queue, fault and client alerts "
        f"cannot fire for this machine."),
)

GROUPS = ("contention", "xid", "oom", "exporter")


def check() -> None:
    """Catch definition mistakes before anything is written."""
    check_recordings()
    names = [a.alertname for a in ALERTS]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate alert names: {sorted(dupes)}")
    for a in ALERTS:
        if a.severity not in SEVERITIES:
            raise ValueError(f"{a.alertname}: severity {a.severity!r} not in {SEVERITIES}")
        if a.group not in GROUPS:
            raise ValueError(f"{a.alertname}: group {a.group!r} not in {GROUPS}")
