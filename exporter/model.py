"""Plain data the sources return and the collector joins.

Sources turn their library's answers into these types; nothing downstream
touches pynvml, subprocess or /proc. Replay and tests build them from recorded
data.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from .contract import MAX_PLAUSIBLE_QUEUE_WAIT, QUEUE_WAIT_BUCKETS
from .logs.events import FILES, DeviceKey

T = TypeVar("T")


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether `a` and `b` hold the very same objects, in order. A source gives its last
    reading again (the same object) while it is equal, so what is derived from readings
    is known unchanged without comparing them (issue 44)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Derived(Generic[T]):
    """A value derived from readings, derived again only where one of them is another
    object or `key` (compared by value) changed."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[Sequence[object], object, T]] = None  # one object: read whole by any thread

    def get(self, readings: Sequence[object], key: object, derive: Callable[[], T]) -> T:
        last = self._last
        if last is not None and last[1] == key and same_objects(last[0], readings):
            return last[2]
        value = derive()
        self._last = (readings, key, value)
        return value


# ---------------------------------------------------------------- NVML / DCGM
@dataclass
class ProcessMemory:
    pid: int
    used_bytes: Optional[int]  # None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)


@dataclass
class ProcessUtilization:
    pid: int
    sm_ratio: float  # 0..1
    # NVML sample time, microseconds: which sample is newest, never served, so not what a
    # reading says (a newer sample at the same ratio is an equal reading; issue 44)
    timestamp_us: int = field(compare=False)


@dataclass
class GpuReading:
    index: int
    uuid: str
    up: bool  # False: NVML failed for this GPU in this scrape (the other fields may be empty)
    name: str = ""
    compute_mode: str = ""  # default, exclusive_process, prohibited, ...
    mig_enabled: bool = False
    memory_total_bytes: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    utilization_ratio: Optional[float] = None
    memory_utilization_ratio: Optional[float] = None
    power_watts: Optional[float] = None
    temperature_celsius: Optional[float] = None
    compute_processes: List[ProcessMemory] = field(default_factory=list)
    mps_clients: List[ProcessMemory] = field(default_factory=list)
    process_utilization: List[ProcessUtilization] = field(default_factory=list)
    # keys: sm_active, sm_occupancy, tensor_active, dram_active (ratios 0..1), from
    # NVML GPM; DCGM's reading (Snapshot.dcgm) wins over these where it has a value.
    activity: Dict[str, float] = field(default_factory=dict)


@dataclass
class NvmlReading:
    driver_version: str
    gpus: List[GpuReading]


# DCGM GPU id -> {sm_active, sm_occupancy, tensor_active, dram_active}: ratios 0..1.
DcgmReading = Dict[int, Dict[str, float]]


# ------------------------------------------------------------- control daemon
@dataclass
class PsEntry:
    """One row of the control daemon's `ps`, or, from a daemon without `ps` (R470), one
    client of `get_client_list` with its device from `get_device_client_list`: then
    `client_id` is None and `namespace` and `command` are "" (only `ps` prints them)."""

    pid: int
    client_id: Optional[int]  # None: not known (no `ps`)
    server_pid: int
    device: str  # UUID prefix as `ps` prints it, e.g. GPU-a20825ef-ef8f-4f37; a whole UUID or "" without `ps`
    namespace: str
    command: str


@dataclass
class ServerFacts:
    pid: int
    status: Optional[str]  # ACTIVE, INITIALIZING, FAULT; None if the daemon did not say
    active_thread_percentage: Optional[float] = None
    pinned_limits: Dict[int, int] = field(default_factory=dict)  # the node's GPU index -> bytes


