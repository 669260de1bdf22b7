"""`mps-exporter capture`: record what the exporter sees into one bundle file.

At every interval the real collector reads the real sources, each wrapped so
that what it returned (or the error it raised) goes into the bundle as JSON.
Between readings the MPS log files are tapped as bytes: whatever was appended
since the last look, byte-exact, with the time it was seen; a file that was
replaced or truncated starts over with a `new_file` chunk. Content already in
the files when the capture starts is recorded at t=0, the way the live
exporter reads it at start. Format: docs/capture-format.md.

Runs with the standard library, prometheus-client and nvidia-ml-py only (no
web server, no YAML unless --config.file is given).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import platform
import threading
import time
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Tuple

from . import __version__
from .bundle import SUFFIX, BundleWriter, LogChunk, LogError, log_error_record, log_record
from .config import Config
from .discovery import DaemonSet
from .logs.events import FILES
from .logs.follower import NOT_REGULAR_FILE, NotRegularFile, ReadError, missing_file_error, open_regular, read_error
from .logs.parser import resolve_timezone
from .logs.pipeline import POLL_SECONDS
from .model import Snapshot
from .wiring import build_collector, build_readers, stop_on_signals
from .sources.base import PartialFailure, ReadContext, Reader
from .sources.registry import SOURCES

log = logging.getLogger(__name__)

LOG_FILES = tuple(f + ".log" for f in FILES)
# Sources that only look up what the others found (proc reads /proc for the PIDs NVML and the
# control daemon name): their answering says nothing of the node's GPUs or MPS.
ONLY_LOOKS_UP = frozenset({"proc"})


class LogTap:
    """The bytes appended to one log file since the last poll.

    Holds the file open, so bytes written just before a rotation are still
    read from the old file before the new one is opened. Of what the file
    holds at the first poll, only the last `history_bytes` are taken (from a
    line start); None takes all."""

    def __init__(self, path: str, history_bytes: Optional[int] = None) -> None:
        self.path = path
        self._file: Optional[BinaryIO] = None
        self._identity: Optional[Tuple[int, int]] = None
        self._history = history_bytes
        self.skipped = 0  # bytes of history left out
        # Why the file can not be read now, as the exporter's log follower would say (None: fine).
        self.error: Optional[ReadError] = None

    def poll(self) -> List[Tuple[bool, bytes]]:
        """[(new_file, data)]: new_file says the file was replaced or truncated before data."""
        out: List[Tuple[bool, bytes]] = []
        history, self._history = self._history, None  # applies to the first look only
        if self._file is not None:
            data = self._file.read()
            if data:
                out.append((False, data))
        try:
            st = os.lstat(self.path)  # a symbolic link is not followed (open_regular refuses it)
        except OSError as e:  # not there (yet, or its directory was deleted): keep what we hold
            self.error = missing_file_error(self.path) if e.errno == errno.ENOENT else read_error(self.path, e)
            return out
        self.error = None
        if self._file is not None and (st.st_dev, st.st_ino) == self._identity and st.st_size >= self._file.tell():
            return out
        replaced = self._file is not None
        self.close()
        try:  # a FIFO or /dev/zero under the name must not block or flood the capture
            fd, st = open_regular(self.path)
        except NotRegularFile as e:
            self.error = ReadError(NOT_REGULAR_FILE, str(e))
            return out
        except OSError as e:
            self.error = None if e.errno == errno.ENOENT else read_error(self.path, e)
            return out
        self._file = os.fdopen(fd, "rb")
        self._identity = (st.st_dev, st.st_ino)
        data = self._file.read()
        if history is not None and len(data) > history:
            cut = len(data) - history - 1  # one byte before: is the cut already at a line start?
            newline = data.find(b"\n", cut)
            start = len(data) if newline < 0 else newline + 1
            self.skipped, data = start, data[start:]
        if replaced or data:
            out.append((replaced, data))
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def recording(name: str, reader: Reader[Any], results: Dict[str, Any]) -> Reader[Any]:
    """`reader`, also keeping what each read returned (or raised) as its bundle entry,
    its quick read's included (where it declined, `read` answers and is kept)."""
    source = SOURCES[name]

    def kept(read: Callable[[ReadContext], Any]) -> Callable[[ReadContext], Any]:
        def recorded_read(ctx: ReadContext) -> Any:
            try:
                value = read(ctx)
            except PartialFailure as e:
                results[name] = source.record(e.result)
                raise
            except Exception as e:
                results[name] = source.record_failure(f"{type(e).__name__}: {e}")
                raise
            if value is not None or read is reader.read:
                results[name] = source.record(value)
            return value
        return recorded_read

    quick = None if reader.quick is None else kept(reader.quick)
    return dataclasses.replace(reader, read=kept(reader.read), quick=quick)


