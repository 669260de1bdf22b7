"""Join what the sources saw in one collection into typed rows: GPU, daemon, server, client.

A pure function of a `Snapshot` (`join`): no I/O, no clock. Each row holds the values in
force, as /metrics publishes them and `status` shows them, and where the ones that have
more than one origin came from. Every output is a view of the rows: the metric families
(render.py: one emit line per metric), the pod and server sums (folds over client rows),
`status` (status/view.py), the exit tracker's readings (exits.py); the client table's
memo compares rows.

Joins (see README "Where the numbers come from"):
- clients: the daemon's `ps` (server, device, namespace, command) + NVML's MPS
  process list (memory by PID and GPU) + /proc (uid, container, env limits);
- limits in force: limits.client_limits (the server's as the client connected,
  from the logs, where they show it);
- start times: the MPS logs when they saw the event, else /proc start time;
- when the daemon does not answer, the servers the logs know to be running
  still get their info, limits and start time.

A new joined metric is a row field (here), a declaration and an emit line (render.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar, dataclass_transform

from . import limits as lim
from .limits import Limits, OwnLimits, VisibleDevice, client_limits, exact_pinned, on_gpus, own_limits, visible_devices
from .model import DaemonReading, DcgmReading, Derived, GpuReading, LogServer, LogSnapshot, ProcessFacts, ProcessMemory, \
    PsEntry, ServerFacts, Snapshot, same_objects

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["ClientRow", "DaemonRow", "GpuRow", "OutsideProcessRow", "Rows", "ServerRow", "join", "outside_mps",
           "sharing_mode", "sm_utilization"]

MPS_SERVER_COMMAND = "nvidia-cuda-mps"  # comm of nvidia-cuda-mps-server, cut to 15 chars
NO_PROCESS = ProcessFacts(0)
# Where a value with more than one origin came from (the *_source fields).
FROM_CONTROL, FROM_LOGS, FROM_PROC, FROM_PS, FROM_NVML, UNKNOWN = "control", "logs", "proc", "ps", "nvml", "none"
# A field whose metadata holds READING is a reading that moves between collections while
# the rest of the row stands still (a client's memory): the client memo (render.py)
# re-emits those families alone where nothing else of the row moved.
READING = {"reading": True}
R = TypeVar("R")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen_row(cls: "type[R]") -> "type[R]":
    """`dataclass(frozen=True)` whose `__init__` fills the instance's `__dict__` at once: the
    generated one sets each field through `object.__setattr__`, ten times slower (4.4 us
    for 23 fields against 0.45; a join builds 384 client rows at 8 x 48). Frozen as before
    after it: assigning a field raises."""
    row = dataclass(frozen=True)(cls)
    params: List[str] = []
    body: List[str] = []
    scope: Dict[str, object] = {"_MISSING": dataclasses.MISSING}
    fields = dataclasses.fields(row)  # type: ignore[arg-type]
    for f in fields:
        if f.default is not dataclasses.MISSING:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"if {f.name} is _MISSING: {f.name} = _factory_{f.name}()")
        else:
            params.append(f.name)
    body.append("_d = self.__dict__")
    body += [f"_d[{f.name!r}] = {f.name}" for f in fields]
    code = f"def __init__(self, {', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
    exec(code, scope)  # noqa: S102 (the fields' own names, nothing from input)
    init: Any = scope["__init__"]
    init.__qualname__ = f"{row.__qualname__}.__init__"
    row.__init__ = init  # type: ignore[method-assign]
    return row


def with_fields(row: R, **changes: object) -> R:
    """A copy of a frozen_row with `changes` (`dataclasses.replace` without its checks and
    its __init__: the other fields were checked when `row` was made)."""
    new: R = object.__new__(type(row))
    new.__dict__.update(row.__dict__, **changes)
    return new


# ---------------------------------------------------------------- the rows
@frozen_row
class OutsideProcessRow:
    """A compute process outside MPS on a GPU that MPS serves."""

    pid: int
    uid: Optional[int]
    user: str
    command: str
    container_id: str
    pod_uid: str
    namespace: str
    pod: str
    container: str
    memory_used_bytes: Optional[int]


@frozen_row
class GpuRow:
    """One GPU; a GPU NVML did not answer for has its index, UUID and up=False alone."""

    index: int
    uuid: str
    up: bool
    name: str = ""
    driver_version: str = ""
    compute_mode: str = ""
    mig_mode: str = ""  # enabled, disabled
    memory_total_bytes: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    utilization_ratio: Optional[float] = None
    memory_utilization_ratio: Optional[float] = None
    power_watts: Optional[float] = None
    temperature_celsius: Optional[float] = None
    # NVML GPM's, DCGM's where it has a value (activity_source: "dcgm", "nvml" or "none")
    sm_active_ratio: Optional[float] = None
    sm_occupancy_ratio: Optional[float] = None
    tensor_active_ratio: Optional[float] = None
    dram_active_ratio: Optional[float] = None
    activity_source: Mapping[str, str] = field(default_factory=dict)
    sharing_mode: Optional[str] = None  # mps, mixed, time_slicing, exclusive, mig, idle
    compute_processes: Optional[int] = None
    clients: Optional[int] = None  # NVML's MPS process list
    outside_mps: Tuple[OutsideProcessRow, ...] = ()
    # pid -> SM ratio, on GPUs not under MPS (under MPS NVML gives all SM time to the server)
    process_sm_utilization: Mapping[int, float] = field(default_factory=dict)


@frozen_row
class ServerRow:
    """One MPS server: the daemon's, or (the daemon not answering) one the logs know to run."""

    daemon: str
    pid: int
    uid: Optional[int]
    uid_source: str  # proc, logs or none
    user: str  # /proc's user name, else the uid
    status: Optional[str]  # ACTIVE, INITIALIZING, FAULT; None where the daemon did not say
    clients: int  # the daemon's `ps` rows naming it
    active_thread_ratio: Optional[float]  # its percentage now / 100
    active_thread_source: str  # control, logs or none
    pinned_memory_limit_bytes: Mapping[int, int]  # its limits now, by GPU index
    pinned_memory_limit_source: str  # control, logs or none
    memory_used_bytes: Mapping[int, int]  # the server process itself, by GPU index
    sm_utilization_ratio: Mapping[int, float]  # by GPU index
    start_time: Optional[float]
    start_time_source: str  # logs, proc or none
    priority: Optional[int]  # server.log's `Server Priority set to N`