@dataclass
class DaemonReading:
    name: str
    up: bool
    pipe_directory: str
    log_directory: str
    version: str = ""
    claim_uid: str = ""  # DRA: the resource claim the daemon serves
    multiuser: Optional[bool] = None  # started with -M (its command line in /proc); None: not known
    # (st_dev, st_ino) of its pipe directory: a client whose CUDA_MPS_PIPE_DIRECTORY is the
    # same directory (seen through its own root) is its client. None: not there.
    pipe_identity: Optional[Tuple[int, int]] = None
    # The daemon's own CUDA_VISIBLE_DEVICES (/proc/PID/environ): it and its clients count
    # device ordinals in it. None: unset or not known (every GPU, in NVML's order).
    visible_devices: Optional[str] = None
    default_active_thread_percentage: Optional[float] = None
    default_pinned_limits: Dict[int, int] = field(default_factory=dict)  # the node's GPU index -> bytes
    default_client_priority: Optional[int] = None  # None: not set or the daemon lacks the command
    servers: List[ServerFacts] = field(default_factory=list)
    clients: List[PsEntry] = field(default_factory=list)
    # Set when the daemon could not be read for a reason other than "not
    # running" (timeout, missing binary, unparsable reply): the collector fails.
    error: Optional[str] = None
    # verb -> commands the exporter has sent this daemon since it started (each one
    # is echoed into control.log). The exporter's own count, not the daemon's state:
    # left out of comparisons, so that the readings compare equal while the daemon's
    # answers stay the same (render.readings_key).
    commands_sent: Dict[str, int] = field(default_factory=dict, compare=False)
    # verb -> optional commands the daemon did not know (`Unknown command`): those answers,
    # and each one the exporter did not send since because of them. Left out of comparisons.
    commands_unknown: Dict[str, int] = field(default_factory=dict, compare=False)


# ------------------------------------------------------------------- /proc
@dataclass
class ProcessFacts:
    pid: int
    uid: Optional[int] = None
    user: str = ""
    command: str = ""
    start_time_seconds: Optional[float] = None
    container_id: str = ""
    pod_uid: str = ""
    # Names of the container (runtime_metadata.py) or Slurm job (sources/proc.py) in the
    # Kubernetes columns: Kubernetes' namespace, pod, container; ECS's cluster, task id,
    # container; `docker` and a Docker container's name twice; `slurm`, the job (also
    # pod_uid) and step.
    namespace: str = ""
    pod: str = ""
    container: str = ""
    owner: str = ""  # who named them: runtime_metadata.OWNERS, "" where nobody did
    # Only procfs.KEPT_ENV_VARS are ever kept from /proc/PID/environ, as written: how CUDA
    # reads them depends on the GPUs (limits.own_limits).
    environ: Dict[str, str] = field(default_factory=dict)
    # (st_dev, st_ino) of the pipe directory it connects to (its CUDA_MPS_PIPE_DIRECTORY, MPS's
    # /tmp/nvidia-mps where unset) through /proc/PID/root; None where that cannot be told.
    mps_pipe: Optional[Tuple[int, int]] = None


# ---------------------------------------------------------------- the MPS logs
# What the log state machine (logs/state.py) publishes for one scrape: plain data, so
# that this module and the pure join (render.py) need no part of the log pipeline.
SERVER_STARTING = "server_starting"
USER_SWITCH = "user_switch"
REASONS = (SERVER_STARTING, USER_SWITCH)

REJECTION_REASONS = ("client_limit", "invalid_credentials", "other")
MAX_LIMIT_CHANGES = 64  # per server
THREADS = -1  # the "device" of an active thread percentage in a server's limit history

# A client's limits as they were when it connected: (active thread percentage,
# {device as MPS names it: pinned bytes}).
ClientLimits = Tuple[Optional[float], Dict[DeviceKey, int]]


