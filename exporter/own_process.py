"""The exporter's own process_* series: client_python's ProcessCollector gives their
families (names, help, types: declared there, not here), and OwnProcess reads their values
with fewer calls for the scrapes in between.

ProcessCollector opens /proc/self/stat and /proc/self/limits through open() and builds six
families at every scrape: 0.38 ms of the 2.9 ms a scrape of the synthetic 8 x 48 node costs
at 15 s (issue 44). OwnProcess reads the same numbers from one os.read of /proc/PID/stat,
the listing of /proc/PID/fd and getrlimit (the soft limit /proc/self/limits prints as Max
open files), at most once a second; collector.Exposition writes them into the text that
client_python encoded for the same series.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Callable, List, Optional, Tuple

from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

# ProcessCollector's samples in the order it gives them, by the part of /proc they come from.
STAT_SERIES = ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
               "process_cpu_seconds_total")
FD_SERIES = ("process_open_fds", "process_max_fds")

# ProcessCollector's clock ticks per second, page size and boot time, as it names them
COLLECTOR_CONSTANTS = ("_ticks", "_pagesize", "_btime")

# Values are read again after this many seconds at most: a storm of scrapes (several
# Prometheus servers, a client storm at 1 s) reads /proc once a second.
MAX_AGE_SECONDS = 1.0

Figures = Tuple[Tuple[str, ...], Tuple[float, ...]]  # the samples' names, their values in that order


def stat_values(stat: bytes, ticks: float, page_size: int, boot_time: float) -> Tuple[float, ...]:
    """The values of STAT_SERIES from /proc/PID/stat, computed as ProcessCollector does
    (the same float operations, so the same values to the last bit)."""
    parts = stat.split(b")")[-1].split()
    utime = float(parts[11]) / ticks
    stime = float(parts[12]) / ticks
    return float(parts[20]), float(parts[21]) * page_size, float(parts[19]) / ticks + boot_time, utime + stime


def _soft_file_limit() -> float:
    return float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


class OwnProcess(Collector):
    """The process_* families (client_python's, `collect`) and their values (`figures`)."""

    def __init__(self, proc: str = "/proc", pid: str = "self", file_limit: Callable[[], float] = _soft_file_limit,
                 clock: Callable[[], float] = time.monotonic, max_age: float = MAX_AGE_SECONDS) -> None:
        self.families_of = ProcessCollector(proc=proc, pid=lambda: pid, registry=None)
        self._dir = os.path.join(proc, pid)
        self._file_limit = file_limit
        self._clock = clock
        self._max_age = max_age
        self._read_at = float("-inf")
        self._figures: Figures = ((), ())

    def collect(self) -> List[Metric]:
        return list(self.families_of.collect())

    def figures(self) -> Figures:
        """The names and values of the samples `collect` gives now (none where /proc is not
        there), read again at most every `max_age` seconds."""
        now = self._clock()
        if now - self._read_at >= self._max_age:
            self._figures, self._read_at = self._read(), now
        return self._figures

    def _read(self) -> Figures:
        # ProcessCollector's own clock tick, page size and boot time: the values it computes.
        # A client_python without them gives nothing here, and its families are then
        # encoded whole each scrape (collector._ProcessText), never a failed scrape.
        collector = self.families_of
        ticks, page_size, boot_time = (getattr(collector, name, None) for name in COLLECTOR_CONSTANTS)
        if not (ticks and page_size and boot_time):  # no /proc: ProcessCollector gives nothing either
            return (), ()
        names: Tuple[str, ...] = ()
        values: Tuple[float, ...] = ()
        stat = _read_small(self._dir + "/stat")
        if stat is not None:
            names, values = STAT_SERIES, stat_values(stat, ticks, page_size, boot_time)
        open_fds = _count_entries(self._dir + "/fd")
        if open_fds is not None:
            names, values = names + FD_SERIES, values + (float(open_fds), self._file_limit())
        return names, values


def _read_small(path: str) -> Optional[bytes]:
    """A /proc file of at most a few hundred bytes; None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _count_entries(path: str) -> Optional[int]:
    try:
        return len(os.listdir(path))
    except OSError:
        return None
