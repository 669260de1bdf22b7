"""Clients that leave at the edge of memory, and the most memory each client has held.

MPS does not say "out of memory": a client held to 2 GiB that stood at 95 % of it and asked
for 1 GiB more died of CUDA_ERROR_OUT_OF_MEMORY, and so did a fifth client asking 6 GiB of
a GPU that four others had filled to 97.5 % (H100, driver 580, issue 40); the MPS logs
showed normal exit lines for both. What the exporter can see is the client's last memory
reading before it left. So the tracker keeps, between collections, each client's last
reading per GPU (memory, the pinned limit in force from the same join as the client
series, the GPU's used and total), and when a client leaves it is counted where that
reading was at the edge:

- `client_limit`: its memory was within `limit_ratio` of its pinned limit in force
  (limit - used <= limit x limit_ratio, to the byte above); --mps.oom-margin-ratio, 0.05: the 95 % client above);
- `device_full`: else, its GPU's used memory was at least `device_full_ratio` of the total
  (--mps.device-full-ratio, 0.97: the 97.5 % GPU above).

The reading judged is the last one, or where that is far from the edge, the last reading
at the edge within `window_seconds` before it: a PyTorch client that fails an allocation
first gives back its allocator's cache, and one that exits frees its tensors before its
context goes, so a scrape in those moments read it below the edge and the exit went
uncounted (4 x H200, issue 40: 1958 of 2048 MiB, then not counted). A client far from both
for the whole window is never counted. How it ended comes from the kernel where it can
be had (exitstatus.py): `failed` (a non-zero status or a signal), `clean` (status 0) or
`unknown` (no connector, or its exit was not seen).

A client "leaves" when it is in neither NVML's MPS list nor its daemon's `ps`, and
/proc says it is gone (no such PID, or a zombie) where /proc can be asked, or the kernel
reported its exit. No conclusion is drawn from a collection that could not see it: NVML
absent or its GPU not read, its daemon's `ps` failed. A client that left MPS but still
runs (it destroyed its context) is forgotten, not counted.

The tracker is the only state across collections; it runs once per collection
(collector.MpsCollector.snapshot) and its result travels in the Snapshot
(`Snapshot.edges`), so that the render stays a function of the snapshot. Bounded: the
clients connected now (at most MAX_TRACKED), the pods with clients now, the counts per
daemon, GPU, reason and outcome, and the last MAX_RECENT edge exits.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Deque, Dict, List, Optional, Protocol, Tuple

from .exitstatus import CLEAN, FAILED, UNKNOWN, ExitStatus
from .limits import visible_devices
from .model import CLIENT_LIMIT, DEVICE_FULL, EDGE_REASONS, EdgeExit, EdgeReport, Snapshot
from .join import ClientMemory, client_memory, present_clients

MAX_TRACKED = 4096  # clients with a last reading (a node runs at most 48 per GPU: 384 on 8 GPUs)
MAX_RECENT = 32  # edge exits kept for `status`
MAX_DAEMONS = 256  # daemons whose counts are kept


@dataclass(frozen=True)
class Margins:
    """Where the edge is: config.Config's oom_margin_ratio and device_full_ratio."""

    limit_ratio: float = 0.05
    device_full_ratio: float = 0.97
    window_seconds: float = 30.0  # two default scrape intervals

    def reason(self, r: ClientMemory) -> Optional[str]:
        """Why a client whose last reading was `r` left at the edge; None: far from it."""
        # Within the margin rounded up to a byte: 95 % of 2 GiB is no whole number of bytes.
        if r.limit_bytes and r.limit_bytes - r.used_bytes <= math.ceil(r.limit_bytes * self.limit_ratio):
            return CLIENT_LIMIT
        if r.gpu_total_bytes and r.gpu_used_bytes is not None and \
                r.gpu_used_bytes >= r.gpu_total_bytes * self.device_full_ratio:
            return DEVICE_FULL
        return None


class ExitStatuses(Protocol):
    """exitstatus.ExitWatcher, as the tracker uses it."""

    available: bool

    def status(self, pid: int) -> Optional[ExitStatus]: ...

    def watch(self, pids: AbstractSet[int]) -> None: ...


