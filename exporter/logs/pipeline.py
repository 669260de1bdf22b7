"""One MPS daemon's log pipeline: followers -> parser -> state machine -> snapshot.

A background thread reads `control.log` and `server.log` every POLL_SECONDS, and at
once on each write while logrotate is at work (inotify on the log directory: wake.py
says why), and publishes a fresh `LogSnapshot` at most every PUBLISH_SECONDS while
lines keep coming. While clients are
queued it also asks /proc, every LIVENESS_SECONDS, whether they still exist
(liveness.py: the logs never say that a queued client died). A scrape calls
`snapshot()`, which returns the last published copy: it never reads a file and
never waits for the reader thread.

    pipe = LogPipeline("default", "/var/log/nvidia-mps", timezone="local", state_store=store)
    pipe.start()            # serve
    snap = pipe.snapshot()
    pipe.stop()

    LogPipeline("default", DIR).read_once()   # `dump`: the files from their beginning
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .bulk import apply_server_text
from .echoes import apply_control_text
from .events import FILES
from .follower import DEFAULT_MAX_LINE_BYTES, INTERNAL_ERROR, FileFollower, ReadError, end_position
from .liveness import ProcLiveness
from .wake import DirectoryWatch
from .parser import parse_line, resolve_timezone
from ..model import LogSnapshot
from .state import LogState, NegativeCounter
from .statefile import NEGATIVE_COUNTER, POSITION, SHAPE, StateStore

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # the longest wait between two looks at the files
PUBLISH_SECONDS = 0.25  # reading on each write must not mean a snapshot per line
SAVE_SECONDS = 5.0  # the state file is written at most this often (and at stop)
PUBLISH_LINES = 100_000  # while catching up on a long log, publish every this many lines
PAUSE_GC_CHARACTERS = 100_000  # a batch this long or more (~1000 lines) is applied with the cyclic GC paused
# A reader that read nothing for QUIET_ROUNDS rounds, with everything published and saved
# and no client queued, sleeps until a log is written (inotify) or QUIET_SECONDS pass
# instead of looking 4 times a second: ~0.3 ms of CPU a look was an idle exporter's whole
# cost, 1.0-1.3 ms/s (issue 29 asks under 1); 0.5 now. Where inotify misses writes (network
# file systems) lines are late by QUIET_MAX_SECONDS at most until the first such miss is
# seen, QUIET_SECONDS after it (QuietWait). Without a watch it polls as before.
# 2 rounds (0.5 s), not 8: the exporter's own command each scrape writes a few lines at
# once, and 8 rounds looked 6 times more after each for nothing: at 15 s scrapes 0.31 ms/s
# of a real H200 node's 1.09 went to this thread (issue 44). Lines coming more often than
# every 0.5 s keep it looking every 250 ms, as before.
QUIET_ROUNDS = 2
QUIET_SECONDS = 2.0
# Each quiet wait that runs out with nothing new to read doubles the next, up to
# QUIET_MAX_SECONDS (QuietWait): where the watch has seen every write, a look every 2 s
# finds nothing, and at 15 s scrapes those looks were most of this thread's CPU.
QUIET_MAX_SECONDS = 16.0
LIVENESS_SECONDS = 2.0  # how often /proc is asked about queued clients (a stat per client)
# --mps.log-start: where a log the state file does not know is read from.
LOG_START_BEGINNING, LOG_START_END = "beginning", "end"
LOG_STARTS = (LOG_START_BEGINNING, LOG_START_END)


class QuietWait:
    """How long a quiet reader sleeps on inotify before it looks anyway: QUIET_SECONDS,
    doubled after each wait that ran out and found nothing to read, up to QUIET_MAX_SECONDS.
    A wait that ran out and then found lines shows that the watch misses writes here (a
    network file system): from then on every quiet wait is QUIET_SECONDS, as before, so
    lines are at most that late once the first such miss was found."""

    def __init__(self) -> None:
        self.seconds = QUIET_SECONDS
        self.misses_writes = False

    def ran_out(self, found_lines: bool) -> bool:
        """After a quiet wait that ran out: whether this one showed the watch missing writes."""
        if found_lines and not self.misses_writes:
            self.misses_writes, self.seconds = True, QUIET_SECONDS
            return True
        if not self.misses_writes:
            self.seconds = min(self.seconds * 2, QUIET_MAX_SECONDS)
        return False


class LogPipeline:
    def __init__(self, daemon: str, log_directory: str, timezone: str = "local",
                 state_store: Optional[StateStore] = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, proc_root: Optional[str] = None,
                 log_start: str = LOG_START_BEGINNING, clock: Callable[[], float] = time.time) -> None:
        """proc_root: the /proc to ask whether queued clients still exist (None: never ask).
        log_start: with no state of this daemon to resume, read the files from their
        beginning (their history counted), or from their end (LOG_START_END: counters
        from 0, the clients already connected unknown to the logs). clock: the time a
        line's own is checked against (replay: its present clock)."""
        self.daemon = daemon
        self.log_directory = log_directory
        self._tz = resolve_timezone(timezone)  # ValueError for an unknown zone: a config error
        self._store = state_store
        self._followers: Dict[str, FileFollower] = {
            f: FileFollower(os.path.join(log_directory, f + ".log"), max_line_bytes) for f in FILES}
        self._clock = clock
        self._state = LogState(clock)
        self._liveness = ProcLiveness(proc_root) if proc_root else None
        self._next_liveness = 0.0  # time.monotonic() of the next look at /proc
        self._log_start = log_start
        self._placed = False  # where to start reading has been decided (the first round)
        self._caught_up = False  # the files have been read to their end once since the start
        self._snapshot = LogSnapshot(caught_up=False)
        self._write_lock = threading.Lock()  # read_once and the thread never interleave
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch: Optional[DirectoryWatch] = None  # wakes the thread when the files change
        self._published_at = 0.0  # time.monotonic() of the last publish
        self._restored = False
        self._last_save = 0.0
        self._dirty = False  # lines applied since the last publish
        self._unsaved = False  # ... since the last state file write
        self._read_lines = False  # lines read in the current round
        self._published_errors: Dict[str, Optional[ReadError]] = {f: None for f in FILES}
        self._internal_errors: Dict[str, int] = {f: 0 for f in FILES}  # lines whose handling raised
        self.errors = 0  # rounds that failed (logged); the thread keeps going

    # ------------------------------------------------------------ public
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._watch = DirectoryWatch(self.log_directory, [f + ".log" for f in FILES])
        self._thread = threading.Thread(target=self._run, name=f"mps-logs-{self.daemon}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and save. Bounded: a thread stuck in a read (a hung network
        file system) costs the last save, never the exit."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._watch is not None:
            self._watch.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._watch is not None and not self._thread.is_alive():  # a stuck thread keeps its descriptors
                self._watch.close()
            self._thread, self._watch = None, None
        if not self._write_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning("log pipeline %s: reader still busy after %.0f s; not saving state", self.daemon, timeout)
            return
        try:
            self._save(force=True)
            for f in self._followers.values():
                f.close()
        finally:
            self._write_lock.release()

    def snapshot(self) -> LogSnapshot:
        """The last published state: a copy nobody else writes. Cheap; no I/O."""
        return self._snapshot

    def unread_bytes(self) -> int:
        """Bytes of the files not read yet, now (a stat of each; any thread may ask)."""
        return sum(f.unread_bytes() for f in self._followers.values())

    def read_once(self) -> LogSnapshot:
        """Read both files to their end now (from their beginning, or from the saved
        offsets when there is a state file), publish and return the snapshot."""
        with self._write_lock:
            self._place()
            for file in FILES:
                while self._poll_file(file):
                    pass
            self._caught_up = True
            self._state.settle()
            self._forget_gone()
            self._publish()
            self._save(force=True)
        return self._snapshot

    # ---------------------------------------------------------- internal
    def _run(self) -> None:
        watch = self._watch
        idle_rounds = 0
        quiet_wait = QuietWait()
        ran_out = False  # the last pause was a quiet wait that ran out
        while not self._stop.is_set():
            busy = urgent = False
            self._read_lines = False
            try:
                with self._write_lock:
                    self._place()
                    for file in FILES:  # control.log first: see LogState.settle
                        more = self._poll_file(file)
                        busy = more or busy
                    if not busy and not self._caught_up:  # both files read to their end: say so at once
                        self._caught_up = self._dirty = urgent = True
                    if not more and self._state.settle():  # server.log, read last, is at its end
                        self._dirty = self._unsaved = True
                    if time.monotonic() >= self._next_liveness:
                        self._next_liveness = time.monotonic() + LIVENESS_SECONDS
                        self._forget_gone()
                    if self._dirty and (busy or urgent or time.monotonic() - self._published_at >= PUBLISH_SECONDS):
                        self._publish()
                    self._save(force=False)
            except Exception:  # a bug must cost freshness, not the exporter
                self.errors += 1
                if self.errors == 1:  # with its traceback once, not every 250 ms
                    log.exception("log pipeline %s: reading %s failed", self.daemon, self.log_directory)
            if ran_out and quiet_wait.ran_out(self._read_lines):
                log.info("log pipeline %s: lines in %s came without a write seen by inotify; while idle, "
                         "looking every %g s from now on", self.daemon, self.log_directory, QUIET_SECONDS)
            ran_out = False
            idle_rounds = 0 if self._read_lines else idle_rounds + 1
            if not busy:  # until the files change; with lines not yet published, no longer than that is due
                due = self._published_at + PUBLISH_SECONDS - time.monotonic() if self._dirty else POLL_SECONDS
                pause = min(POLL_SECONDS, max(0.0, due))
                try:
                    if watch is not None:
                        quiet = idle_rounds >= QUIET_ROUNDS and watch.watching and self._settled()
                        changed = watch.wait(quiet_wait.seconds if quiet else pause, writes=quiet)
                        ran_out = quiet and not changed
                        continue
                except Exception:  # a bug in the watch costs the wake-ups, never the reader
                    self.errors += 1
                    log.exception("log pipeline %s: watching %s failed; polling from now on",
                                  self.daemon, self.log_directory)
                    watch = None  # stop() closes it
                self._stop.wait(pause)

    def _settled(self) -> bool:
        """Everything read is published and saved (where saved at all), and nobody is queued."""
        return not self._dirty and (not self._unsaved or self._store is None) and not self._state.waiting()

    def _place(self) -> None:
        """The first round: resume from the state file, or else start where --mps.log-start says."""
        if self._placed:
            return
        self._placed = True
        fresh = self._state
        self._restore()
        if self._state is fresh and self._log_start == LOG_START_END:  # nothing resumed
            for follower in self._followers.values():
                position = end_position(follower.path)
                if position:
                    follower.resume(position)
            log.info("log pipeline %s: no saved state; reading %s from the end of its files (--mps.log-start end)",
                     self.daemon, self.log_directory)
        self._publish()  # the backlog, known before the first line is read

    def _forget_gone(self) -> None:
        if self._liveness is not None and self._state.forget_gone(self._liveness, time.time()):
            self._dirty = self._unsaved = True

    def _poll_file(self, file: str) -> bool:
        """Read and apply what is new in one file; True if more may wait (a full batch
        was read, or a poll stopped before the end of the file)."""
        follower, state, tz = self._followers[file], self._state, self._tz
        total = 0
        while not self._stop.is_set():
            text, truncated = follower.poll_text()  # the batch's lines, one text
            if follower.error != self._published_errors[file]:
                self._dirty = True  # the snapshot says whether a file cannot be read
                log.debug("log pipeline %s: %s: %s", self.daemon, file, follower.error)
            if not text:
                return follower.more
            for _ in range(truncated):
                state.count_truncated(file)
            # A backlog's batch is applied with the cyclic garbage collector paused: it makes a
            # tuple or more a line (the scan's rows, events) and no cycle, and the collector's
            # passes over them (a full one walks every object the process holds) come to
            # nothing; the passes due come after the batch.
            paused = len(text) >= PAUSE_GC_CHARACTERS and gc.isenabled()
            if paused:
                gc.disable()
            try:
                if file == "control":  # mostly command echoes: counted without the parser
                    lines = apply_control_text(state, text, lambda line: parse_line(line, "control", tz),
                                               lambda line: self._internal_error("control", line))
                else:  # in bulk: bulk.py
                    lines = apply_server_text(state, text, tz, lambda line: self._internal_error("server", line))
            finally:
                if paused:
                    gc.enable()
            total += lines
            self._dirty = self._unsaved = self._read_lines = True
            if total >= PUBLISH_LINES:
                self._publish()
                return True
        return False

    def _internal_error(self, file: str, line: str) -> None:
        self._internal_errors[file] += 1
        if self._internal_errors[file] == 1:  # the first one with its traceback, then the metric
            log.exception("log pipeline %s: handling a line of %s.log failed: %r", self.daemon, file, line[:200])

    def _publish(self) -> None:
        snap = self._state.snapshot()
        errors: Dict[Tuple[str, str], int] = {}
        for file, follower in self._followers.items():
            self._published_errors[file] = follower.error
            for reason, n in follower.errors.items():
                errors[(file, reason)] = n
            if self._internal_errors[file]:
                errors[(file, INTERNAL_ERROR)] = self._internal_errors[file]
        snap.read_errors = errors
        snap.caught_up = self._caught_up
        snap.backlog_bytes = self.unread_bytes()
        snap.rotation_gaps = {file: f.rotation_gaps for file, f in self._followers.items() if f.rotation_gaps}
        snap.state_file_errors = dict(self._store.errors) if self._store is not None else None
        snap.problems = tuple(sorted({e.message for e in self._published_errors.values() if e is not None}))
        self._snapshot = snap  # one reference assignment: atomic for readers
        self._dirty = False
        self._published_at = time.monotonic()

    # -------------------------------------------------------- state file
    def _restore(self) -> None:
        if self._restored:
            return
        self._restored = True
        if self._store is None:
            return
        entry = self._store.load(self.daemon)
        if entry is None:
            return
        try:  # the file is input like any other: whatever is in it, never fatal
            state = LogState.from_dict(entry["state"], self._clock)
            positions = {f: entry["files"][f] for f in FILES if isinstance(entry["files"].get(f), dict)}
            for file, pos in positions.items():
                self._followers[file].resume(pos)
        except NegativeCounter as e:
            self._start_from_logs(NEGATIVE_COUNTER, str(e))
            return
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._start_from_logs(SHAPE, f"unusable ({type(e).__name__}: {e})")
            return
        for file, follower in self._followers.items():
            doubt = follower.check_resume()
            if doubt is not None:  # its lines would be counted on top of the saved counters again
                self._start_from_logs(POSITION, f"{file}.log: {doubt}")
                return
        self._state = state
        self._publish()

    def _start_from_logs(self, reason: str, message: str) -> None:
        """Doubt about the saved entry: none of it is used, the logs are read from their start."""
        for follower in self._followers.values():
            follower.resume({})
        if self._store is not None:
            self._store.count_error(reason, f"daemon {self.daemon}: {message}; starting from the logs")
        self._dirty = True

    def _save(self, force: bool) -> None:
        if self._store is None or not self._restored:
            return
        now = time.monotonic()
        if not self._unsaved and self._last_save or not force and now - self._last_save < SAVE_SECONDS:
            return
        self._last_save, self._unsaved = now, False
        self._store.save(self.daemon, self.state_entry())

    def state_entry(self) -> Dict[str, Any]:
        """What the state file holds for this daemon: file positions and the state machine."""
        return {"files": {f: fl.position() for f, fl in self._followers.items()},
                "state": self._state.to_dict()}