@frozen_row
class ClientRow:
    """One MPS client: a row of its daemon's `ps`, or a process NVML's MPS list names that
    the daemon claims (_claims). The values in force, the limits' origins beside them."""

    daemon: str
    pid: int
    server_pid: Optional[int]
    uid: Optional[int]
    user: str
    command: str  # `ps`' COMMAND, else /proc/PID/comm
    pid_namespace: str  # `ps`' NAMESPACE column
    container_id: str
    pod_uid: str
    namespace: str  # its pod's, ECS task's, Docker container's or Slurm job's names (docs/labels.md#owners)
    pod: str
    container: str
    owner: str  # who names it: kubernetes, ecs, docker, slurm or ""
    memory_used_bytes: Mapping[int, int] = field(metadata=READING)  # NVML's MPS list, by GPU index
    gpus: Tuple[int, ...] = ()  # the GPUs it is on: NVML's MPS list, else the device `ps` names
    gpus_source: str = UNKNOWN  # nvml, ps or none
    pinned_memory_limit_bytes: Mapping[int, int] = field(default_factory=dict)  # in force, by GPU index
    active_thread_ratio: Optional[float] = None  # in force / 100
    priority: Optional[int] = None  # in force: 0 normal, 1 below normal
    limit_sources: Mapping[str, str] = field(default_factory=dict)  # limits.LIMITS -> limits.SOURCES
    ignored_limits: Mapping[str, str] = field(default_factory=dict)  # limit -> why its own setting is not in force
    start_time: Optional[float] = None
    start_time_source: str = UNKNOWN  # logs, proc or none


@frozen_row
class DaemonRow:
    """One watched MPS control daemon, its servers and its clients (by pid)."""

    name: str
    up: bool
    version: str
    pipe_directory: str
    log_directory: str
    claim_uid: str
    multiuser: Optional[bool]
    default_active_thread_ratio: Optional[float]
    default_pinned_memory_limit_bytes: Mapping[int, int]  # by GPU index, in index order
    default_client_priority: Optional[int]
    servers: Tuple[ServerRow, ...]
    clients: Tuple[ClientRow, ...]


@frozen_row
class Rows:
    gpus: Tuple[GpuRow, ...]
    daemons: Tuple[DaemonRow, ...]

    @property
    def uuids(self) -> Dict[int, str]:
        """GPU index -> UUID, in NVML's order."""
        return {g.index: g.uuid for g in self.gpus}


# ---------------------------------------------------------------- the join
# The last join and the readings it joined, held (so their ids cannot be reused): a
# collection's render, its exit tracking and its status view read one join, and a
# collection served the same readings as the last (nothing read again) joins nothing.
_last_join: Optional[Tuple[Tuple[object, ...], List[DaemonReading], Rows]] = None


def _join_inputs(snap: Snapshot) -> Tuple[object, ...]:
    """What `join` reads of a snapshot, by identity: a reading replaced is joined again.
    (A reading changed in place is not seen: readings are never changed once read.) The
    daemons' readings apart: each is new at every read (its command counts move, which
    the join does not read), and compared by value, at a glance where the daemon's lists
    are the very lists of its last reading (control.DaemonReader)."""
    return (snap.nvml, snap.dcgm or None, snap.processes, *snap.logs, *snap.logs.values())  # no DCGM: a new {}


def rows_of(snap: Snapshot) -> Rows:
    """`join(snap)`, or the last join where it read these very readings."""
    global _last_join
    inputs = _join_inputs(snap)
    last = _last_join
    if last is not None and same_objects(last[0], inputs) and last[1] == snap.daemons:
        return last[2]
    rows = join(snap)
    _last_join = (inputs, list(snap.daemons), rows)
    return rows


