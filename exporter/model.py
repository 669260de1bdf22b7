"""Plain data the sources return and the collector joins.

Sources turn their library's answers into these types; nothing downstream
touches pynvml, subprocess or /proc. Replay and tests build them from recorded
data.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .logs.state import LogSnapshot


# ---------------------------------------------------------------- NVML / DCGM
@dataclass
class ProcessMemory:
    pid: int
    used_bytes: Optional[int]  # None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)


@dataclass
class ProcessUtilization:
    pid: int
    sm_ratio: float  # 0..1
    timestamp_us: int  # NVML sample time, microseconds


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
    """One row of the control daemon's `ps`."""

    pid: int
    client_id: int
    server_pid: int
    device: str  # UUID prefix as `ps` prints it, e.g. GPU-a20825ef-ef8f-4f37
    namespace: str
    command: str


@dataclass
class ServerFacts:
    pid: int
    status: Optional[str]  # ACTIVE, INITIALIZING, FAULT; None if the daemon did not say
    active_thread_percentage: Optional[float] = None
    pinned_limits: Dict[int, int] = field(default_factory=dict)  # MPS device ordinal -> bytes


@dataclass
class DaemonReading:
    name: str
    up: bool
    pipe_directory: str
    log_directory: str
    version: str = ""
    claim_uid: str = ""  # DRA: the resource claim the daemon serves
    multiuser: Optional[bool] = None  # started with -M (its command line in /proc); None: not known
    default_active_thread_percentage: Optional[float] = None
    default_pinned_limits: Dict[int, int] = field(default_factory=dict)
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
    # Kubernetes names of the container (runtime_metadata.py); "" outside a pod.
    namespace: str = ""
    pod: str = ""
    container: str = ""
    # Only procfs.KEPT_ENV_VARS are ever kept from /proc/PID/environ, as written: how CUDA
    # reads them depends on the GPUs (limits.own_limits).
    environ: Dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------ one scrape
@dataclass
class Histogram:
    """Observations in buckets of `bounds` (non-cumulative counts, the last one +Inf)."""

    bounds: Sequence[float]
    counts: List[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> List[Tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts):
            running += n
            out.append((float(bound), running))
        return out

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total)


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