@dataclass
class LogServer:
    """One MPS server as the logs describe it."""

    pid: int
    uid: Optional[int] = None  # `Starting new server S for user U`
    start_time: Optional[float] = None  # `NEW SERVER S: Ready`
    active_thread_percentage: Optional[float] = None  # logged at server start
    pinned_limits: Dict[DeviceKey, int] = field(default_factory=dict)  # device as MPS names it -> bytes
    running: bool = True  # False once server.log says `Exiting` (control.log has not yet said `exited`)
    start_failure: Optional[str] = None  # server.log's reason, where it gave one
    # internal: the daemon itself asked it to shut down (not a Cmd:)
    daemon_shutdown: bool = False
    # (time, device or THREADS, value) in time order: the files are read one after
    # the other, so a change can arrive after a later one of the other file.
    limit_changes: List[Tuple[float, DeviceKey, float]] = field(default_factory=list)
    priority: Optional[int] = None  # `Server Priority set to N`: its clients' unless they set their own

    @property
    def ready(self) -> bool:
        return self.start_time is not None

    def copy(self) -> "LogServer":
        """Every field, the containers copied (the state machine goes on changing them)."""
        return replace(self, pinned_limits=dict(self.pinned_limits), limit_changes=list(self.limit_changes))

    def change_limit(self, ts: float, device: DeviceKey, value: float) -> None:
        # In time order, after changes of the same time: ordinals and UUIDs do not compare.
        self.limit_changes.insert(bisect.bisect_right([c[0] for c in self.limit_changes], ts), (ts, device, value))
        if len(self.limit_changes) > MAX_LIMIT_CHANGES:
            del self.limit_changes[1]  # keep the first: the limits the server started with
        self.active_thread_percentage, self.pinned_limits = self._limits_until(float("inf"))

    def _limits_until(self, ts: float) -> ClientLimits:
        atp: Optional[float] = None
        pinned: Dict[DeviceKey, int] = {}
        for when, device, value in self.limit_changes:
            if when > ts:
                break
            if device == THREADS:
                atp = value
            elif value > 0:
                pinned[device] = int(value)
            else:  # 0 removes the limit
                pinned.pop(device, None)
        return atp, pinned

    def limits_at(self, ts: float) -> Optional[ClientLimits]:
        """The limits a client connecting at `ts` got; None where the logs do not reach back
        to the server's start (a server's first limit line is its thread percentage)."""
        if not self.limit_changes or self.limit_changes[0][0] > ts or self.limit_changes[0][1] != THREADS:
            return None
        return self._limits_until(ts)


@dataclass
class PendingClient:
    pid: int
    uid: int
    reason: str
    pushed_at: float
    served_at: Optional[float] = None  # a server of its user became ready


@dataclass
class LogEvent:
    """Something that went wrong or changed hands, kept with its time for `status`.

    kind: fatal_gpu_error (clients: the processes left with a sticky error), handoff
    (a server the daemon shut down for a waiting client of another user), start_failure,
    exit_with_clients (clients: those still connected), client_rejected (detail: why),
    client_terminated (clients: the client an operator ended with terminate_client),
    left_queue (clients: a queued client whose process is gone; its time is when that
    was seen, not a log line's).
    """

    time: float
    kind: str
    server_pid: Optional[int] = None
    clients: List[int] = field(default_factory=list)
    detail: str = ""

    def copy(self) -> "LogEvent":
        return replace(self, clients=list(self.clients))


def queue_wait_histogram(counts: Optional[List[int]] = None, total: float = 0.0, implausible: int = 0) -> "Histogram":
    """mps_client_queue_wait_seconds of one reason: QUEUE_WAIT_BUCKETS, and a wait outside
    0..MAX_PLAUSIBLE_QUEUE_WAIT is not a wait but a clock step or a corrupt timestamp (one
    line dated 9999 would add 2.5e11 s to the sum for good): counted in `implausible` and
    nowhere else."""
    return Histogram(QUEUE_WAIT_BUCKETS, counts or [], total, implausible, MAX_PLAUSIBLE_QUEUE_WAIT)