def join(snap: Snapshot, reuse: bool = True) -> Rows:
    """The rows of a snapshot. `reuse`: a client whose facts stayed since the last join keeps
    its row (_KeptClients); False joins anew and leaves the kept rows as they are."""
    global _kept_clients
    gpus = snap.nvml.gpus if snap.nvml else []
    server_pids = {s.pid for d in snap.daemons for s in d.servers}
    joined = _GpuJoin.of(gpus, reuse)
    listed, clients, unclaimed = _client_pid_sets(snap.daemons, joined.mps_memory, reuse)
    driver = snap.nvml.driver_version if snap.nvml else ""
    kept = _KeptClients(_kept_clients if reuse else _Kept())
    gpu_rows = tuple(gpu_row(gpu, driver, snap.dcgm, server_pids, clients, snap.processes, kept) for gpu in gpus)
    daemons = []
    for d in snap.daemons:
        unlisted = [pid for pid in unclaimed if _claims(d, snap.processes.get(pid), len(snap.daemons) == 1)]
        daemons.append(daemon_row(d, snap.logs.get(d.name), snap.processes, joined, unlisted, kept))
    if reuse:
        _kept_clients = kept.now  # clients and GPUs gone are forgotten
    return Rows(gpu_rows, tuple(daemons))


def _client_pid_sets(daemons: Sequence[DaemonReading], mps_memory: Mapping[int, object], reuse: bool = True
                     ) -> Tuple[FrozenSet[int], FrozenSet[int], Tuple[int, ...]]:
    """The clients the daemons list; those and NVML's MPS clients; NVML's that no daemon
    lists: the very sets of the last call while the lists stay."""
    ps_lists = [d.clients for d in daemons]

    def derive() -> Tuple[FrozenSet[int], FrozenSet[int], Tuple[int, ...]]:
        listed = frozenset(c.pid for clients in ps_lists for c in clients)
        return listed, listed.union(mps_memory), tuple(pid for pid in mps_memory if pid not in listed)

    return _kept(_client_pids, reuse, ps_lists + [mps_memory], None, derive)


def present_clients(snap: Snapshot) -> FrozenSet[int]:
    """Every client a daemon lists or NVML names on a GPU: the very set of the last call
    while their lists stay (the exit tracker then knows at once that nobody left)."""
    gpus = snap.nvml.gpus if snap.nvml else []
    return _client_pid_sets(snap.daemons, _memory_maps_of(gpus)[1])[1]


# The PID sets of the daemons' lists and NVML's MPS lists: they mostly stay.
_client_pids: Derived[Tuple[FrozenSet[int], FrozenSet[int], Tuple[int, ...]]] = Derived()


def _kept(memo: Derived[T], reuse: bool, readings: Sequence[object], key: object, derive: Callable[[], T]) -> T:
    """memo.get(readings, key, derive); derived anew without reuse (tests/conftest.py checks
    every join of the suite against one without)."""
    return memo.get(readings, key, derive) if reuse else derive()


# ---------------------------------------------------------------- GPUs
def _is_server(pid: int, server_pids: Set[int], processes: Mapping[int, ProcessFacts]) -> bool:
    return pid in server_pids or processes.get(pid, NO_PROCESS).command == MPS_SERVER_COMMAND


def outside_mps(gpu: GpuReading, server_pids: Set[int], clients: AbstractSet[int],
                processes: Mapping[int, ProcessFacts]) -> List[ProcessMemory]:
    """Compute processes on a GPU that an MPS server serves that are neither a server nor a
    client (`clients`: every daemon's `ps` and every GPU's MPS list): a CUDA process whose
    CUDA_MPS_PIPE_DIRECTORY reaches no daemon runs beside MPS, silently (issue 24)."""
    if gpu.mig_enabled or not (gpu.mps_clients or any(_is_server(p.pid, server_pids, processes)
                                                      for p in gpu.compute_processes)):
        return []
    own = {p.pid for p in gpu.mps_clients}
    return [p for p in gpu.compute_processes
            if p.pid not in own and p.pid not in clients and not _is_server(p.pid, server_pids, processes)]


def sharing_mode(gpu: GpuReading, server_pids: Set[int], processes: Mapping[int, ProcessFacts],
                 clients: AbstractSet[int] = frozenset()) -> str:
    """mixed: MPS serves the GPU and processes outside MPS run on it too (outside_mps)."""
    if gpu.mig_enabled:
        return "mig"
    pids = {p.pid for p in gpu.compute_processes}
    if gpu.mps_clients or any(_is_server(pid, server_pids, processes) for pid in pids):
        return "mixed" if outside_mps(gpu, server_pids, clients, processes) else "mps"
    if len(pids) > 1:
        return "time_slicing"
    return "exclusive" if pids else "idle"


def sm_utilization(gpu: GpuReading) -> Dict[int, float]:
    """Per compute process: its newest SM utilization sample since the last scrape.

    NVML returns samples only for processes that used the SMs, so a process on
    the GPU without a new sample was idle over the interval: 0, not absent
    (absent would make its series flap between scrapes).
    """
    latest: Dict[int, Tuple[int, float]] = {}
    for s in gpu.process_utilization:
        if s.pid not in latest or s.timestamp_us > latest[s.pid][0]:
            latest[s.pid] = (s.timestamp_us, s.sm_ratio)
    ratios = {p.pid: 0.0 for p in gpu.compute_processes}
    ratios.update({pid: ratio for pid, (_, ratio) in latest.items()})
    return ratios