def proc_alive(procfs: str = "/proc") -> Callable[[int], Optional[bool]]:
    """Whether a PID runs, from `procfs`: False where it is gone or a zombie (exited, not yet
    reaped by its parent), None where /proc cannot tell (no permission)."""

    def alive(pid: int) -> Optional[bool]:
        try:
            with open(f"{procfs}/{pid}/stat", "rb") as f:
                stat = f.read()
        except FileNotFoundError:
            return False
        except OSError:
            return None
        state = stat[stat.rfind(b")") + 2:][:1]  # the field after the command, which may hold ")"
        return state not in (b"Z", b"X")

    return alive


def _unknown(pid: int) -> Optional[bool]:
    return None


class _Seen:
    """The last collection that read a set of readings: every reading taken in one
    collection shares it, and a collection that reads the very same readings again
    (client_memory gives the same list while nothing moved) moves it alone, not 384 times."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


@dataclass
class _Client:
    daemon: str
    readings: Dict[int, Tuple[ClientMemory, _Seen]]  # gpu -> (last reading, when it was last read)
    peaks: Dict[int, int]  # gpu -> the most memory seen
    edges: Dict[int, Tuple[ClientMemory, _Seen]] = field(default_factory=dict)  # gpu -> last reading at the edge
    gone_since: Optional[float] = None  # seen gone once, its exit status not yet there


class ExitTracker:
    """`statuses`: the kernel's exit statuses (None: every exit is `unknown`); `alive`: the
    /proc check (proc_alive; the default cannot tell, as for a replayed bundle)."""

    def __init__(self, margins: Margins = Margins(), statuses: Optional[ExitStatuses] = None,
                 alive: Callable[[int], Optional[bool]] = _unknown, max_tracked: int = MAX_TRACKED,
                 max_recent: int = MAX_RECENT) -> None:
        self.margins = margins
        self.statuses = statuses
        self.alive = alive
        self.max_tracked = max_tracked
        self._clients: Dict[int, _Client] = {}
        self._pod_peaks: Dict[Tuple[str, str, str, int], Tuple[str, str, int]] = {}
        self._exits: Dict[Tuple[str, int, str, str], int] = {}
        self._recent: Deque[EdgeExit] = deque(maxlen=max_recent)
        self._lock = threading.Lock()
        # The readings last taken, whether NVML answered then, and when they were last read.
        self._taken: Tuple[Optional[List[ClientMemory]], bool] = (None, False)
        self._seen = _Seen(-math.inf)
        self._reported: Optional[EdgeReport] = None  # the last report, while nothing in it changed
        # Moved where a client may have been added or was dropped: the kernel is asked to watch
        # the clients again only then. And the clients present (join.present_clients) when the
        # last look found every tracked client among them: while they are the same set, and
        # none was added, nobody left.
        self._tracked = self._watched = 0
        self._all_present_in: Optional[AbstractSet[int]] = None

    def _outcomes(self) -> Tuple[str, ...]:
        return (FAILED, CLEAN) if self.statuses is not None and self.statuses.available else (UNKNOWN,)

    def observe(self, snap: Snapshot) -> EdgeReport:
        """Take this collection's readings; the report to render with it."""
        readings = client_memory(snap)
        with self._lock:
            if self._taken[0] is readings and self._taken[1] == (snap.nvml is not None):
                self._seen.at = snap.now  # the same readings: read again now, nothing else changed
            else:
                self._take(snap, readings)
            self._leave(snap)
            if self.statuses is not None and self.statuses.available and self._watched != self._tracked:
                self.statuses.watch(set(self._clients))  # the kernel drops the others' clean exits
                self._watched = self._tracked
            self._zero_rows(snap)
            return self._report()

    def _take(self, snap: Snapshot, readings: List[ClientMemory]) -> None:
        self._taken, self._seen, self._reported = (readings, snap.nvml is not None), _Seen(snap.now), None
        self._tracked += 1
        self._all_present_in = None
        seen = self._seen
        pods: Dict[Tuple[str, str, str, int], Tuple[str, str, int]] = {}
        for r in readings:
            c = self._clients.get(r.pid)
            if c is None or c.daemon != r.daemon:
                if len(self._clients) >= self.max_tracked:
                    continue  # bounded: a client beyond it is not tracked
                c = self._clients[r.pid] = _Client(r.daemon, {}, {})
            c.gone_since = None
            c.readings[r.gpu] = (r, seen)
            if self.margins.reason(r) is not None:
                c.edges[r.gpu] = (r, seen)
            c.peaks[r.gpu] = max(c.peaks.get(r.gpu, 0), r.used_bytes)
            if r.pod_uid:
                key = (r.daemon, r.server_pid, r.pod_uid, r.gpu)
                ns, pod, total = pods.get(key, (r.namespace, r.pod, 0))
                pods[key] = (ns, pod, total + r.used_bytes)
        if snap.nvml is not None:  # pods without clients now are forgotten
            self._pod_peaks = {key: (ns, pod, max(total, self._pod_peaks.get(key, ("", "", 0))[2]))
                               for key, (ns, pod, total) in pods.items()}

    def _leave(self, snap: Snapshot) -> None:
        if snap.nvml is None:
            return
        present = present_clients(snap)
        if present is self._all_present_in:
            return
        up = {g.index for g in snap.nvml.gpus if g.up}
        daemons = {d.name: d for d in snap.daemons}
        absent = [(pid, c) for pid, c in self._clients.items() if pid not in present]
        if not absent:
            self._all_present_in = present
        for pid, c in absent:
            d = daemons.get(c.daemon)
            if not set(c.readings) <= up or (d is not None and d.error is not None):
                continue  # this collection could not see it: no conclusion
            status = self.statuses.status(pid) if self.statuses is not None and self.statuses.available else None
            if status is None:
                alive = self.alive(pid)
                if alive:  # left MPS, still running: no exit
                    del self._clients[pid]
                    self._reported = None
                    self._tracked += 1
                    continue
                if self.statuses is not None and self.statuses.available and c.gone_since is None:
                    # Its exit event may trail NVML's list by a moment: asked again next time.
                    c.gone_since = snap.now
                    self._reported = None
                    continue
            del self._clients[pid]
            self._reported = None
            self._tracked += 1
            outcome = UNKNOWN if status is None else status.outcome
            for gpu, last in sorted(c.readings.items()):
                r, seen = self._judged(c, gpu, last)
                reason = self.margins.reason(r)
                if reason is None:
                    continue
                key = (c.daemon, gpu, reason, outcome)
                self._exits[key] = self._exits.get(key, 0) + 1
                self._recent.append(EdgeExit(
                    c.daemon, pid, gpu, reason, outcome, r.used_bytes, r.limit_bytes, r.gpu_used_bytes,
                    r.gpu_total_bytes, seen.at, c.gone_since or snap.now, "" if status is None else status.describe(),
                    r.namespace, r.pod, r.container))

    def _judged(self, c: _Client, gpu: int, last: Tuple[ClientMemory, _Seen]) -> Tuple[ClientMemory, _Seen]:
        """The reading an exit is judged by: the last, or the last at the edge within the window before it."""
        edge = c.edges.get(gpu)
        if self.margins.reason(last[0]) is None and edge is not None and \
                last[1].at - edge[1].at <= self.margins.window_seconds:
            return edge
        return last

    def _zero_rows(self, snap: Snapshot) -> None:
        """A row of 0 for each daemon, GPU it serves, reason and outcome the exporter can
        tell, so that the first exit is an increase; the rows of daemons no longer
        watched are dropped once the control source answered without them."""
        gpus = [(g.index, g.uuid) for g in snap.nvml.gpus] if snap.nvml else []
        rows = len(self._exits)
        for d in snap.daemons:
            for dev in visible_devices(d.visible_devices, gpus):
                if dev.index is None:
                    continue
                for reason in EDGE_REASONS:
                    for outcome in self._outcomes():
                        self._exits.setdefault((d.name, dev.index, reason, outcome), 0)
        control = snap.outcomes.get("control")
        names = {d.name for d in snap.daemons}
        if control is not None and control.success or len({k[0] for k in self._exits}) > MAX_DAEMONS:
            self._exits = {k: n for k, n in self._exits.items() if k[0] in names}
        if len(self._exits) != rows:  # rows only come and go here: their count tells
            self._reported = None

    def _report(self) -> EdgeReport:
        """The report; the last one again (the very object) while nothing in it changed."""
        if self._reported is not None:
            return self._reported
        peaks = tuple(((c.daemon, pid, gpu), (r.namespace, r.pod, r.container, c.peaks[gpu]))
                      for pid, c in sorted(self._clients.items()) for gpu, (r, _) in sorted(c.readings.items())
                      if c.gone_since is None)
        self._reported = EdgeReport(tuple(sorted(self._exits.items())), peaks, tuple(sorted(self._pod_peaks.items())),
                                    tuple(self._recent))
        return self._reported