@dataclass
class LogSnapshot:
    """A consistent copy of the state for one scrape. Never shared with the writer."""

    servers: Dict[int, LogServer] = field(default_factory=dict)
    client_start_times: Dict[int, float] = field(default_factory=dict)
    client_limits: Dict[int, ClientLimits] = field(default_factory=dict)  # client pid -> limits at connection
    queued: Dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS})
    oldest_queued_since: Optional[float] = None  # unix time of the oldest push still waiting
    queue_wait: Dict[str, Histogram] = field(default_factory=lambda: {r: queue_wait_histogram() for r in REASONS})
    pushes: Dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS})
    # The counted log events, keyed by the name of the metric that publishes them
    # (exporter/logs/render.py declares it; a name absent here counts 0). Persisted as
    # this map: a new counted event adds no field, no list, no keyword anywhere.
    counts: Dict[str, int] = field(default_factory=dict)
    rejections: Dict[str, int] = field(default_factory=dict)  # reason -> count
    client_limit: Optional[int] = None  # "Maximum number of clients (N)" of the last refusal
    server_exits: Dict[str, int] = field(default_factory=dict)  # exit status -> count
    commands: Dict[str, int] = field(default_factory=dict)
    # `Cmd:set_*` lines seen: when it grows, the control source reads the limits again at
    # once instead of serving its cached ones for up to a minute.
    limit_commands: int = 0
    # Lines after which the daemon's `get_server_list`, `ps` or `get_server_status` may
    # answer differently (clients and servers coming and going, faults, daemon restarts):
    # while it stands still, the control source sends none but `get_server_list`.
    control_changes: int = 0
    lines: Dict[str, int] = field(default_factory=lambda: {f: 0 for f in FILES})
    unrecognized: Dict[str, int] = field(default_factory=lambda: {f: 0 for f in FILES})
    truncated: Dict[str, int] = field(default_factory=lambda: {f: 0 for f in FILES})
    daemon_pid: Optional[int] = None
    last_line_times: Dict[str, float] = field(default_factory=dict)  # file -> timestamp of its newest line
    pending: List[PendingClient] = field(default_factory=list)  # still waiting, oldest first
    recent_events: List[LogEvent] = field(default_factory=list)  # oldest first, at most MAX_RECENT_EVENTS
    # Set by the pipeline, not the state machine: how reading the files goes.
    read_errors: Dict[Tuple[str, str], int] = field(default_factory=dict)  # (file, reason) -> failures begun
    rotation_gaps: Dict[str, int] = field(default_factory=dict)  # file -> rotations whose unread part was lost
    state_file_errors: Optional[Dict[str, int]] = field(default=None, compare=False)  # reason -> times; None: no file
    problems: Tuple[str, ...] = ()  # why a file cannot be read now (messages naming the path); () when fine
    # False from a start until the files have been read to their end once: the counters are
    # still climbing through history, so the logs are not served (sources/logs.py).
    caught_up: bool = True
    backlog_bytes: int = 0  # bytes of the files not read yet (as of the last publish)

    def count(self, metric: str) -> int:
        """The count of a counted log event, by the name of its metric."""
        return self.counts.get(metric, 0)

    def oldest_queued_wait(self, now: float) -> float:
        """Age of the oldest pending client, among waits of 0 s to MAX_PLAUSIBLE_QUEUE_WAIT:
        a push dated 1970 or next year (a corrupt line, a clock step) is no wait, and would
        hold the gauge at decades for as long as that client stays pending."""
        waits = (now - p.pushed_at for p in self.pending)
        return max((w for w in waits if 0.0 <= w <= MAX_PLAUSIBLE_QUEUE_WAIT), default=0.0)


# ------------------------------------------------------------------ one scrape
@dataclass
class Histogram:
    """Observations in buckets of `bounds` (non-cumulative counts, the last one +Inf).

    With `plausible_max`, a value outside 0..plausible_max (NaN included) is no
    observation: it is counted in `implausible` and nowhere else."""

    bounds: Sequence[float]
    counts: List[int] = field(default_factory=list)
    total: float = 0.0
    implausible: int = 0
    plausible_max: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if self.plausible_max is not None and not 0.0 <= value <= self.plausible_max:
            self.implausible += 1
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> List[Tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts):
            running += n
            out.append((float(bound), running))
        return out

    def copy(self) -> "Histogram":
        return replace(self, counts=list(self.counts))