ACTIVITY = ("sm_active", "sm_occupancy", "tensor_active", "dram_active")


def gpu_row(gpu: GpuReading, driver: str, dcgm: DcgmReading, server_pids: Set[int], clients: AbstractSet[int],
            processes: Mapping[int, ProcessFacts], kept: Optional["_KeptClients"] = None) -> GpuRow:
    if not gpu.up:
        return GpuRow(gpu.index, gpu.uuid, False)
    profiled = dcgm.get(gpu.index, {})
    activity = {**gpu.activity, **profiled}  # DCGM's profiling fields win over GPM
    sources = {key: FROM_NVML if key in gpu.activity else UNKNOWN for key in ACTIVITY}
    sources.update({key: "dcgm" for key in profiled})
    def sharing() -> Tuple[str, Tuple[OutsideProcessRow, ...]]:
        return (sharing_mode(gpu, server_pids, processes, clients),
                tuple(_outside_row(p, processes.get(p.pid) or ProcessFacts(p.pid))
                      for p in outside_mps(gpu, server_pids, clients, processes)))

    # kept while its process lists, the clients, /proc's reading, its MIG mode and the servers stay
    mode, outside = sharing() if kept is None else kept.derived(
        ("sharing", gpu.index), [gpu.compute_processes, gpu.mps_clients, clients, processes],
        (gpu.mig_enabled, frozenset(server_pids)), sharing)
    return GpuRow(
        gpu.index, gpu.uuid, True, gpu.name, driver, gpu.compute_mode, "enabled" if gpu.mig_enabled else "disabled",
        gpu.memory_total_bytes, gpu.memory_used_bytes, gpu.utilization_ratio, gpu.memory_utilization_ratio,
        gpu.power_watts, gpu.temperature_celsius, activity.get("sm_active"), activity.get("sm_occupancy"),
        activity.get("tensor_active"), activity.get("dram_active"), sources, mode, len(gpu.compute_processes),
        len(gpu.mps_clients), outside,
        # under MPS NVML gives all SM time to the server: no per-client number
        {} if mode in ("mps", "mixed") else sm_utilization(gpu))


def _outside_row(p: ProcessMemory, proc: ProcessFacts) -> OutsideProcessRow:
    return OutsideProcessRow(p.pid, proc.uid, proc.user, proc.command, proc.container_id, proc.pod_uid,
                             proc.namespace, proc.pod, proc.container, p.used_bytes)


@dataclass
class _GpuJoin:
    """The GPU facts the server and client rows look up by PID."""

    gpus: List[GpuReading]
    utilization: Dict[int, Dict[int, float]]  # gpu index -> pid -> SM ratio
    compute_memory: Mapping[int, Mapping[int, Optional[int]]]  # gpu index -> pid -> bytes
    mps_memory: Mapping[int, Sequence[Tuple[int, Optional[int]]]]  # client pid -> [(gpu index, bytes)]

    @classmethod
    def of(cls, gpus: List[GpuReading], reuse: bool = True) -> "_GpuJoin":
        compute_memory, mps_memory = _memory_maps_of(gpus, reuse)
        return cls(gpus, {gpu.index: sm_utilization(gpu) for gpu in gpus}, compute_memory, mps_memory)

    def daemon_devices(self, d: DaemonReading) -> List[VisibleDevice]:
        """The devices the daemon and its clients count from: its own CUDA_VISIBLE_DEVICES."""
        return visible_devices(d.visible_devices, [(g.index, g.uuid) for g in self.gpus])

    def gpu_for_device(self, device: str) -> Optional[GpuReading]:
        """`ps` prints a UUID prefix ("GPU-a20825ef-ef8f-4f37")."""
        return next((g for g in self.gpus if device and g.uuid.startswith(device)), None)


def _memory_maps(gpus: List[GpuReading]) -> Tuple[Mapping[int, Mapping[int, Optional[int]]],
                                                   Mapping[int, Sequence[Tuple[int, Optional[int]]]]]:
    """_GpuJoin's compute_memory and mps_memory."""
    mps_memory: Dict[int, List[Tuple[int, Optional[int]]]] = {}
    for gpu in gpus:
        for p in gpu.mps_clients:
            mps_memory.setdefault(p.pid, []).append((gpu.index, p.used_bytes))
    return {gpu.index: {p.pid: p.used_bytes for p in gpu.compute_processes} for gpu in gpus}, mps_memory


def _memory_maps_of(gpus: List[GpuReading], reuse: bool = True
                    ) -> Tuple[Mapping[int, Mapping[int, Optional[int]]], Mapping[int, Sequence[Tuple[int, Optional[int]]]]]:
    """_memory_maps, derived again only where NVML gave another process list."""
    return _kept(_gpu_memory, reuse, [g.compute_processes for g in gpus] + [g.mps_clients for g in gpus],
                           tuple(g.index for g in gpus), lambda: _memory_maps(gpus))


