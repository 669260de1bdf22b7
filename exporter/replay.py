"""`mps-exporter replay [BUNDLE] [--speed X] [--loop]`: serve a capture as if it were live.

The real web server, collector and log pipeline run; only the sources are
replaced. A `Player` walks the bundle on a virtual timeline (bundle seconds =
real seconds x speed):
- the collector's clock is the recorded time of that moment, and each source
  answers what it returned at the last reading recorded before it (or raises
  the error it raised then);
- `replay` plays on the present clock (`Player(present=...)`): every recorded
  time (the collector's clock, so the last-success timestamps; process start
  times; the timestamps of the log lines, so server starts, client connections,
  queue times and the last-line times) is moved by the replay's start less the
  recording's, so ages and "connected for" read as on a live node and the
  staleness alerts stay quiet. A new lap moves them on by the bundle's duration.
  `status --bundle` keeps the recording's own times;
- a feeder thread appends the recorded log chunks, byte for byte, to a private
  temporary log directory when they are due, and the real LogPipeline follows
  those files as it follows /var/log/nvidia-mps;
- past the end the last moment stays; with --loop the bundle starts over: the
  log files are rotated (renamed to *.1, as logrotate does) and written again,
  so the log counters keep growing and the recorded times repeat.

With no BUNDLE the session shipped in the package (exporter/data/) is played,
in a loop.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from datetime import datetime, tzinfo
from typing import Any, Callable, Dict, Optional, Tuple

from .bundle import SUFFIX, Bundle, BundleError, LogChunk, Scrape, load
from .codec import RecordedFailure
from .config import Config, DaemonConfig
from .logs.parser import resolve_timezone
from .service import serve
from .wiring import build_readers
from .model import LogSnapshot
from .sources.base import Backends, PartialFailure, ReadContext, Reader
from .sources.registry import SOURCES

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
FEED_SECONDS = 0.05  # how often the feeder looks for due log chunks (real seconds)
# The time at the start of a log line (parser.HEADER_PATTERN's first part), fixed width.
_LINE_TIME = re.compile(rb"^\[(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{3})", re.M)


def shipped_bundle() -> str:
    found = sorted(DATA_DIR.glob("*" + SUFFIX)) if DATA_DIR.is_dir() else []
    if not found:
        raise BundleError("no recorded session is shipped with this mps-exporter yet; "
                          "give a bundle written by `mps-exporter capture`: mps-exporter replay BUNDLE")
    return str(found[0])


class Player:
    """One bundle on a virtual timeline; `monotonic` is injectable so tests step time."""

    def __init__(self, bundle: Bundle, log_root: str, speed: float = 1.0, loop: bool = False,
                 monotonic: Callable[[], float] = time.monotonic, start_at: float = 0.0,
                 present: Optional[float] = None) -> None:
        """present: the unix time the replay starts at; every recorded time is moved by it
        less the recording's time at `start_at` (None: the recording's own times)."""
        self.bundle = bundle
        self.speed = speed
        self.loop = loop and bundle.duration > 0
        self._monotonic = monotonic
        self._start = monotonic() - start_at / speed  # start_at: seconds into the bundle
        self._times = [s.t for s in bundle.scrapes]
        self._scrape = bundle.scrapes[0]
        self.shifting = present is not None
        first = bundle.scrapes[0]
        recorded_start = first.now - first.t + start_at  # the recording's clock at start_at
        # Whole milliseconds, the log lines' resolution: every time moves by the same amount.
        self._shift_ms = round((present - recorded_start) * 1000) if present is not None else 0
        self._scrape_shift = self.shift(0)
        self._tz: Optional[tzinfo] = None
        if present is not None:
            try:
                self._tz = resolve_timezone(str(bundle.header.get("log_timezone") or "UTC"))
            except ValueError as e:
                raise BundleError(f"{bundle.path}: {e}; install the tzdata package to replay it") from e
        self._held: Dict[str, bytes] = {}  # path -> an unterminated last line not written yet
        self.log_dirs: Dict[str, str] = {}
        for i, d in enumerate(bundle.header["daemons"]):  # by position: daemon names are not file names
            self.log_dirs[d["name"]] = os.path.join(log_root, str(i))
            os.makedirs(self.log_dirs[d["name"]], exist_ok=True)
        self.lap = 0
        self._next_chunk = 0
        self._feed_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._told_end = False

    # ------------------------------------------------------------ timeline
    def position(self) -> Tuple[int, float]:
        """(lap, seconds into the bundle) now."""
        t = (self._monotonic() - self._start) * self.speed
        if self.loop:
            lap = int(t // self.bundle.duration)
            return lap, t - lap * self.bundle.duration
        return 0, t

    def scrape_at(self, t: float) -> Scrape:
        """The last reading recorded at or before t (the first one before it)."""
        return self.bundle.scrapes[max(bisect.bisect_right(self._times, t) - 1, 0)]

    def shift(self, lap: int) -> float:
        """Seconds added to the recorded times of a lap (0 without `present`): the
        replay's start less the recording's, and a bundle's duration more for each lap."""
        if not self.shifting:
            return 0.0
        return (self._shift_ms + round(lap * self.bundle.duration * 1000)) / 1000

    def clock(self) -> float:
        """The collector's clock. The collector calls it once as a reading starts, so every
        source of that reading answers from the same recorded moment."""
        lap, t = self.position()
        scrape = self._scrape = self.scrape_at(t)
        self._scrape_shift = self.shift(lap)
        return scrape.now + (t - scrape.t) + self._scrape_shift

    def now(self) -> float:
        """The clock's time now, for any thread (the log state checks line times against
        it): unlike clock(), it leaves the moment the sources answer from as it is."""
        lap, t = self.position()
        scrape = self.scrape_at(t)
        return scrape.now + (t - scrape.t) + self.shift(lap)

    def backends(self) -> Backends:
        """What the unrecorded sources (the logs) are built with: this replay's clock."""
        return Backends(clock=self.now)

    def result(self, name: str) -> Any:
        """What source `name` returned (or raised) at the current moment, its times moved
        as the clock's."""
        if name not in self._scrape.results:
            raise RecordedFailure(f"{name} was not read at this moment of the capture")
        source = SOURCES[name]
        reading = source.replay(self._scrape.results[name])
        return source.shift(reading, self._scrape_shift) if self._scrape_shift else reading

    def readers(self) -> Dict[str, Reader[Any]]:
        """The recorded sources, answering from the bundle."""
        return {name: Reader(self._answer(name)) for name in self.bundle.header["sources"]}

    def _answer(self, name: str) -> Callable[[ReadContext], Any]:
        return lambda ctx: self.result(name)

    def log_errors_at(self, t: float) -> Dict[Tuple[str, str], Tuple[str, str]]:
        """(daemon, file) -> (reason, message) of the log read errors in force at t."""
        now: Dict[Tuple[str, str], Tuple[str, str]] = {}
        for e in self.bundle.log_errors:
            if e.t > t:
                break
            if e.error is None:
                now.pop((e.daemon, e.file), None)
            else:
                now[(e.daemon, e.file)] = (e.reason, e.error)
        return now

    def with_log_errors(self, reader: Reader[Dict[str, LogSnapshot]]) -> Reader[Dict[str, LogSnapshot]]:
        """The logs reader over the fed files, failing as the captured node's did: a log
        directory that was missing there fails here too, with the recorded message."""

        def read(ctx: ReadContext) -> Dict[str, LogSnapshot]:
            try:
                logs = reader.read(ctx)
            except PartialFailure as failure:
                logs = failure.result
            _, t = self.position()
            errors = self.log_errors_at(t)
            begun: Dict[Tuple[str, str, str], int] = {}
            for e in self.bundle.log_errors:
                if e.t <= t and e.error is not None:
                    begun[(e.daemon, e.file, e.reason)] = begun.get((e.daemon, e.file, e.reason), 0) + 1
            out = {}
            for name, snap in logs.items():
                problems = set(snap.problems) | {message for (daemon, _), (_, message) in errors.items()
                                                 if daemon == name}
                read_errors = dict(snap.read_errors)
                for (daemon, file, reason), n in begun.items():
                    if daemon == name:
                        read_errors[(file, reason)] = read_errors.get((file, reason), 0) + n
                out[name] = dataclasses.replace(snap, problems=tuple(sorted(problems)), read_errors=read_errors)
            failures = [f"{name}: {p}" for name, snap in out.items() for p in snap.problems]
            if failures:
                raise PartialFailure("; ".join(failures), out)
            return out

        return dataclasses.replace(reader, read=read, quick=None)  # every read adds the recorded errors

    def readers_with(self, unrecorded: Dict[str, Reader[Any]]) -> Dict[str, Reader[Any]]:
        """Every reader of a replay: the recorded sources from the bundle, the others (the
        logs, over the fed files) as given, the logs failing where the capture's did."""
        out = {**unrecorded, **self.readers()}
        if "logs" in out:
            out["logs"] = self.with_log_errors(out["logs"])
        return out

    # ------------------------------------------------------------ log files
    def feed(self) -> None:
        """Append the log chunks that are due; at a new lap finish the old one and rotate."""
        with self._feed_lock:
            lap, t = self.position()
            if lap != self.lap:
                self._write_until(float("inf"))
                self._flush_held()
                for directory in self.log_dirs.values():
                    for name in os.listdir(directory):
                        if name.endswith(".log"):
                            _rotate(os.path.join(directory, name))
                self.lap, self._next_chunk = lap, 0
                log.debug("replay: starting over (lap %d)", lap + 1)
            self._write_until(t)
            if not self.loop and t >= self.bundle.duration:
                self._flush_held()  # no more bytes come to end them
            if not self.loop and t >= self.bundle.duration and not self._told_end:
                self._told_end = True
                log.info("replay: reached the end of the bundle (%.1f s); serving its last moment "
                         "(--loop starts over)", self.bundle.duration)

    def _write_until(self, t: float) -> None:
        chunks = self.bundle.logs
        while self._next_chunk < len(chunks) and chunks[self._next_chunk].t <= t:
            self._append(chunks[self._next_chunk])
            self._next_chunk += 1

    def _append(self, chunk: LogChunk) -> None:
        path = os.path.join(self.log_dirs[chunk.daemon], chunk.file)
        if chunk.new_file:
            self._flush_held(path)
            _rotate(path)
        data = chunk.data
        if self.shifting:
            # A line's time is rewritten whole: a line the chunk ends inside (its time
            # maybe cut in two) waits for the rest.
            data = self._held.pop(path, b"") + data
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                self._held[path] = data[cut:]
            data = self._shifted_lines(data[:cut])
        _write(path, data)

    def _flush_held(self, path: Optional[str] = None) -> None:
        """Write the unterminated last lines held back (of `path`, or of every file)."""
        for held in [path] if path is not None else list(self._held):
            data = self._held.pop(held, b"")
            if data:
                _write(held, self._shifted_lines(data))

    def _shifted_lines(self, data: bytes) -> bytes:
        """The log lines with their times moved by this lap's shift, read and written in
        the recording's time zone (the width stays: byte offsets mean the same)."""
        shift_ms = round(self.shift(self.lap) * 1000)
        if not shift_ms:
            return data
        tz = self._tz

        def moved(m: "re.Match[bytes]") -> bytes:
            try:
                y, mo, d, h, mi, sec, ms = (int(g) for g in m.groups())
                epoch_ms = round(datetime(y, mo, d, h, mi, sec, tzinfo=tz).timestamp() * 1000) + ms + shift_ms
                when = datetime.fromtimestamp(epoch_ms // 1000, tz)
            except (ValueError, OverflowError, OSError):  # not a date: the parser skips it anyway
                return m.group(0)
            if not 1000 <= when.year <= 9999:
                return m.group(0)
            return f"[{when:%Y-%m-%d %H:%M:%S}.{epoch_ms % 1000:03d}".encode("ascii")

        return _LINE_TIME.sub(moved, data)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mps-replay-feeder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.feed()
            except OSError as e:  # the temp directory went away: nothing more to feed
                log.error("replay: cannot write the log files: %s", e)
                return
            self._stop.wait(FEED_SECONDS)


def _write(path: str, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _rotate(path: str) -> None:
    """A rename, as logrotate does: the follower reads the old file to its end, then
    the new one from its beginning (a new inode: deleting could hand back the old one)."""
    if os.path.exists(path):
        os.replace(path, path + ".1")


def replay_config(cfg: Config, bundle: Bundle, log_dirs: Dict[str, str]) -> Config:
    """The flags' web and logging settings; daemons, collectors and log time zone from the bundle."""
    h = bundle.header
    play = dataclasses.replace(cfg, collectors=dict(cfg.collectors), state_file=None)
    play.daemons = [DaemonConfig(d["name"], d["pipe_directory"], log_dirs[d["name"]]) for d in h["daemons"]]
    play.collectors.update({name: name in h["sources"] for name, source in SOURCES.items() if source.recorded})
    play.collectors["logs"] = bool(h.get("logs")) and bool(play.daemons)
    play.log_timezone = str(h.get("log_timezone") or "UTC")
    play.queued_client_liveness = False
    play.exit_status = False  # nor are its clients' exits this kernel's
    play.discover_processes = False  # a bundle's daemons are another machine's, this one's /proc is not
    play.refresh_interval = 0.0  # a recorded reading belongs to its moment: read it at the scrape's
    # Likewise the control daemon's: a scrape that did not wait for its recorded answer served
    # the previous moment's (a loaded machine missed the 10 ms wait and shifted a row by one).
    play.control_wait = 0.0
    try:
        resolve_timezone(play.log_timezone)
    except ValueError as e:
        raise BundleError(f"{bundle.path}: {e}; install the tzdata package to replay it") from e
    return play


def replay_notice(bundle: Bundle, player: Player) -> str:
    """What the landing page says: a replay, of which recorded session."""
    recorded = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(bundle.scrapes[0].now - bundle.scrapes[0].t))
    how = f"{player.speed:g}x speed" + (", looping" if player.loop else "")
    return (f"Replay, not a live node: the recorded session {os.path.basename(bundle.path)} "
            f"({bundle.duration:.0f} s recorded {recorded}, {bundle.end.get('driver_version') or 'no NVIDIA driver'}; "
            f"{how}), its times moved to the present.")


def replay(cfg: Config, stop: Optional[threading.Event] = None, ready: Optional[threading.Event] = None,
           wall_clock: Callable[[], float] = time.time) -> int:
    """The `replay` command: one error line and exit 2 for a bundle that cannot be played.
    `wall_clock`: the present the recorded times are moved to (tests fix it)."""
    loop = cfg.replay.loop or cfg.replay.bundle is None  # the demo session plays on until stopped
    try:
        bundle = load(cfg.replay.bundle or shipped_bundle())
        with tempfile.TemporaryDirectory(prefix="mps-exporter-replay-") as root:
            player = Player(bundle, root, cfg.replay.speed, loop, present=wall_clock())
            play_cfg = replay_config(cfg, bundle, player.log_dirs)
            log.info("replaying %s: %d readings over %.1f s recorded from %s, at %gx speed%s", bundle.path,
                     len(bundle.scrapes), bundle.duration, bundle.end.get("driver_version") or "no NVIDIA driver",
                     cfg.replay.speed, ", looping" if player.loop else "")
            player.start()
            try:
                # The unrecorded sources (the logs) follow the files the player feeds.
                readers = player.readers_with(build_readers(play_cfg, player.backends(), recorded=False))
                return serve(play_cfg, stop, ready, readers=readers, clock=player.clock,
                             notice=replay_notice(bundle, player))
            finally:
                player.stop()
    except BundleError as e:
        sys.stderr.write(f"mps-exporter: error: {e}\n")
        return 2