@dataclass
class Outcome:
    """How one collector did in one collection."""

    success: bool
    duration_seconds: float
    # The collection time of its last successful read; older than the
    # collection's own time when a late source's last reading is served.
    last_success_seconds: Optional[float] = None
    error: Optional[str] = None  # why it failed (`status` shows it; /metrics has only success)
    refresh_interval_seconds: float = 0.0  # of its background reads; 0: read in the collection


# ------------------------------------------------------- exits at the memory edge
# Why a client that left is counted (exits.py): its last reading was within the margin of
# its own pinned limit, or its GPU was nearly full.
CLIENT_LIMIT, DEVICE_FULL = "client_limit", "device_full"
EDGE_REASONS = (CLIENT_LIMIT, DEVICE_FULL)


@dataclass(frozen=True)
class EdgeExit:
    """A client that left while its last memory reading was at the edge (exits.py)."""

    daemon: str
    pid: int
    gpu: int
    reason: str  # EDGE_REASONS
    outcome: str  # exitstatus.OUTCOMES: failed, clean, unknown
    used_bytes: int  # the reading judged (exits.py: the last, or the last at the edge)
    limit_bytes: Optional[int]  # the pinned limit in force then; None: none
    gpu_used_bytes: Optional[int]  # the GPU's used and total memory at that reading
    gpu_total_bytes: Optional[int]
    reading_time: float  # the collection that took that reading
    seen_gone: float  # the first collection that found it gone
    detail: str = ""  # "exit status 1", "signal 9"; "" where unknown
    namespace: str = ""
    pod: str = ""
    container: str = ""


@dataclass(frozen=True)
class EdgeReport:
    """What the exit tracker knows after a collection: rendered with the snapshot.

    exits: (daemon, gpu, reason, outcome) -> count since the exporter started (zero rows
    for every daemon and GPU seen, so that the alert's increase() sees the first one);
    peaks: the most memory each client still connected has held, per GPU;
    pod_peaks: the most memory the pod's clients of a server held at once, per GPU, while
    it has clients; recent: the last edge exits,
    oldest first."""

    exits: Tuple[Tuple[Tuple[str, int, str, str], int], ...] = ()
    # ((daemon, pid, gpu), (namespace, pod, container, bytes))
    peaks: Tuple[Tuple[Tuple[str, int, int], Tuple[str, str, str, int]], ...] = ()
    # ((daemon, server pid, pod uid, gpu), (namespace, pod, bytes))
    pod_peaks: Tuple[Tuple[Tuple[str, str, str, int], Tuple[str, str, int]], ...] = ()
    recent: Tuple[EdgeExit, ...] = ()


@dataclass
class Snapshot:
    """What every source returned in one collection: the input of `render`."""

    now: float
    nvml: Optional[NvmlReading] = None
    dcgm: DcgmReading = field(default_factory=dict)
    daemons: List[DaemonReading] = field(default_factory=list)
    processes: Dict[int, ProcessFacts] = field(default_factory=dict)
    logs: Dict[str, LogSnapshot] = field(default_factory=dict)  # daemon name -> its log state
    outcomes: Dict[str, Outcome] = field(default_factory=dict)
    read_durations: Dict[str, Histogram] = field(default_factory=dict)  # collector -> all its reads so far
    # Readings of sources that render their own families (Source.render), by source name.
    extra: Dict[str, object] = field(default_factory=dict)
    # The exit tracker's state after this collection (exits.py); None: not tracked
    # (a one-off collection: dump, status without --watch).
    edges: Optional[EdgeReport] = None