_gpu_memory: Derived[Tuple[Mapping[int, Mapping[int, Optional[int]]],
                           Mapping[int, Sequence[Tuple[int, Optional[int]]]]]] = Derived()


# ---------------------------------------------------------------- daemons
def _claims(d: DaemonReading, proc: Optional[ProcessFacts], only: bool) -> bool:
    """Whether an NVML MPS client that no daemon's `ps` listed (it connected after the `ps`,
    or the `ps` failed) is `d`'s: its pipe directory is d's, or, where that cannot be told,
    d is the only daemon watched. Never a daemon that is not running: a SIGKILLed daemon's
    clients stay in NVML's list, each a client of nothing (2 x H200, issue 38); nor where
    another daemon runs beside the one watched (its clients showed as this one's in that
    run). A daemon that did not answer (hung, an error) may still have its clients."""
    if not d.up and d.error is None:
        return False
    pipe = proc.mps_pipe if proc is not None else None
    if pipe is not None and d.pipe_identity is not None:
        return pipe == d.pipe_identity
    return only


def daemon_row(d: DaemonReading, log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts],
               joined: _GpuJoin, unlisted: Sequence[int], kept: "_KeptClients") -> DaemonRow:
    """The daemon, its servers and its clients: the rows of its `ps` and the NVML MPS
    clients in `unlisted` (`kept`: the last join's, reused where their inputs stay). A
    client whose row cannot be joined is left out (logged)."""
    devices = joined.daemon_devices(d)
    joined_servers = server_rows(d, log_snap, processes, joined, devices, kept)
    server_limits = {s.pid: limits for s, limits in joined_servers}
    daemon = _DaemonJoin(d, devices, tuple((dev.index, dev.uuid) for dev in devices if dev.index is not None),
                         Limits(d.default_active_thread_percentage, d.default_pinned_limits), server_limits, log_snap)
    daemon_inputs = kept.daemon_inputs(daemon)
    clients = kept.clients(d, log_snap, processes, daemon_inputs, joined, unlisted)
    if clients is None:
        derived = []
        ps_rows = {c.pid: c for c in d.clients}
        for pid in sorted(set(ps_rows) | set(unlisted)):
            row, proc = ps_rows.get(pid), processes.get(pid) or ProcessFacts(pid)
            try:
                derived.append(kept.row(pid, row, proc, daemon, daemon_inputs, joined))
            except Exception as e:  # one client's data, never the scrape
                client_left_out(d.name, pid, e)
        clients = kept.keep_clients(d.name, tuple(derived))
    return DaemonRow(
        d.name, d.up, d.version, d.pipe_directory, d.log_directory, d.claim_uid, d.multiuser,
        None if d.default_active_thread_percentage is None else d.default_active_thread_percentage / 100,
        dict(sorted(d.default_pinned_limits.items())), d.default_client_priority,
        tuple(s for s, _ in joined_servers), clients)


# ---------------------------------------------------------------- servers
def server_rows(d: DaemonReading, log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts],
                joined: _GpuJoin, devices: Sequence[VisibleDevice], kept: Optional["_KeptClients"] = None
                ) -> List[Tuple[ServerRow, Limits]]:
    """The server rows, each with its limits now (what its clients inherit where the logs
    do not show them connecting)."""
    log_servers: Mapping[int, LogServer] = log_snap.servers if log_snap else {}
    # The daemon's list; when it did not answer, the logs' running servers that still run:
    # a SIGKILLed daemon and server leave no exit line, and a server the logs alone know
    # stayed in mps_server_info as long as the daemon's directory did (issue 38).
    servers = {s.pid: s for s in d.servers}
    if not d.up or d.error:
        for pid, running in log_servers.items():
            if running.running and pid not in servers and (
                    pid in processes or any(pid in memory for memory in joined.compute_memory.values())):
                servers[pid] = ServerFacts(pid=pid, status=None)
    def count() -> Mapping[int, int]:
        return collections.Counter(c.server_pid for c in d.clients)

    clients_per_server = count() if kept is None else kept.derived(("clients per server", d.name), [d.clients], None,
                                                                   count)
    return [_server_row(d.name, s, log_servers.get(pid), processes.get(pid), clients_per_server.get(pid, 0),
                        joined, devices)
            for pid, s in sorted(servers.items())]


def _first(*candidates: Tuple[Optional[T], str]) -> Tuple[Optional[T], str]:
    """The first value that is not None, with its origin; (None, "none") where none is."""
    return next(((v, origin) for v, origin in candidates if v is not None), (None, UNKNOWN))