class Recorder:
    """Drives the collector over recording sources and writes every event.

    `poll_logs()` and `scrape()` are one step each; `run()` repeats them on the
    clock. Tests call the steps themselves on recorded scenarios."""

    def __init__(self, cfg: Config, readers: Dict[str, Reader[Any]], writer: BundleWriter,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.writer = writer
        self._monotonic = monotonic
        self._start = monotonic()
        self._results: Dict[str, Any] = {}
        self._served: Dict[str, Any] = {}  # source -> its last recorded entry
        wrapped = {name: recording(name, reader, self._results) if SOURCES[name].recorded else reader
                   for name, reader in readers.items()}
        self.collector = build_collector(cfg, wrapped, clock=clock)
        self._taps = [(d.name, f, LogTap(os.path.join(d.log_directory, f), cfg.capture.log_history_bytes))
                      for d in cfg.daemons for f in LOG_FILES] if SOURCES["logs"].enabled(cfg) else []
        self.scrapes = self.log_chunks = self.log_bytes = 0
        self.answered: Dict[str, int] = {name: 0 for name in wrapped}  # readings a source answered
        self.last_error: Dict[str, str] = {}  # source -> why its last failed reading failed
        self._log_errors: Dict[Tuple[str, str], Optional[str]] = {}  # (daemon, file) -> its error now
        self.log_problems: Dict[Tuple[str, str], str] = {}  # (daemon, file) -> its first error
        self._nvml: Optional[Dict[str, Any]] = None  # the last NVML reading: driver and GPUs for the end record

    @property
    def has_logs(self) -> bool:
        return bool(self._taps)

    def elapsed(self) -> float:
        return self._monotonic() - self._start

    def poll_logs(self) -> None:
        t = self.elapsed()
        for daemon, file, tap in self._taps:
            for new_file, data in tap.poll():
                self.writer.write(log_record(LogChunk(t, daemon, file, data, new_file)))
                self.log_chunks += 1
                self.log_bytes += len(data)
            error = tap.error.message if tap.error else None
            if self._log_errors.get((daemon, file)) != error:  # recorded as it starts and as it ends
                self._log_errors[(daemon, file)] = error
                reason = tap.error.reason if tap.error else ""
                self.writer.write(log_error_record(LogError(t, daemon, file, error, reason)))
                if error is not None:
                    self.log_problems.setdefault((daemon, file), error)

    def scrape(self) -> Snapshot:
        self._results.clear()
        t = self.elapsed()
        snap = self.collector.snapshot()
        # A source not read for this scrape (its last reading still fresh: control between
        # refresh rounds) served its last reading: recorded again, its error included, so that
        # every reading of the bundle says what the exporter served, not only the first.
        for name in snap.outcomes:
            if name in self._results:
                self._served[name] = self._results[name]
            elif name in self._served:
                self._results[name] = self._served[name]
        self.writer.write({"kind": "scrape", "t": t, "now": snap.now, "sources": dict(self._results),
                           "durations": {k: round(o.duration_seconds, 6) for k, o in snap.outcomes.items()}})
        self.scrapes += 1
        for name, outcome in snap.outcomes.items():
            if outcome.success:
                self.answered[name] = self.answered.get(name, 0) + 1
            elif outcome.error:
                self.last_error[name] = outcome.error
        nvml = self._results.get("nvml", {}).get("value")
        if nvml is not None:
            self._nvml = nvml
        return snap

    def run(self, duration: float, interval: float, stop: threading.Event) -> None:
        """Read the sources every `interval` and the logs every POLL_SECONDS, for `duration`
        seconds or until `stop`; one last look at everything at the end."""
        next_scrape = 0.0
        while not stop.is_set() and self.elapsed() < duration:
            self.poll_logs()
            if self.elapsed() >= next_scrape:
                self.scrape()
                while next_scrape <= self.elapsed():  # a slow reading skips ticks, never bunches them
                    next_scrape += interval
            stop.wait(max(0.0, min(POLL_SECONDS, next_scrape - self.elapsed(), duration - self.elapsed())))
        self.poll_logs()
        self.scrape()

    def end_record(self) -> Dict[str, Any]:
        gpus = [{k: g.get(k) for k in ("index", "uuid", "name", "memory_total_bytes")}
                for g in (self._nvml or {}).get("gpus", [])]
        return {"t": self.elapsed(), "scrapes": self.scrapes, "log_chunks": self.log_chunks,
                "log_bytes": self.log_bytes, "driver_version": (self._nvml or {}).get("driver_version", ""),
                "gpus": gpus, "log_history_skipped": [{"daemon": d, "file": f, "bytes": tap.skipped}
                                                      for d, f, tap in self._taps if tap.skipped]}

    def summary(self) -> Tuple[List[str], List[str]]:
        """(lines for the user, the sources that never answered): every recorded source's
        readings answered, and every log file that could not be read."""
        lines, silent = [], []
        for name in sorted(self.answered):
            answered = self.answered[name]
            line = f"{name}: {answered} of {self.scrapes} readings answered"
            if answered < self.scrapes:
                line += f" (last error: {self.last_error.get(name, 'no reason given')})"
            if not answered:
                silent.append(name)
            lines.append(line)
        for (daemon, file), error in sorted(self.log_problems.items()):
            lines.append(f"logs of daemon {daemon}, {file}: {error}")
        if self._taps and not self.log_bytes and len(self.log_problems) == len(self._taps):
            silent.append("logs")
        return lines, silent

    def close(self) -> None:
        for _, _, tap in self._taps:
            tap.close()


_UTC_NAMES = {"UTC", "UCT", "Universal", "Zulu", "GMT", "GMT0", "Greenwich"}


def concrete_timezone(name: str) -> str:
    """The logs' time zone as a name replay resolves the same way on any machine:
    'local' is looked up now (TZ, /etc/localtime, else the current UTC offset)."""
    if name and name != "local":
        return name
    candidates = [os.environ.get("TZ", "").lstrip(":")]
    try:
        link = os.readlink("/etc/localtime")
        candidates.append(link.split("zoneinfo/", 1)[1] if "zoneinfo/" in link else "")
    except OSError:
        pass
    for key in filter(None, candidates):
        if key.split("/")[-1] in _UTC_NAMES:
            return "UTC"  # needs no time zone database where the bundle is replayed
        try:
            if resolve_timezone(key) is not None:
                return key
        except ValueError:
            continue
    offset = time.localtime().tm_gmtoff
    if offset % 3600 == 0:
        return "UTC" if offset == 0 else f"Etc/GMT{-offset // 3600:+d}"  # Etc/GMT signs are inverted
    log.warning("capture: local time zone has no name and a UTC offset of %d s; replay will read "
                "log times in the replaying machine's zone", offset)
    return "local"


def bundle_path(out: str, started: float) -> str:
    if os.path.isdir(out):
        return os.path.join(out, time.strftime("mps-capture-%Y%m%dT%H%M%SZ", time.gmtime(started)) + SUFFIX)
    return out


def header(cfg: Config, readers: Mapping[str, Reader[Any]], started: float) -> Dict[str, Any]:
    return {
        "exporter_version": __version__,
        "python_version": platform.python_version(),
        "kernel": platform.release(),
        "started_at": started,
        "interval_seconds": cfg.capture.interval_seconds,
        "sources": sorted(name for name in readers if SOURCES[name].recorded),
        "logs": SOURCES["logs"].enabled(cfg),
        "log_files": list(LOG_FILES),
        "log_history_bytes": cfg.capture.log_history_bytes,
        "log_timezone": concrete_timezone(cfg.log_timezone),
        "daemons": [{"name": d.name, "pipe_directory": d.pipe_directory, "log_directory": d.log_directory}
                    for d in cfg.daemons],
    }


def capture(cfg: Config, stop: Optional[threading.Event] = None, readers: Optional[Dict[str, Reader[Any]]] = None) -> int:
    """The `capture` command. `readers` replaces the live ones (tests)."""
    started = time.time()
    path = bundle_path(cfg.capture.out, started)
    # A bundle records a fixed list of daemons: those discovery finds now join the static ones.
    found = DaemonSet(cfg.daemons, cfg.discover, processes=cfg.discover_processes, proc_root=cfg.procfs).rescan()
    cfg = dataclasses.replace(cfg, daemons=found, discover=[], discover_processes=False)
    readers = build_readers(cfg, recorded=True) if readers is None else readers
    stop = stop or threading.Event()
    stop_on_signals(stop)  # Ctrl-C ends the capture early and still writes the bundle
    try:
        writer = BundleWriter(path, header(cfg, readers, started))
    except OSError as e:
        log.error("cannot write the bundle %s: %s", path, e.strerror or e)
        return 2
    for reader in readers.values():
        reader.start()  # background work: the Xid source's event thread
    recorder = Recorder(cfg, readers, writer)
    log.info("capturing for %g s, sources every %g s, into %s", cfg.capture.duration_seconds,
             cfg.capture.interval_seconds, path)
    try:
        recorder.run(cfg.capture.duration_seconds, cfg.capture.interval_seconds, stop)
        writer.close(recorder.end_record())
    except OSError as e:
        log.error("writing the bundle %s failed: %s", path, e.strerror or e)
        return 2
    finally:
        recorder.close()
        for reader in readers.values():
            reader.close()  # frees GPM samples, shuts NVML down
    log.info("wrote %s: %d readings, %d log bytes in %d chunks, %.1f s (%d bytes)", path, recorder.scrapes,
             recorder.log_bytes, recorder.log_chunks, recorder.elapsed(), os.path.getsize(path))
    # A bug-report bundle must not hide the error it was taken for: what never answered, last.
    lines, silent = recorder.summary()
    for line in lines:
        log.info("capture summary: %s", line)
    if silent:
        log.warning("capture summary: never answered: %s", ", ".join(silent))
    print(path)
    telling = [name for name in recorder.answered if name not in ONLY_LOOKS_UP] + (["logs"] if recorder.has_logs else [])
    if telling and set(telling) <= set(silent):
        log.error("capture: neither NVML, the control daemon nor the logs answered during the capture; "
                  "the bundle holds their errors")
        return 1
    return 0
