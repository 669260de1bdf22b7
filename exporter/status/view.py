"""The node's MPS state as one typed view: what `mps-exporter status` shows.

Built on the same collection and the same rows as /metrics: `build()` joins the
snapshot with `join.join`, exactly as a scrape's render does, and shows the rows;
a server and a client are shown as their rows (ServerStatus and ClientStatus are
the row types), so a field added to a row is in `status --output json` as it is
in the metric emitted from it. The queue, the counters and the recent events come
from the log state, the Xid counts from the xid source's reading. So a number
`status` prints is the value /metrics publishes for the same moment; they cannot
disagree, and nothing here reads the exposition back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, TypeVar

from ..families import FamilyBuilder
from ..join import ClientRow, DaemonRow, GpuRow, ServerRow, rows_of
from ..logs.render import render_log_metrics
from ..model import REASONS, LogSnapshot, Snapshot
from ..sources.xid import XidGpu, XidReading, _code_order

Labels = Dict[str, str]

# Per-daemon counters worth a line in a status report (what went wrong, what changed hands).
# The log counters `status` lists, in its order, each with the words the report shows it by.
EVENT_COUNTERS: Dict[str, str] = {
    "mps_client_rejections_total": "refused clients",
    "mps_server_exits_with_clients_total": "servers exited with clients",
    "mps_server_handoffs_total": "handoffs",
    "mps_server_shutdown_deferrals_total": "shutdown deferrals",
    "mps_fatal_gpu_errors_total": "fatal GPU errors",
    "mps_clients_terminated_total": "clients ended by terminate_client",
    "mps_server_start_failures_total": "start failures",
    "mps_server_exits_total": "server exits",
    "mps_log_unrecognized_lines_total": "unrecognized log lines",
    "mps_control_accept_failures_total": "connections the control daemon could not accept",
}


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


# A server and a client are shown as their rows: every field of the row, the values in
# force with their origins (join.py).
ServerStatus = ServerRow
ClientStatus = ClientRow


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


# ---------------------------------------------------------------- the view
N = TypeVar("N", int, float)


def _number(v: Optional[N]) -> Optional[float]:
    # Whole numbers (bytes, counts, PIDs) print and encode as integers, as they always have.
    return None if v is None else (int(v) if float(v).is_integer() else v)


def build(snap: Snapshot, origin: str, daemons: Sequence[str] = ()) -> NodeStatus:
    """The view of one collection: its rows, as /metrics publishes them, plus the log state.
    `daemons`: the configured names, listed even where no source said anything of them."""
    rows = rows_of(snap)
    sources = [SourceStatus(name, o.success, o.error,
                            None if o.last_success_seconds is None else max(0.0, snap.now - o.last_success_seconds))
               for name, o in sorted(snap.outcomes.items())]
    by_name = {d.name: d for d in rows.daemons}
    names = [*by_name] + [n for n in [*snap.logs, *daemons] if n not in by_name]
    failed = {s.name: s.error or "no reason given" for s in sources if not s.ok}
    xid = snap.extra.get("xid")
    xids = {(g.index, g.uuid): g for g in xid.gpus} if isinstance(xid, XidReading) else {}
    return NodeStatus(time=snap.now, origin=origin, sources=sources,
                      gpus=[_gpu(g, xids.get((g.index, g.uuid))) for g in rows.gpus],
                      daemons=[_daemon(by_name.get(name), name, snap, failed) for name in dict.fromkeys(names)])


def failed_sources(st: NodeStatus) -> List[str]:
    """The sources that failed in this collection (`status` exits non-zero for them)."""
    return [s.name for s in st.sources if not s.ok]


def _gpu(g: GpuRow, xid: Optional[XidGpu]) -> GpuStatus:
    return GpuStatus(
        index=g.index, uuid=g.uuid, up=g.up, name=g.name, driver_version=g.driver_version,
        compute_mode=g.compute_mode, mig_mode=g.mig_mode, sharing_mode=g.sharing_mode,
        memory_used_bytes=g.memory_used_bytes, memory_total_bytes=g.memory_total_bytes,
        utilization_ratio=g.utilization_ratio, memory_utilization_ratio=g.memory_utilization_ratio,
        sm_active_ratio=g.sm_active_ratio, sm_occupancy_ratio=g.sm_occupancy_ratio,
        tensor_active_ratio=g.tensor_active_ratio, dram_active_ratio=g.dram_active_ratio,
        power_watts=g.power_watts, temperature_celsius=g.temperature_celsius, compute_processes=g.compute_processes,
        outside_mps=[OutsideProcess(p.pid, p.user, p.command, f"{p.namespace}/{p.pod}" if p.pod else "",
                                    p.memory_used_bytes) for p in g.outside_mps],
        xid_events_registered=None if xid is None else xid.registered,
        xids=[] if xid is None else sorted((XidStatus(code, seen.count, seen.last_seen) for code, seen in
                                            sorted(xid.xids.items(), key=lambda kv: _code_order(kv[0]))),
                                           key=lambda x: -(x.last_seen or 0.0)))


def _daemon(row: Optional[DaemonRow], name: str, snap: Snapshot, failed: Dict[str, str]) -> DaemonStatus:
    out = DaemonStatus(name=name, up=None)
    if row is not None:
        out = DaemonStatus(
            name=name, up=row.up, version=row.version, pipe_directory=row.pipe_directory,
            log_directory=row.log_directory, claim_uid=row.claim_uid, multiuser=row.multiuser,
            default_active_thread_ratio=row.default_active_thread_ratio,
            default_pinned_memory_limit_bytes=dict(row.default_pinned_memory_limit_bytes),
            servers=list(row.servers), clients=list(row.clients))
    log = snap.logs.get(name)
    if log is not None:
        _logged(out, log, snap.now)
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


def _logged(out: DaemonStatus, log: LogSnapshot, now: float) -> None:
    """What the daemon's logs tell: the queue, the counters, who waits since when, and what
    happened when."""
    out.queued_clients = {reason: log.queued.get(reason, 0) for reason in REASONS}
    out.oldest_queued_wait_seconds = _number(log.oldest_queued_wait(now))
    out.client_limit = log.client_limit
    out.counters = _counters(out.name, log, now)
    out.queued = [QueuedClient(p.pid, p.uid, p.reason, p.pushed_at, max(0.0, now - p.pushed_at))
                  for p in log.pending]
    out.events = [Event(e.time, e.kind, e.server_pid, list(e.clients), e.detail)
                  for e in sorted(log.recent_events, key=lambda e: e.time)]


def _counters(daemon: str, log: LogSnapshot, now: float) -> List[Counter]:
    """The EVENT_COUNTERS as the log families count them (logs/render.py): their values as
    objects, never text. (Until the log state holds its counters as one map by metric name.)"""
    families = FamilyBuilder()
    render_log_metrics(families, daemon, log, now)
    samples: Mapping[str, List[Counter]] = {
        name: [Counter(name, {k: v for k, v in s.labels.items() if k != "daemon"}, _number(s.value) or 0)
               for s in part]
        for name, part in families.parts() if name in EVENT_COUNTERS}
    return [c for metric in EVENT_COUNTERS for c in samples.get(metric, [])]