def _server_row(daemon: str, s: ServerFacts, ls: Optional[LogServer], proc: Optional[ProcessFacts], clients: int,
                joined: _GpuJoin, devices: Sequence[VisibleDevice]) -> Tuple[ServerRow, Limits]:
    pid = s.pid
    uid, uid_source = _first((proc.uid if proc else None, FROM_PROC), (ls.uid if ls else None, FROM_LOGS))
    user = proc.user if proc and proc.user else ("" if uid is None else str(uid))
    atp, atp_source = _first((s.active_thread_percentage, FROM_CONTROL),
                             (ls.active_thread_percentage if ls else None, FROM_LOGS))
    logged = on_gpus(ls.pinned_limits, devices) if ls else {}
    if s.pinned_limits:  # the daemon's answer, as exact as server.log where it says more
        pinned, pinned_source = exact_pinned(s.pinned_limits, logged) if logged else s.pinned_limits, FROM_CONTROL
    else:
        pinned, pinned_source = logged, FROM_LOGS if logged else UNKNOWN
    start, start_source = _first(((ls.start_time if ls else None) or None, FROM_LOGS),  # 0: not a time
                                 (proc.start_time_seconds if proc else None, FROM_PROC))
    memory = {gpu.index: used for gpu in joined.gpus
              for used in [joined.compute_memory[gpu.index].get(pid)] if used is not None}
    utilization = {gpu.index: joined.utilization[gpu.index][pid] for gpu in joined.gpus
                   if joined.utilization[gpu.index].get(pid) is not None}
    row = ServerRow(daemon, pid, uid, uid_source, user, s.status, clients, None if atp is None else atp / 100,
                    atp_source, dict(sorted(pinned.items())), pinned_source, memory, utilization, start, start_source,
                    ls.priority if ls else None)
    return row, Limits(atp, pinned)


# ---------------------------------------------------------------- clients
@dataclass(frozen=True)
class _DaemonJoin:
    """What every client row of a daemon reads of it."""

    reading: DaemonReading
    devices: Sequence[VisibleDevice]  # the devices it and its clients count from
    gpus: Tuple[Tuple[int, str], ...]  # (index, UUID) of those that are GPUs
    defaults: Limits
    server_limits: Mapping[int, Limits]  # server pid -> its limits now
    log_snap: Optional[LogSnapshot]


def _client_in_force(pid: int, row: Optional[PsEntry], proc: ProcessFacts, daemon: _DaemonJoin,
                     joined: _GpuJoin) -> ClientRow:
    d, log_snap, devices = daemon.reading, daemon.log_snap, daemon.devices
    memory = joined.mps_memory.get(pid, ())
    gpus, gpus_source = [index for index, _ in memory], FROM_NVML
    if not gpus:
        gpu = joined.gpu_for_device(row.device) if row else None
        gpus, gpus_source = ([gpu.index], FROM_PS) if gpu else ([], UNKNOWN)
    own = _own_limits(proc.environ, daemon.gpus)
    server_pid = None if row is None else row.server_pid
    server = None if server_pid is None else daemon.server_limits.get(server_pid, Limits())
    logged = log_snap.client_limits.get(pid) if log_snap is not None and server is not None else None
    in_force = client_limits(own.limits, server, daemon.defaults,
                             at_connect=None if logged is None else Limits(logged[0], on_gpus(logged[1], devices)))
    priority, priority_source = _client_priority(own.priority, server_pid, log_snap, d)
    share = in_force.limits.thread_percentage
    pinned = in_force.limits.pinned_bytes
    log_start = log_snap.client_start_times.get(pid) if log_snap else None
    start, start_source = _first((log_start or None, FROM_LOGS), (proc.start_time_seconds, FROM_PROC))
    return ClientRow(
        d.name, pid, server_pid, proc.uid, proc.user, (row.command if row else "") or proc.command,
        row.namespace if row else "", proc.container_id, proc.pod_uid, proc.namespace, proc.pod, proc.container,
        proc.owner, memory_used_bytes=_memory_used(memory),
        gpus=tuple(gpus), gpus_source=gpus_source,
        pinned_memory_limit_bytes={gpu: pinned[gpu] for gpu in gpus if pinned.get(gpu) is not None},
        active_thread_ratio=None if share is None else share / 100, priority=priority,
        limit_sources={**in_force.sources, lim.PRIORITY: priority_source}, ignored_limits=own.ignored,
        start_time=start, start_time_source=start_source)


def _daemon_inputs(daemon: _DaemonJoin) -> Tuple[object, ...]:
    """All that _client_in_force reads of the daemon's join."""
    d = daemon.reading
    return (d.name, d.default_client_priority, daemon.gpus, tuple(daemon.devices), daemon.defaults,
            daemon.server_limits)


def _client_inputs(pid: int, row: Optional[PsEntry], proc: ProcessFacts, daemon: _DaemonJoin,
                   daemon_inputs: Tuple[object, ...], joined: _GpuJoin) -> Tuple[object, ...]:
    """All that _client_in_force reads but the memory values (`daemon_inputs`: the
    daemon's): where these are equal, so is the row but for its memory. (ProcessFacts gain
    their names in place: they are here apart from the object.)"""
    log_snap = daemon.log_snap
    server_pid = None if row is None else row.server_pid
    on: Tuple[object, ...] = tuple(index for index, _ in joined.mps_memory.get(pid, ()))
    if not on and row is not None:
        found = joined.gpu_for_device(row.device)
        on = ("ps", None if found is None else found.index)
    server = log_snap.servers.get(server_pid) if log_snap is not None and server_pid is not None else None
    return (row, proc, proc.namespace, proc.pod, proc.container, proc.pod_uid, proc.owner, daemon_inputs,
            log_snap.client_limits.get(pid) if log_snap is not None else None,
            log_snap.client_start_times.get(pid) if log_snap is not None else None,
            None if server is None else server.priority, on)


