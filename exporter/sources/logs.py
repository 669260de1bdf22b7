"""The MPS logs as a source: one LogPipeline (exporter/logs/) per watched control daemon.

Its reading is each pipeline's last published snapshot (no I/O in a scrape).
Daemons come and go (discovery.py): `DaemonPipelines` starts a pipeline for a daemon
that appeared and stops one whose daemon left, dropping its state-file entry.
Capture bundles carry the log bytes themselves, not readings: replay feeds
them to real pipelines, so this source is not recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable, Dict, Optional

from ..config import Config, DaemonConfig
from ..discovery import DaemonSet
from ..logs.parser import resolve_timezone
from ..contract import DAEMON, gauge, table
from ..families import FamilyBuilder
from ..logs.pipeline import LOG_STARTS, LogPipeline
from ..logs.render import render_state_file_errors
from ..logs.statefile import StateStore
from ..model import LogSnapshot, Snapshot
from .base import Backends, Flag, PartialFailure, ReadContext, Reader, Source

log = logging.getLogger(__name__)


class DaemonPipelines:
    """The pipelines of the daemons watched now, by daemon name. `sync()` follows the
    daemon set; while started, a thread calls it every discovery interval, so that a
    daemon's logs are followed (and a gone one's dropped) whether or not anyone scrapes."""

    def __init__(self, daemons: DaemonSet, make: Callable[[DaemonConfig], LogPipeline],
                 store: Optional[StateStore] = None) -> None:
        self.daemons = daemons
        self.pipelines: Dict[str, LogPipeline] = {}
        self._make = make
        self._store = store
        self._lock = threading.Lock()
        self._started = False
        self._synced = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sync(self, rescan: bool = False) -> Dict[str, LogPipeline]:
        with self._lock:
            now = {d.name: d for d in (self.daemons.rescan() if rescan else self.daemons.current())}
            gone = [n for n, p in self.pipelines.items() if n not in now or p.log_directory != now[n].log_directory]
            for name in gone:
                self.pipelines.pop(name).stop()
            for name, d in now.items():
                if name not in self.pipelines:
                    self.pipelines[name] = pipe = self._make(d)
                    if self._started:
                        pipe.start()
            if self._store is not None and (gone or not self._synced):
                self._store.retain(now)  # after the stops above, which save their last state
            self._synced = True
            return dict(self.pipelines)

    def in_step(self) -> Optional[Dict[str, LogPipeline]]:
        """The pipelines, where no discovery scan is due and they match the daemons watched
        now (none to start or stop): what `sync()` would return without its work. None:
        `sync()` has work to do, or is doing it."""
        daemons = self.daemons.between_scans()
        if daemons is None or not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._synced or {d.name: d.log_directory for d in daemons} != {
                    name: p.log_directory for name, p in self.pipelines.items()}:
                return None
            return dict(self.pipelines)
        finally:
            self._lock.release()

    def _watch(self) -> None:
        while not self._stop.wait(self.daemons.interval):
            try:
                self.sync()
            except Exception:  # a bug costs discovery's freshness, never the exporter
                log.exception("following the daemons' logs failed")

    def start(self) -> None:
        self._started = True
        for p in self.sync().values():
            p.start()
        if self.daemons.roots and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mps-logs-discovery", daemon=True)
            self._thread.start()

    def catch_up(self) -> None:
        for p in self.sync().values():
            p.read_once()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            for p in self.pipelines.values():
                p.stop()


BACKLOG_METRICS = table(
    "The MPS logs' backlog",
    gauge("mps_log_backlog_bytes", "Bytes of the daemon's control.log and server.log left to read before its "
          "logs are served: after a start without a state file (or with one far behind) the logs are read "
          "through their history first, and until then their families are absent, collector_success"
          "{collector=\"logs\"} is 0 and /-/ready answers 503; 0 once read to their end.", DAEMON),
)


def pipelines_reader(pipelines: DaemonPipelines) -> Reader[Dict[str, LogSnapshot]]:
    """The reader over these pipelines (daemon name -> its pipeline)."""

    def read(ctx: ReadContext) -> Dict[str, LogSnapshot]:
        return read_from(pipelines.sync())

    def quick(ctx: ReadContext) -> Optional[Dict[str, LogSnapshot]]:
        current = pipelines.in_step()
        if current is None or any(p.snapshot().problems for p in current.values()):
            return None  # a daemon come or gone, or a file that cannot be read: read() sees to it
        return read_from(current)

    def read_from(current: Dict[str, LogPipeline]) -> Dict[str, LogSnapshot]:
        logs = {name: p.snapshot() for name, p in current.items()}
        if any(s.problems for s in logs.values()) and any(
                d.layout != "static" and not os.path.isdir(d.log_directory) for d in pipelines.daemons.current()):
            # A discovered daemon's directory went away (a released claim): drop it now, not
            # at the next scan, instead of failing the collector until then.
            current = pipelines.sync(rescan=True)
            logs = {name: logs[name] for name in current if name in logs}
        for name, snap in logs.items():  # the backlog as of now: what the control source trusts
            unread = current[name].unread_bytes()
            if unread != snap.backlog_bytes:
                logs[name] = dataclasses.replace(snap, backlog_bytes=unread)
        # A discovered daemon still there without its log directory: the device plugin removes
        # it at every restart of its daemon pod. Its logs are absent, not failing (its
        # mps_log_read_errors_total still counts the missing directory).
        logless = {d.name for d in pipelines.daemons.current()
                   if d.layout != "static" and not os.path.isdir(d.log_directory)}
        problems = [f"{name}: {problem}" for name, s in logs.items() if name not in logless for problem in s.problems]
        problems += [f"{name}: catching up, {s.backlog_bytes} bytes of its logs left to read"
                     for name, s in logs.items() if not s.caught_up]
        if problems:  # a file that cannot be read: what was read still counts, the collector fails
            raise PartialFailure("; ".join(problems), logs)
        return logs

    def ready() -> bool:
        return all(p.snapshot().caught_up for p in list(pipelines.pipelines.values()))

    return Reader(read, quick=quick, start=pipelines.start, catch_up=pipelines.catch_up, close=pipelines.close, ready=ready,
                  source=pipelines)


def _file_name(path: str) -> str:
    # Paths that may appear later (a mount, a daemon's directories) are not checked, nor is
    # what is there now: a directory at the path (a hostPath mount Kubernetes created)
    # must not keep the exporter from starting; loading and saving count it instead.
    if not path:
        raise ValueError("give a file name")
    return path


def _log_start(value: str) -> str:
    if value not in LOG_STARTS:
        raise ValueError(f"{value!r}: give one of {', '.join(LOG_STARTS)}")
    return value


def _timezone(name: str) -> str:
    resolve_timezone(name)  # ValueError: not a time zone
    return name


class LogsSourceSpec(Source[Dict[str, LogSnapshot]]):
    name = "logs"
    help = "control.log and server.log: queueing, handoffs, faults, lifecycle, commands"
    recorded = False
    metrics = BACKLOG_METRICS
    flags = (
        Flag("--mps.state-file", "state_file", "file where the log follower keeps offsets and counters across "
             "restarts", refuses=("",), check=_file_name),
        Flag("--mps.log-start", "log_start", "where to read a log from when the state file has nothing of it: "
             "'beginning' counts its whole history (a year of a busy node's control.log takes about an hour, and "
             "the log families are not served until then); 'end' skips what it holds now: the log counters start "
             "at 0, and the clients already connected get their server's current limits, not those they "
             "connected under (default %(default)s)", refuses=("middle", ""), check=_log_start),
        Flag("--mps.log-timezone", "log_timezone", "time zone of MPS log timestamps (they carry none): local or "
             "an IANA name (default %(default)s)", refuses=("Mars/Olympus", "Not A Zone"), check=_timezone),
    )

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[Dict[str, LogSnapshot]]]:
        daemons: DaemonSet = backends.daemon_set or DaemonSet(cfg.daemons)
        if not daemons.static and not daemons.roots:
            return None
        store = StateStore(cfg.state_file) if cfg.state_file else None
        liveness = cfg.procfs if cfg.queued_client_liveness else None

        def make(d: DaemonConfig) -> LogPipeline:
            return LogPipeline(d.name, d.log_directory, timezone=cfg.log_timezone, state_store=store,
                               proc_root=liveness, log_start=cfg.log_start, clock=backends.clock)

        return pipelines_reader(DaemonPipelines(daemons, make, store))

    def store(self, snap: Snapshot, reading: Dict[str, LogSnapshot]) -> None:
        # A daemon whose logs are still being read through their history has counters on
        # their way up from 0: Prometheus would see a reset, then months of events as
        # news. Only the backlog is served until the end is reached.
        snap.logs = {name: s for name, s in reading.items() if s.caught_up}
        snap.extra[self.name] = reading

    def render(self, out: FamilyBuilder, snap: Snapshot) -> None:
        for name, s in sorted((self.reading(snap) or {}).items()):
            out.add("mps_log_backlog_bytes", 0 if s.caught_up else s.backlog_bytes, daemon=name)
        render_state_file_errors(out, (self.reading(snap) or {}).values())


SOURCE = LogsSourceSpec()
