"""The node's MPS state as one typed view: what `mps-exporter status` shows.

Built on the same collection and the same join as /metrics: `build()` renders the
snapshot with `render.render`, exactly as a scrape does, and reads the view off
those samples. Only what no metric carries comes from the log state directly:
the clients still queued (PID, since when) and the recent events with their times.
So a number `status` prints is a sample /metrics publishes for the same moment;
they cannot disagree, and a new metric needs no second join here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..model import Snapshot
from ..render import render
from ..sources.registry import own_renders

Labels = Dict[str, str]

# Per-daemon counters worth a line in a status report (what went wrong, what changed hands).
EVENT_COUNTERS = (
    "mps_client_rejections_total",
    "mps_server_exits_with_clients_total",
    "mps_server_handoffs_total",
    "mps_server_shutdown_deferrals_total",
    "mps_fatal_gpu_errors_total",
    "mps_clients_terminated_total",
    "mps_server_start_failures_total",
    "mps_server_exits_total",
    "mps_log_unrecognized_lines_total",
)


@dataclass
class SourceStatus:
    name: str
    ok: bool
    error: Optional[str] = None  # why it failed, as the collector logged it
    # Seconds between the collection and the reading shown of this source (its last
    # success); None: no reading yet. Above 0 when a late source's last reading is shown.
    age_seconds: Optional[float] = None


@dataclass
class OutsideProcess:
    """A compute process on the GPU outside MPS (mps_process_outside_mps_info)."""

    pid: int
    user: str
    command: str
    pod: str  # namespace/pod, "" outside a pod
    memory_bytes: Optional[float]


@dataclass
class XidStatus:
    """One Xid code of a GPU (mps_gpu_xid_errors_total, _last_seen_timestamp_seconds)."""

    xid: str  # the code, or "other"
    count: float  # since the exporter started
    last_seen: Optional[float]  # unix time


@dataclass
class GpuStatus:
    index: int
    uuid: str
    up: bool
    name: str = ""
    driver_version: str = ""
    compute_mode: str = ""
    mig_mode: str = ""
    sharing_mode: Optional[str] = None  # mps, time_slicing, exclusive, mig, idle
    memory_used_bytes: Optional[float] = None
    memory_total_bytes: Optional[float] = None
    utilization_ratio: Optional[float] = None
    memory_utilization_ratio: Optional[float] = None
    sm_active_ratio: Optional[float] = None
    sm_occupancy_ratio: Optional[float] = None
    tensor_active_ratio: Optional[float] = None
    dram_active_ratio: Optional[float] = None
    power_watts: Optional[float] = None
    temperature_celsius: Optional[float] = None
    compute_processes: Optional[float] = None
    outside_mps: List[OutsideProcess] = field(default_factory=list)
    # None: the xid collector is off or failed; False: NVML refused its Xid events
    xid_events_registered: Optional[bool] = None
    xids: List[XidStatus] = field(default_factory=list)  # newest first


@dataclass
class ServerStatus:
    pid: int
    uid: Optional[int]
    user: str
    status: Optional[str]  # ACTIVE, INITIALIZING, FAULT; None where the daemon did not say
    clients: Optional[float]
    active_thread_ratio: Optional[float]
    pinned_memory_limit_bytes: Dict[int, float]  # by GPU index
    memory_used_bytes: Dict[int, float]  # the server process itself, by GPU index
    start_time: Optional[float]


@dataclass
class ClientStatus:
    pid: int
    server_pid: Optional[int]
    uid: Optional[int]
    user: str
    command: str
    pid_namespace: str
    container_id: str
    pod_uid: str
    namespace: str  # Kubernetes names of its container; "" outside a pod or where unknown
    pod: str
    container: str
    memory_used_bytes: Dict[int, float]  # by GPU index
    pinned_memory_limit_bytes: Dict[int, float]  # the limit in force, by GPU index
    active_thread_ratio: Optional[float]
    priority: Optional[float]  # CUDA_MPS_CLIENT_PRIORITY: 0 normal, 1 below normal
    start_time: Optional[float]


@dataclass
class QueuedClient:
    pid: int
    uid: int
    reason: str  # server_starting or user_switch
    since: float
    waiting_seconds: float


@dataclass
class Event:
    time: float
    kind: str  # fatal_gpu_error, handoff, start_failure, exit_with_clients, client_rejected, left_queue, client_terminated
    server_pid: Optional[int]
    clients: List[int]
    detail: str


@dataclass
class EdgeExitStatus:
    """A client that exited at the edge of memory (exits.py): its last reading, and how old
    that reading is now."""

    pid: int
    gpu: int
    reason: str  # client_limit, device_full
    outcome: str  # failed, clean, unknown
    detail: str  # "exit status 1", "signal 9"; "" where unknown
    used_bytes: int
    limit_bytes: Optional[int]
    gpu_used_bytes: Optional[int]
    gpu_total_bytes: Optional[int]
    reading_time: float
    reading_age_seconds: float  # the collection's time less the reading's
    seen_gone: float  # the first collection that found it gone
    pod: str  # namespace/pod, "" outside a pod
    container: str


@dataclass
class Counter:
    metric: str
    labels: Labels  # its labels other than daemon
    value: float


@dataclass
class DaemonStatus:
    """None where the source that tells it failed: unknown, not "none" or 0."""

    name: str
    up: Optional[bool]  # None: its control source failed or did not answer in time
    version: str = ""
    pipe_directory: str = ""
    log_directory: str = ""
    claim_uid: str = ""  # DRA: the resource claim it serves
    multiuser: Optional[bool] = None  # started with -M; None: not known
    default_active_thread_ratio: Optional[float] = None
    default_pinned_memory_limit_bytes: Dict[int, float] = field(default_factory=dict)
    servers: Optional[List[ServerStatus]] = field(default_factory=list)  # None: control failed
    clients: Optional[List[ClientStatus]] = field(default_factory=list)  # None: control failed
    queued_clients: Dict[str, float] = field(default_factory=dict)  # by reason
    oldest_queued_wait_seconds: Optional[float] = None
    client_limit: Optional[float] = None  # clients per device a server accepts, as its last refusal said
    # None below: the daemon's logs could not be read (log_error says why)
    queued: Optional[List[QueuedClient]] = field(default_factory=list)
    counters: Optional[List[Counter]] = field(default_factory=list)
    events: Optional[List[Event]] = field(default_factory=list)  # oldest first
    log_error: Optional[str] = None
    # The last clients that exited at the edge of memory, oldest first (mps_client_exits_at_memory_limit_total);
    # None: not tracked (a single collection cannot see a client leave: use --watch).
    edge_exits: Optional[List[EdgeExitStatus]] = None


@dataclass
class NodeStatus:
    time: float  # the collection's clock (unix time)
    origin: str  # what was read: "host NAME" or "bundle FILE at T s"
    sources: List[SourceStatus]
    gpus: List[GpuStatus]
    daemons: List[DaemonStatus]


# ---------------------------------------------------------------- samples
class Samples:
    """The samples of rendered families, by sample name."""

    def __init__(self, families: Sequence[Any]) -> None:
        self._by_name: Dict[str, List[Tuple[Labels, float]]] = defaultdict(list)
        for family in families:
            for s in family.samples:
                self._by_name[s.name].append((s.labels, _number(s.value)))

    def rows(self, name: str, **match: str) -> List[Tuple[Labels, float]]:
        return [(labels, v) for labels, v in self._by_name.get(name, ())
                if all(labels.get(k) == want for k, want in match.items())]

    def value(self, name: str, **match: str) -> Optional[float]:
        rows = self.rows(name, **match)
        return rows[0][1] if rows else None

    def by_gpu(self, name: str, **match: str) -> Dict[int, float]:
        return {int(labels["gpu"]): v for labels, v in self.rows(name, **match)}


def _number(v: float) -> float:
    # Whole numbers (bytes, counts, PIDs) print and encode as integers.
    return int(v) if float(v).is_integer() else v


def _bool(v: Optional[float]) -> Optional[bool]:
    return None if v is None else bool(v)


def _int(text: Optional[str]) -> Optional[int]:
    return int(text) if text else None


# ---------------------------------------------------------------- the view
def build(snap: Snapshot, origin: str, daemons: Sequence[str] = ()) -> NodeStatus:
    """The view of one collection: its samples, as /metrics would publish them, plus the log state.
    `daemons`: the configured names, listed even where no source said anything of them."""
    m = Samples(render(snap, own_renders=own_renders()).families())
    sources = [SourceStatus(name, o.success, o.error,
                            None if o.last_success_seconds is None else max(0.0, snap.now - o.last_success_seconds))
               for name, o in sorted(snap.outcomes.items())]
    names = [labels["daemon"] for labels, _ in m.rows("mps_control_daemon_up")]
    names += [n for n in [*snap.logs, *daemons] if n not in names]
    failed = {s.name: s.error or "no reason given" for s in sources if not s.ok}
    return NodeStatus(time=snap.now, origin=origin, sources=sources, gpus=_gpus(m),
                      daemons=[_daemon(m, name, snap, failed) for name in dict.fromkeys(names)])


def failed_sources(st: NodeStatus) -> List[str]:
    """The sources that failed in this collection (`status` exits non-zero for them)."""
    return [s.name for s in st.sources if not s.ok]


def _gpus(m: Samples) -> List[GpuStatus]:
    out = []
    for labels, up in m.rows("mps_gpu_up"):
        g = {"gpu": labels["gpu"], "uuid": labels["uuid"]}
        info = next((lab for lab, _ in m.rows("mps_gpu_info", **g)), {})
        mode = next((lab["mode"] for lab, _ in m.rows("mps_gpu_sharing_mode", **g)), None)
        out.append(GpuStatus(
            index=int(labels["gpu"]), uuid=labels["uuid"], up=bool(up), name=info.get("name", ""),
            driver_version=info.get("driver_version", ""), compute_mode=info.get("compute_mode", ""),
            mig_mode=info.get("mig_mode", ""), sharing_mode=mode,
            memory_used_bytes=m.value("mps_gpu_memory_used_bytes", **g),
            memory_total_bytes=m.value("mps_gpu_memory_total_bytes", **g),
            utilization_ratio=m.value("mps_gpu_utilization_ratio", **g),
            memory_utilization_ratio=m.value("mps_gpu_memory_utilization_ratio", **g),
            sm_active_ratio=m.value("mps_gpu_sm_active_ratio", **g),
            sm_occupancy_ratio=m.value("mps_gpu_sm_occupancy_ratio", **g),
            tensor_active_ratio=m.value("mps_gpu_tensor_active_ratio", **g),
            dram_active_ratio=m.value("mps_gpu_dram_active_ratio", **g),
            power_watts=m.value("mps_gpu_power_watts", **g),
            temperature_celsius=m.value("mps_gpu_temperature_celsius", **g),
            compute_processes=m.value("mps_gpu_compute_processes", **g),
            outside_mps=[OutsideProcess(int(lab["pid"]), lab["user"], lab["command"],
                                        f"{lab['namespace']}/{lab['pod']}" if lab.get("pod") else "",
                                        m.value("mps_process_outside_mps_memory_used_bytes", **g, pid=lab["pid"]))
                         for lab, _ in m.rows("mps_process_outside_mps_info", **g)],
            xid_events_registered=_bool(m.value("mps_gpu_xid_events_registered", **g)),
            xids=sorted((XidStatus(lab["xid"], v, m.value("mps_gpu_xid_last_seen_timestamp_seconds", **g, xid=lab["xid"]))
                         for lab, v in m.rows("mps_gpu_xid_errors_total", **g)),
                        key=lambda x: -(x.last_seen or 0.0))))
    return out


def _daemon(m: Samples, name: str, snap: Snapshot, failed: Dict[str, str]) -> DaemonStatus:
    d = {"daemon": name}
    info = next((lab for lab, _ in m.rows("mps_control_daemon_info", **d)), {})
    out = DaemonStatus(
        name=name, up=_bool(m.value("mps_control_daemon_up", **d)), version=info.get("version", ""),
        pipe_directory=info.get("pipe_directory", ""), log_directory=info.get("log_directory", ""),
        claim_uid=info.get("claim_uid", ""), multiuser={"true": True, "false": False}.get(info.get("multiuser", "")),
        default_active_thread_ratio=m.value("mps_default_active_thread_ratio", **d),
        default_pinned_memory_limit_bytes=m.by_gpu("mps_default_pinned_memory_limit_bytes", **d),
        queued_clients={lab["reason"]: v for lab, v in m.rows("mps_queued_clients", **d)},
        oldest_queued_wait_seconds=m.value("mps_queued_client_oldest_wait_seconds", **d),
        client_limit=m.value("mps_server_client_limit", **d))
    servers: List[ServerStatus] = []
    clients: List[ClientStatus] = []
    for labels, _ in m.rows("mps_server_info", **d):
        s = {**d, "server_pid": labels["server_pid"]}
        servers.append(ServerStatus(
            pid=int(labels["server_pid"]), uid=_int(labels["uid"]), user=labels["user"],
            status=next((lab["status"] for lab, _ in m.rows("mps_server_status", **s)), None),
            clients=m.value("mps_server_clients", **s),
            active_thread_ratio=m.value("mps_server_active_thread_ratio", **s),
            pinned_memory_limit_bytes=m.by_gpu("mps_server_pinned_memory_limit_bytes", **s),
            memory_used_bytes=m.by_gpu("mps_server_memory_used_bytes", **s),
            start_time=m.value("mps_server_start_time_seconds", **s)))
    for labels, _ in m.rows("mps_client_info", **d):
        c = {**d, "pid": labels["pid"]}
        clients.append(ClientStatus(
            pid=int(labels["pid"]), server_pid=_int(labels["server_pid"]), uid=_int(labels["uid"]),
            user=labels["user"], command=labels["command"],
            pid_namespace=labels["pid_namespace"],
            container_id=labels["container_id"], pod_uid=labels["pod_uid"],
            namespace=labels["namespace"], pod=labels["pod"], container=labels["container"],
            memory_used_bytes=m.by_gpu("mps_client_memory_used_bytes", **c),
            pinned_memory_limit_bytes=m.by_gpu("mps_client_pinned_memory_limit_bytes", **c),
            active_thread_ratio=m.value("mps_client_active_thread_ratio", **c),
            priority=m.value("mps_client_priority", **c),
            start_time=m.value("mps_client_start_time_seconds", **c)))
    out.servers, out.clients = servers, clients
    out.counters = [Counter(metric, {k: v for k, v in lab.items() if k != "daemon"}, v)
                    for metric in EVENT_COUNTERS for lab, v in m.rows(metric, **d)]
    log = snap.logs.get(name)
    if log is not None:  # what no metric carries: who waits since when, and what happened when
        out.queued = [QueuedClient(p.pid, p.uid, p.reason, p.pushed_at, max(0.0, snap.now - p.pushed_at))
                      for p in log.pending]
        out.events = [Event(e.time, e.kind, e.server_pid, list(e.clients), e.detail)
                      for e in sorted(log.recent_events, key=lambda e: e.time)]
    if snap.edges is not None:
        out.edge_exits = [EdgeExitStatus(e.pid, e.gpu, e.reason, e.outcome, e.detail, e.used_bytes, e.limit_bytes,
                                         e.gpu_used_bytes, e.gpu_total_bytes, e.reading_time,
                                         max(0.0, snap.now - e.reading_time), e.seen_gone,
                                         f"{e.namespace}/{e.pod}" if e.pod else "", e.container)
                          for e in snap.edges.recent if e.daemon == name]
    # A failed source tells nothing: what it would have said is unknown, not "none" or 0.
    if "control" in failed:
        out.up = None
        out.servers = out.servers or None  # a late source's last reading, where one is served, still shows
        out.clients = out.clients or None
    log_error = "; ".join(log.problems) if log is not None and log.problems else (
        failed["logs"] if "logs" in failed and log is None else None)
    if log_error is not None:
        out.log_error, out.queued, out.counters, out.events = log_error, None, None, None
    return out