def _memory_used(memory: Sequence[Tuple[int, Optional[int]]]) -> Dict[int, int]:
    """A client's memory_used_bytes from its entries in NVML's MPS lists."""
    return {index: used for index, used in memory if used is not None}


@dataclass
class _Kept:
    """One join's clients: daemon -> client pid -> (_client_inputs, its row); each
    daemon's _daemon_inputs; each daemon's client rows with _clients_inputs; and the
    values _KeptClients.derived kept, by name."""

    rows: Dict[str, Dict[int, Tuple[Tuple[object, ...], ClientRow]]] = field(default_factory=dict)
    daemons: Dict[str, Tuple[object, ...]] = field(default_factory=dict)
    clients: Dict[str, Tuple[Tuple[object, ...], Tuple[ClientRow, ...]]] = field(default_factory=dict)
    derived: Dict[Tuple[object, ...], Derived[Any]] = field(default_factory=dict)


def _clients_inputs(d: DaemonReading, log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts],
                    daemon_inputs: Tuple[object, ...], joined: _GpuJoin, unlisted: Sequence[int]) -> Tuple[object, ...]:
    """All that a daemon's client rows are derived from, the readings by identity (a
    source gives its last reading again while equal; the proc source a new mapping where it
    named a process in place): NVML's per-GPU process lists, the GPUs' identities."""
    return (d.clients, log_snap, processes, daemon_inputs, *(g.mps_clients for g in joined.gpus),
            tuple((g.index, g.uuid) for g in joined.gpus), tuple(unlisted))


def _same_inputs(a: Tuple[object, ...], b: Tuple[object, ...]) -> bool:
    """_clients_inputs alike: the readings the very objects, the last two equal."""
    return same_objects(a[:-2], b[:-2]) and a[-2:] == b[-2:]


_kept_clients = _Kept()  # the last join's


class _KeptClients:
    """Client rows of the last join reused where their inputs are equal, their memory
    replaced where it moved: on a busy node a client's memory moves every scrape while its
    facts and limits stay, and deriving its limits was a quarter of a scrape (issue 44)."""

    def __init__(self, before: _Kept) -> None:
        self.before = before
        self.now = _Kept()
        self._clients_inputs: Tuple[object, ...] = ()  # of the daemon `clients` was last asked about

    def daemon_inputs(self, daemon: _DaemonJoin) -> Tuple[object, ...]:
        """The daemon's inputs; the last join's very tuple where equal, so that each
        client's inputs compare it by identity."""
        inputs = _daemon_inputs(daemon)
        last = self.before.daemons.get(daemon.reading.name)
        if last is not None and last == inputs:
            inputs = last
        self.now.daemons[daemon.reading.name] = inputs
        return inputs

    def clients(self, d: DaemonReading, log_snap: Optional[LogSnapshot], processes: Mapping[int, ProcessFacts],
                daemon_inputs: Tuple[object, ...], joined: _GpuJoin, unlisted: Sequence[int]
                ) -> Optional[Tuple[ClientRow, ...]]:
        """The daemon's client rows of the last join where all they are derived from is the
        same (a node whose clients' facts and memory stay: every row at once), else None."""
        inputs = _clients_inputs(d, log_snap, processes, daemon_inputs, joined, unlisted)
        self._clients_inputs = inputs
        last = self.before.clients.get(d.name)
        if last is None or not _same_inputs(last[0], inputs):
            return None
        self.now.rows[d.name] = self.before.rows.get(d.name, {})  # never changed once kept
        self.now.clients[d.name] = last
        return last[1]

    def derived(self, name: Tuple[object, ...], readings: Sequence[object], key: object, derive: Callable[[], T]) -> T:
        """Derived.get of the last join's value by this name (a GPU's, a daemon's): kept for
        the next join where asked now, forgotten where not."""
        memo: Derived[T] = self.before.derived.get(name) or Derived()
        self.now.derived[name] = memo
        return memo.get(readings, key, derive)

    def keep_clients(self, daemon: str, clients: Tuple[ClientRow, ...]) -> Tuple[ClientRow, ...]:
        """The rows `clients` derived after `clients` found none, kept for the next join."""
        self.now.clients[daemon] = (self._clients_inputs, clients)
        return clients

    def row(self, pid: int, row: Optional[PsEntry], proc: ProcessFacts, daemon: _DaemonJoin,
            daemon_inputs: Tuple[object, ...], joined: _GpuJoin) -> ClientRow:
        name = daemon.reading.name
        inputs = _client_inputs(pid, row, proc, daemon, daemon_inputs, joined)
        kept = self.before.rows.get(name, {}).get(pid)
        if kept is not None and kept[0] == inputs:
            client = kept[1]
            memory = _memory_used(joined.mps_memory.get(pid, ()))
            if memory != client.memory_used_bytes:
                client = with_fields(client, memory_used_bytes=memory)
        else:
            client = _client_in_force(pid, row, proc, daemon, joined)
        self.now.rows.setdefault(name, {})[pid] = (inputs, client)
        return client


def _own_limits(environ: Mapping[str, str], devices: Tuple[Tuple[int, str], ...]) -> OwnLimits:
    """limits.own_limits, parsed once per environment and devices (a client's environment
    never changes, and it is read again in every collection)."""
    return _own_limits_of(tuple(environ.items()), devices)


@functools.lru_cache(maxsize=4096)
def _own_limits_of(environ: Tuple[Tuple[str, str], ...], devices: Tuple[Tuple[int, str], ...]) -> OwnLimits:
    return own_limits(dict(environ), devices)


def _client_priority(own: Optional[int], server_pid: Optional[int], log_snap: Optional[LogSnapshot],
                     d: DaemonReading) -> Tuple[Optional[int], str]:
    """The priority a client runs at and where it came from: its own
    CUDA_MPS_CLIENT_PRIORITY, else its server's (`Server Priority set to N`: the daemon
    default when the server started, which its clients inherit), else the daemon default now."""
    if own is not None:
        return own, lim.CLIENT
    server = log_snap.servers.get(server_pid) if log_snap is not None and server_pid is not None else None
    if server is not None and server.priority is not None:
        return server.priority, lim.SERVER_AT_CONNECT
    if d.default_client_priority is not None:
        return d.default_client_priority, lim.DAEMON_DEFAULT
    return None, lim.NONE


# A client's row and series come from what its process supplied (its environment, its
# command): one that cannot be joined or rendered costs that client, never the scrape. Each
# kind of failure is logged once as a warning, then at debug level (a client lives for many
# scrapes).
MAX_FAILURES_WARNED = 64
_failures_warned: Set[Tuple[str, str]] = set()
_failures_lock = threading.Lock()


def client_left_out(daemon: str, pid: int, e: Exception) -> None:
    """Log that client `pid` of `daemon` is left out of the exposition, because of `e`."""
    kind = (type(e).__name__, str(e)[:200])
    with _failures_lock:
        first = kind not in _failures_warned and len(_failures_warned) < MAX_FAILURES_WARNED
        if first:
            _failures_warned.add(kind)
    log.log(logging.WARNING if first else logging.DEBUG,
            "daemon %s: client %d left out of the metrics (its series could not be rendered: %s: %s)%s",
            daemon, pid, kind[0], kind[1], "; further such failures are logged at debug level" if first else "")


def reading_fields(row_type: type) -> Tuple[str, ...]:
    """The fields of a row type marked READING."""
    return tuple(f.name for f in dataclasses.fields(row_type) if f.metadata.get("reading"))


# ---------------------------------------------------------------- memory at the edge
@frozen_row  # 384 a collection at 8 x 48
class ClientMemory:
    """One client's memory reading on one GPU with the pinned limit in force there: what
    the exit tracker (exits.py) keeps of each client between collections."""

    daemon: str
    pid: int
    gpu: int
    used_bytes: int
    limit_bytes: Optional[int]
    gpu_used_bytes: Optional[int]
    gpu_total_bytes: Optional[int]
    server_pid: str  # "" where no server is known
    pod_uid: str
    namespace: str
    pod: str
    container: str


def client_memory(snap: Snapshot) -> List[ClientMemory]:
    """Every client's memory reading (NVML's MPS list) with its limit in force, from the
    client rows: a client is at its limit here exactly where
    mps_client_pinned_memory_limit_bytes says so. The very list of the last call where
    the clients' rows and the GPUs' memory are the same (the exit tracker then takes none)."""
    global _last_memory
    rows = rows_of(snap)
    gpus = {g.index: g for g in rows.gpus}
    gpu_memory = tuple((g.index, g.up, g.memory_used_bytes, g.memory_total_bytes) for g in rows.gpus)
    last_gpu_memory, last_parts, last_all = _last_memory
    parts = []
    for d in rows.daemons:
        kept = last_parts.get(d.name)
        if kept is not None and kept[0] is d.clients and last_gpu_memory == gpu_memory:
            parts.append((d.name, kept))
            continue
        parts.append((d.name, (d.clients, [
            ClientMemory(d.name, c.pid, gpu, used, c.pinned_memory_limit_bytes.get(gpu), gpus[gpu].memory_used_bytes,
                         gpus[gpu].memory_total_bytes, "" if c.server_pid is None else str(c.server_pid), c.pod_uid,
                         c.namespace, c.pod, c.container)
            for c in d.clients for gpu, used in c.memory_used_bytes.items() if gpus[gpu].up])))
    if len(parts) == len(last_parts) and all(last_parts.get(name) is part for name, part in parts):
        return last_all
    readings = [r for _, (_, part) in parts for r in part]
    _last_memory = (gpu_memory, dict(parts), readings)
    return readings


# The last client_memory: the GPUs' memory then, per daemon its client rows and their
# readings, and all readings.
_last_memory: Tuple[Tuple[object, ...], Dict[str, Tuple[Tuple[ClientRow, ...], List[ClientMemory]]],
                    List[ClientMemory]] = ((), {}, [])
