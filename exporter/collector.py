"""The custom collector: read every enabled source once per collection, each in
its own thread, and join the results (render.py) into fresh families.

- One broken source costs its own series and flips its
  `mps_exporter_collector_success` to 0; the scrape still answers.
- Sources are read concurrently (proc waits for the PIDs NVML and the daemons
  name); a collection ends at its deadline, from Prometheus' scrape timeout
  (scrape_timeout.py) or the configured ceiling. A source still reading then is
  late: its collector reports failure, and its last complete reading is served
  where there is one, with the time it was taken
  (`mps_exporter_collector_last_success_timestamp_seconds`).
- At most one read per source is outstanding: a read that overran its
  collection is joined by the next one, never started again beside it, so a
  hung NVML call cannot pile up threads.
- Concurrent scrapes share the collection in flight instead of stacking up
  behind slow NVML calls (one took 350 ms under 30 busy clients in the capture).
- Sources that declare `background` (NVML, DCGM) are read by a refresher thread
  every `refresh_interval` seconds (--collector.refresh-interval) instead: a scrape
  serves their latest reading while it is at most two intervals old (plus the time
  the read in flight has taken: a slow read in a storm is not waited for), and reads
  (or joins the read in flight) like any other source when it is older. The refresher
  reads no faster than scrapes come: where they come less often than the interval (a
  15 s scrape), it reads once per scrape, shortly before the scrape it expects from
  their spacing (`next_refresh`). With no scrape for `pause_after` seconds the
  refresher stops reading until the next one.
- Sources that declare `served_while_reading` (control: its commands are sent by
  scrapes only, never on a timer) are waited for at most `control_wait` seconds
  (--collector.control-wait): a read not done by then goes on for the next scrape,
  and this one serves the last reading with its time. Every wait of the collection
  (proc's for the PIDs included) sees the same choice. One not waited for at all (its
  last answer took longer than the wait) is started once the collection has its
  readings, not beside them.
- A reader's `quick` read (proc of known processes, the logs' published state) runs in
  the collecting thread itself; where it declines, the source's thread reads. Under a
  client storm every hand-off to another thread cost a scrape milliseconds.
"""

from __future__ import annotations

import copy
import logging
import math
import queue
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Generic, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar, cast

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .config import DEFAULT_PAUSE_AFTER, GZIP_LEVEL, Config
from .contract import READ_DURATION_BUCKETS
from .model import Histogram, Outcome, Snapshot
from .own_process import OwnProcess
from .catalog import METRICS
from .exits import ExitTracker
from .families import FamilyBuilder, SeriesRecorder, empty_family
from . import scrape_timeout
from .render import ClientTableMemo, readings_key, render, render_readings, render_self
from .sources.base import PartialFailure, ReadContext, Reader, Source
from .sources.registry import SOURCES, own_renders

log = logging.getLogger(__name__)
T = TypeVar("T")

class SingleFlight(Generic[T]):
    """Callers arriving while a call is running wait for it and share its result."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._current: Optional[Future[T]] = None

    def __call__(self) -> T:
        with self._lock:
            call = self._current
            leader = call is None
            if call is None:
                call = self._current = Future()
        if leader:
            try:
                call.set_result(self._fn())
            except BaseException as e:  # handed to every waiter, then re-raised
                call.set_exception(e)
            finally:
                with self._lock:
                    self._current = None
        return call.result()


def _wait_for(futures: Sequence["Future[Any]"], timeout: Optional[float]) -> object:
    return wait_futures(futures, timeout=timeout)


@dataclass(frozen=True)
class Timing:
    """Where the collector's time comes from: `monotonic`, the clock of its deadlines,
    waits and read durations; `wait(futures, timeout)`, how it waits for reads (returns
    when they are done or `timeout` seconds of that clock have passed). Tests give their
    own, so that whether a read ended within a wait is theirs to say, not the machine's
    load (tests/support/virtual_time.py)."""

    monotonic: Callable[[], float] = time.monotonic
    wait: Callable[[Sequence["Future[Any]"], Optional[float]], object] = _wait_for


REAL_TIME = Timing()


@dataclass
class _Result:
    reading: Any  # None when the read failed without a result
    ok: bool
    duration_seconds: float
    taken_at: float  # the clock of the collection that started the read
    error: str = ""


def gpu_identities(snap: Snapshot) -> List[Tuple[int, str]]:
    """(index, UUID) of the GPUs NVML answered for; [(0, "")] before it has."""
    return [(g.index, g.uuid) for g in snap.nvml.gpus] if snap.nvml and snap.nvml.gpus else [(0, "")]


class _Collection(ReadContext):
    """One collection: its clock, deadline and the reads it waits for."""

    def __init__(self, now: float, deadline: Optional[float], devices: Optional[List[Tuple[int, str]]],
                 timing: Timing = REAL_TIME) -> None:
        self.now = now
        self.timing = timing
        self.deadline = deadline  # timing.monotonic() value; None: wait for every source
        self.futures: Dict[str, Future[_Result]] = {}
        self.earlier: Dict[str, _Result] = {}  # each source's last finished read when this one was claimed
        # Source name -> timing.monotonic() after which its read is not waited for and its
        # `earlier` reading is served instead: the `served_while_reading` sources with one.
        self.waits: Dict[str, float] = {}
        self.served_earlier: Dict[str, _Result] = {}  # those not waited for, once decided
        self.overdue: Set[str] = set()  # of those, the ones whose read in flight is already late
        self._choice = threading.Lock()
        self._devices = devices

    def remaining(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - self.timing.monotonic())

    def devices(self) -> List[int]:
        return [index for index, _ in self._gpus()]

    def uuids(self) -> Dict[int, str]:
        return {index: uuid for index, uuid in self._gpus() if uuid}

    def _gpus(self) -> List[Tuple[int, str]]:
        if self._devices is None:  # NVML has not answered yet: wait for it once
            snap = self.wait(("nvml",))
            self._devices = gpu_identities(snap)
        return self._devices

    def wait(self, names: Sequence[str]) -> Snapshot:
        # At most half the time left: the waiting read still needs time of its own, and
        # one late source must not make the sources that wait for it late as well.
        remaining = self.remaining()
        until = None if remaining is None else self.timing.monotonic() + remaining / 2
        snap = Snapshot(now=self.now)
        for name in names:
            result = self.result(name, until)
            if result is not None and result.reading is not None:
                SOURCES[name].store(snap, result.reading)
        return snap

    def known(self, names: Sequence[str]) -> Snapshot:
        snap = Snapshot(now=self.now)
        for name in names:
            future = self.futures.get(name)
            result = future.result() if future is not None and future.done() else self.earlier.get(name)
            if result is not None and result.reading is not None:
                SOURCES[name].store(snap, result.reading)
        return snap

    def result(self, name: str, until: Optional[float]) -> Optional[_Result]:
        """The source's result, waiting until `until` (timing.monotonic(); None: no limit)
        or its own wait's end; None: late, or not read in this collection."""
        future = self.futures.get(name)
        if future is None:
            return None
        wait = self.waits.get(name)
        if wait is not None:
            until = wait if until is None else min(until, wait)
        self.timing.wait([future], None if until is None else max(0.0, until - self.timing.monotonic()))
        if wait is None:
            return future.result() if future.done() else None
        with self._choice:  # decided once: proc's PIDs and the served reading agree
            if name not in self.served_earlier and future.done():
                return future.result()
            if name in self.served_earlier or self.timing.monotonic() >= wait:
                return self.served_earlier.setdefault(name, self.earlier[name])
        return None


# Seconds after a control answer slower than --collector.control-wait during which scrapes
# do not wait for the daemon (they serve its last answer, its read going on for the next).
# In the storm's first seconds of run q1 (H200, 2026-11-27) answers took about the wait,
# and the scrapes that waited spent the whole 10 ms of it for nothing.
CONTROL_CALM_SECONDS = 10.0

# The refresher paces itself by the gaps between the last PACE_GAPS + 1 collections (the
# lower median: a scrape by hand between two of Prometheus' does not count, two Prometheus
# servers scraping at different offsets are both served), and starts a round at least
# LEAD_SECONDS before the scrape it expects (twice the last round's time where that is
# more, at most one refresh interval): its reading is then that much old when the scrape
# comes. On the synthetic 8 GPU x 48 node scraped every 15 s,
# 15 rounds a scrape cost the exporter 3x node_exporter's CPU, one round 0.3x (the 2-core
# VM, bench/cost_bench.py).
PACE_GAPS = 8
LEAD_SECONDS = 0.25
# Scrapes that come less often than this many refresh intervals pace the refresher; more
# often (a 1 s scrape at the 1 s default, whose gaps wander a few ms either side) the
# refresher keeps its interval, as in a client storm it always did.
PACE_FROM = 1.5


def next_refresh(started: float, last_collection: float, scrape_interval: Optional[float],
                 refresh_interval: float, lead: float) -> float:
    """When the refresher's next round starts (the collector's monotonic clock), the last
    one having started at `started`: `refresh_interval` later where scrapes come less than
    PACE_FROM intervals apart or their interval is not known yet (None); else `lead` seconds before the
    first scrape expected (`last_collection` plus whole scrape intervals) that a round
    starting at `started` was not already for, never sooner than `refresh_interval` later;
    and there, not before a collection has come since `started` (math.inf: not until
    then): a round nobody has been served is not followed by another."""
    floor = started + refresh_interval
    if scrape_interval is None or scrape_interval < PACE_FROM * refresh_interval:
        return floor
    if last_collection < started:
        return math.inf
    due = last_collection + scrape_interval
    if due - lead <= started:
        due += (math.floor((started - (due - lead)) / scrape_interval) + 1) * scrape_interval
    return max(floor, due - lead)


def scrape_interval(starts: Sequence[float], pause_after: float) -> Optional[float]:
    """The spacing of scrapes from the start times of the last collections: the lower
    median of the gaps between them that are no pause (over `pause_after`); None: too few."""
    gaps = sorted(b - a for a, b in zip(starts, starts[1:]) if 0 < b - a <= pause_after)
    return gaps[(len(gaps) - 1) // 2] if gaps else None


# Seconds a source's read thread waits for the next read before it ends: scraped every
# 1, 15 or 30 s it stays (a thread started for each read of a 15 s scrape was about a
# sixth of the exporter's CPU there, issue 44); paused, it ends.
READ_THREAD_IDLE_SECONDS = 60.0


class _SourceRun:
    """One source's reads: at most one outstanding; its last complete reading."""

    def __init__(self, name: str, source: Source[Any], reader: Reader[Any], timing: Timing = REAL_TIME) -> None:
        self.name, self.source, self.reader, self.timing = name, source, reader, timing
        self._lock = threading.Lock()
        self._inflight: Optional[Future[_Result]] = None
        self.inflight_since = 0.0  # timing.monotonic() when the read in flight began
        self.last: Optional[_Result] = None  # the last successful read
        self.latest: Optional[_Result] = None  # the last finished read, failed or not
        self.durations = Histogram(READ_DURATION_BUCKETS)  # every read, late ones included
        # The source's reads run one after the other in one thread of its own, started at
        # the first and ended after READ_THREAD_IDLE_SECONDS without one: a thread started
        # per read made each scrape wait until the new threads ran (Thread.start waits for
        # that), up to 8 ms each on cores that a client storm keeps busy (issue 29). None
        # in the queue ends the thread.
        self._jobs: "queue.SimpleQueue[Optional[Tuple[Future[_Result], _Collection]]]" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None

    def claim(self, collection: _Collection) -> Tuple[Future[_Result], Optional[Callable[[], None]]]:
        """This collection's read: the one still running for an earlier collection, or a
        new one (with the call that starts it, once every source of the collection is
        claimed)."""
        with self._lock:
            if self._inflight is not None and not self._inflight.done():
                return self._inflight, None
            future: Future[_Result] = Future()
            self._inflight = future
            self.inflight_since = self.timing.monotonic()
        return future, lambda: self._submit(future, collection)

    def _submit(self, future: Future[_Result], collection: _Collection) -> None:
        with self._lock:  # queued under the lock: a thread that ends finds the queue empty
            self._jobs.put((future, collection))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=f"mps-read-{self.name}", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=READ_THREAD_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._worker = None
                        return
                continue
            if job is None:
                with self._lock:
                    if self._jobs.empty():  # else a read was queued after the stop: go on
                        self._worker = None
                        return
                continue
            self._read(*job)
            # Not kept while waiting for the next: a source read mostly in the scrape's own
            # thread (quick) would keep an old collection, and all its readings, for seconds.
            del job

    def stop(self) -> None:
        """End the read thread once its read in flight, if any, has ended."""
        with self._lock:
            if self._worker is not None:
                self._jobs.put(None)

    def read_here(self, future: Future[_Result], collection: _Collection) -> bool:
        """This claimed read done in the calling thread by the reader's quick read, where
        it answers; False: it declined, and nothing was done."""
        return self._read(future, collection, quick=True)

    def _read(self, future: Future[_Result], collection: _Collection, quick: bool = False) -> bool:
        start = self.timing.monotonic()
        try:
            if quick:
                reading = self.reader.quick(collection) if self.reader.quick is not None else None
                if reading is None:
                    return False
            else:
                reading = self.reader.read(collection)
            result = _Result(reading, True, 0.0, collection.now)
        except PartialFailure as e:
            result = _Result(e.result, False, 0.0, collection.now, str(e))
        except Exception as e:  # a broken source must never break the scrape
            result = _Result(None, False, 0.0, collection.now, f"{type(e).__name__}: {e}")
        result.duration_seconds = self.timing.monotonic() - start
        with self._lock:
            self.durations.observe(result.duration_seconds)
        if result.ok:
            self.last = result
        self.latest = result
        future.set_result(result)
        return True

    def fresh(self, now: float, max_age: float, read_for: float) -> Optional["Future[_Result]"]:
        """The latest reading as a finished read, where it was taken at most `max_age`
        seconds before `now`, plus the time the read in flight has taken while that is
        under `read_for` seconds: its predecessor is served while a slow read (NVML in a
        client storm: up to 1.5 s) goes on, not waited for. None: older, or none yet."""
        latest = self.latest
        if latest is None:
            return None
        allowed = max_age
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            running = self.timing.monotonic() - self.inflight_since
            if running < read_for:
                allowed += running
        if now - latest.taken_at > allowed:
            return None
        done: Future[_Result] = Future()
        done.set_result(latest)
        return done


class MpsCollector(Collector):
    """`readers`: the enabled sources' readers by source name (service.build_readers).

    `max_seconds`: the longest a collection waits for its sources (None: no
    limit); a scrape's own timeout, less `timeout_offset`, shortens it.
    `serve_last`: a late source's last complete reading is served (marked).
    `refresh_interval`: seconds between two background reads of the `background`
    sources once `start` is called (0: they are read in every scrape);
    `pause_after`: seconds without a collection after which those reads pause.
    `control_wait`: seconds a collection waits for a `served_while_reading` source
    before it serves that source's last finished reading (0: it waits as for any), where
    that reading is at most two refresh intervals old (`_may_stand_in`); a read already
    running longer than the collection's budget is late as before.
    `exits`: the exit tracker, fed each collection's snapshot (its report goes in
    `Snapshot.edges`)."""

    def __init__(self, readers: Mapping[str, Reader[Any]], clock: Callable[[], float] = time.time,
                 max_seconds: Optional[float] = None, timeout_offset: float = Config.scrape_timeout_offset,
                 serve_last: bool = True, granularity: str = "client", refresh_interval: float = 0.0,
                 pause_after: float = DEFAULT_PAUSE_AFTER, control_wait: float = 0.0,
                 timing: Timing = REAL_TIME, exits: Optional[ExitTracker] = None) -> None:
        self.clock = clock
        # Clients' last readings across collections: exits at the memory edge, peaks (exits.py).
        self.exits = exits or ExitTracker()
        self.timing = timing
        self.granularity = granularity  # --mps.client-granularity
        self.max_seconds = max_seconds
        self.timeout_offset = timeout_offset
        self.serve_last = serve_last
        self.refresh_interval = refresh_interval
        self.pause_after = pause_after
        self.control_wait = control_wait
        self._runs = {name: _SourceRun(name, SOURCES[name], reader, timing) for name, reader in readers.items()}
        self._devices: Optional[List[Tuple[int, str]]] = None
        self._failing: Dict[str, str] = {}
        self._failing_lock = threading.Lock()
        self._unwaited_until: Dict[str, float] = {}  # source -> timing.monotonic() until which it is not waited for
        self._collect_once = SingleFlight(self._collect)
        self._refreshed = [run for run in self._runs.values() if run.source.background] if refresh_interval > 0 else []
        self._last_collection = self.timing.monotonic()
        self._collection_starts: Deque[float] = deque(maxlen=PACE_GAPS + 1)  # timing.monotonic()
        self._wake = threading.Event()  # a collection after a pause, or close()
        self._stopped = threading.Event()
        self._refresher: Optional[threading.Thread] = None
        self.refreshes = 0  # background rounds so far (tests, benchmarks)

    # ------------------------------------------------------------ background reads
    def start(self) -> None:
        """Start the refresher (serve); without it every source is read at scrape time."""
        if self._refreshed and self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="mps-refresh", daemon=True)
            self._refresher.start()

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)
        for run in self._runs.values():
            run.stop()

    def _refresh_loop(self) -> None:
        while not self._stopped.is_set():
            idle = self.timing.monotonic() - self._last_collection
            if idle > self.pause_after:  # nobody reads: nothing to read for
                self._wake.clear()
                if self.timing.monotonic() - self._last_collection > self.pause_after:
                    self._wake.wait()
                continue
            started = self.timing.monotonic()
            self.refresh()
            lead = min(self.refresh_interval, max(LEAD_SECONDS, 2 * (self.timing.monotonic() - started)))
            while not self._stopped.is_set():
                self._wake.clear()
                interval = self.scrape_interval()
                due = next_refresh(started, self._last_collection, interval, self.refresh_interval, lead)
                left = due - self.timing.monotonic()
                if left <= 0:
                    break
                if due == started + self.refresh_interval:  # its own cadence: no scrape moves it
                    self._stopped.wait(left)
                    break
                self._wake.wait(None if left == math.inf else left)  # a scrape moves it: woken, look again

    def scrape_interval(self) -> Optional[float]:
        """Seconds between scrapes as their spacing shows (None: not known yet)."""
        return scrape_interval(list(self._collection_starts), self.pause_after)

    def pace(self) -> float:
        """Seconds between the background rounds now: the refresh interval, or the scrape
        interval where scrapes come at least PACE_FROM intervals apart."""
        interval = self.scrape_interval()
        return self.refresh_interval if interval is None or interval < PACE_FROM * self.refresh_interval else interval

    def refresh(self) -> None:
        """One background round: read the background sources, each claimed as a
        collection claims it (at most one read in flight), waiting at most as long as
        a scrape would (max_seconds) for them."""
        deadline = None if self.max_seconds is None else self.timing.monotonic() + self.max_seconds
        collection = _Collection(self.clock(), deadline, self._devices, self.timing)
        starts = []
        for run in self._refreshed:
            collection.futures[run.name], start = run.claim(collection)
            starts.append(start)
        for start in starts:
            if start is not None:
                start()
        self.timing.wait(list(collection.futures.values()), collection.remaining())
        self.refreshes += 1

    def describe(self) -> Iterable[Metric]:
        """Every declared family, empty (no collection runs): client_python's registry
        checks names for duplicates with these, and its restricted registry (`name[]`)
        finds the collector by them."""
        return [empty_family(spec) for spec in METRICS.values()]

    def collect(self) -> Iterable[Metric]:
        return render(self.collection(), self.granularity, own_renders()).families()

    def collection(self) -> Snapshot:
        """This scrape's snapshot: the collection in flight, or a new one."""
        return self._collect_once()

    def _collect(self) -> Snapshot:
        return self.snapshot(self.budget(scrape_timeout.current()))

    def budget(self, scrape_timeout: Optional[float]) -> Optional[float]:
        """Seconds a collection may take: the scrape's timeout less the offset (half the
        timeout where that leaves too little), never above max_seconds."""
        if scrape_timeout is None:
            return self.max_seconds
        own = scrape_timeout - self.timeout_offset
        own = own if own >= scrape_timeout / 2 else scrape_timeout / 2
        return own if self.max_seconds is None else min(own, self.max_seconds)

    def snapshot(self, budget: Optional[float] = None) -> Snapshot:
        """One collection; `budget`: seconds to wait for the sources (None: all of them)."""
        started = self.timing.monotonic()
        self._note_collection()
        collection = _Collection(self.clock(), None if budget is None else self.timing.monotonic() + budget,
                                 self._devices, self.timing)
        starts: List[Tuple[_SourceRun, Callable[[], None]]] = []  # the new reads, each with its start
        unwaited: Set[str] = set()  # of those, the ones served their last reading at once
        for name, run in self._runs.items():  # all claimed first: a read may wait for another
            refreshed = self._refresher is not None and run in self._refreshed
            latest = run.fresh(collection.now, 2 * self.refresh_interval,
                               math.inf if budget is None else budget) if refreshed else None
            if latest is not None:
                collection.futures[name] = latest
                continue
            collection.futures[name], start = run.claim(collection)
            if start is not None:
                starts.append((run, start))
            earlier = run.latest
            if earlier is not None:
                collection.earlier[name] = earlier
            if self.control_wait > 0 and run.source.served_while_reading and earlier is not None:
                if budget is not None and self.timing.monotonic() - run.inflight_since >= budget:
                    # The read this collection joined has run longer than it may wait: late
                    # now, not after another whole budget (a daemon that a storm keeps busy
                    # for seconds, or a hung one); failed, its last reading served.
                    collection.waits[name] = self.timing.monotonic()
                    collection.overdue.add(name)
                elif self._may_stand_in(earlier, collection.now) or self._in_vain(name, earlier, collection.now):
                    # A daemon whose last answer took longer than the wait (MPS admitting a
                    # storm of clients) is not waited for at all: it would only cost the wait.
                    # Nor for CONTROL_CALM_SECONDS after such an answer: in a storm answers hover
                    # about the wait (a read started after a scrape is fast, the next, beside
                    # one, slow), and every other scrape waited the whole wait in vain. Its last
                    # answer stands in then however old: after a 10 s answer the next read, just
                    # started, was waited for to the end of the budget (4 x H200, issue 45).
                    if earlier.duration_seconds > self.control_wait:
                        self._unwaited_until[name] = self.timing.monotonic() + CONTROL_CALM_SECONDS
                    calm = self.timing.monotonic() >= self._unwaited_until.get(name, 0.0)
                    wait = self.control_wait if calm else 0.0
                    collection.waits[name] = self.timing.monotonic() + wait
                    if wait == 0.0:
                        unwaited.add(name)
        # The reads in threads of their own first, so that the quick reads in this thread
        # overlap them; a read not waited for starts once this collection has its readings
        # (below): its answer is for the next scrape, and its start (a process, for control)
        # would only compete with this one for the cores and the GIL.
        for run, start in starts:
            if run.reader.quick is None and run.name not in unwaited:
                start()
        for run, start in starts:
            if run.reader.quick is not None and not run.read_here(collection.futures[run.name], collection):
                start()
        try:
            snap = self._gather(collection, budget, started)
        finally:
            for run, start in starts:
                if run.name in unwaited:
                    start()
        try:
            snap.edges = self.exits.observe(snap)
        except Exception:  # the exits' state, never the scrape
            log.exception("joining the readings or tracking client exits failed")
        return snap

    def _gather(self, collection: _Collection, budget: Optional[float], started: float) -> Snapshot:
        """The collection's snapshot: each source's result, or its last reading where late."""
        snap = Snapshot(now=collection.now)
        for name, run in self._runs.items():
            result = collection.result(name, collection.deadline)
            if result is None or name in collection.overdue:  # late
                error = f"no answer within {budget:g} s" if budget is not None else "no answer"
                self._note_failure(name, error)
                served = run.last if self.serve_last else None
                waited = self.timing.monotonic() - started
                snap.outcomes[name] = Outcome(False, waited, run.last.taken_at if run.last else None, error)
            else:
                if result.ok:
                    self._note_recovery(name)
                else:
                    self._note_failure(name, result.error)
                served = result if result.reading is not None else None
                last = result.taken_at if result.ok else (run.last.taken_at if run.last else None)
                snap.outcomes[name] = Outcome(result.ok, result.duration_seconds, last, result.error or None)
            if self._refresher is not None and run in self._refreshed:
                snap.outcomes[name].refresh_interval_seconds = self.pace()
            if served is not None:
                run.source.store(snap, served.reading)
            with run._lock:
                snap.read_durations[name] = run.durations.copy()
        if snap.nvml is not None and snap.nvml.gpus:
            self._devices = gpu_identities(snap)
        return snap

    def _may_stand_in(self, earlier: _Result, now: float) -> bool:
        """Whether a `served_while_reading` source's last reading may be served in place of
        this collection's: while it is no older than a background reading may be (two
        refresh intervals). Scraped every second through a client storm it is; scraped
        every 15 s it is not, and the scrape waits for its own read (within its budget)."""
        return self.refresh_interval <= 0 or now - earlier.taken_at <= 2 * self.refresh_interval

    def _in_vain(self, name: str, earlier: _Result, now: float) -> bool:
        """Whether waiting for a `served_while_reading` source would be in vain: its last
        answer, slower than the wait, ended less than CONTROL_CALM_SECONDS ago (or the
        calm window of an earlier one is still open)."""
        ended = earlier.taken_at + earlier.duration_seconds
        return ((earlier.duration_seconds > self.control_wait and now < ended + CONTROL_CALM_SECONDS)
                or self.timing.monotonic() < self._unwaited_until.get(name, 0.0))

    def _note_collection(self) -> None:
        self._last_collection = self.timing.monotonic()
        self._collection_starts.append(self._last_collection)
        self._wake.set()  # after the time: a refresher about to pause sees it, or is woken

    # Logged as collections see them (not as reads end: a late read that ends well
    # after its scrape is no recovery), when a failure starts or changes.
    def _note_failure(self, name: str, message: str) -> None:
        with self._failing_lock:
            if self._failing.get(name) != message:
                log.warning("collector %s failed: %s", name, message)
                self._failing[name] = message

    def _note_recovery(self, name: str) -> None:
        with self._failing_lock:
            if self._failing.pop(name, None) is not None:
                log.info("collector %s recovered", name)


class _Families:
    def __init__(self, families: List[Metric]) -> None:
        self.families = families

    def collect(self) -> List[Metric]:
        return self.families


_SeriesKey = Tuple[str, Tuple[Tuple[str, str], ...]]


def _series_key(sample: Sample) -> Optional[_SeriesKey]:
    """A sample's series: its name and labels (None: a sample with a timestamp, exemplar
    or native histogram, whose line is not reused)."""
    for extra in sample[3:]:
        if extra is not None:
            return None
    return sample.name, tuple(sample.labels.items())


_go_string: Callable[[float], str] = floatToGoString  # client_python's spelling of a value


def _value_text(value: float) -> bytes:
    """The end of a sample's line as client_python writes it: its value, newline."""
    return (_go_string(value) + "\n").encode()


@dataclass(frozen=True)
class _FamilyText:
    """One family as last encoded in one format: the family, its encoding (no EOF), and
    where client_python wrote it as header lines then one line per sample in order, each
    ending with the sample's value, the header and each series' line before its value
    (`prefixes` None: reused only whole)."""

    family: Metric
    text: bytes
    header: bytes = b""
    prefixes: Optional[Dict[_SeriesKey, bytes]] = None


def _prefixes(text: bytes, header: bytes, keys: Sequence[_SeriesKey],
              samples: Sequence[Sample]) -> Optional[Dict[_SeriesKey, bytes]]:
    """Each sample's line in `text` (EOF removed) up to its value; None where the encoding
    is not `header` then one line per sample, in order, ending with its value (the classic
    text format writes `_created` samples as families of their own)."""
    if not text.startswith(header) or not text.endswith(b"\n"):
        return None
    lines = text[len(header):-1].split(b"\n")
    if len(lines) != len(samples):
        return None
    out: Dict[_SeriesKey, bytes] = {}
    for key, sample, line in zip(keys, samples, lines):
        end = _value_text(sample.value)[:-1]
        if line.startswith(b"#") or not line.endswith(end):
            return None
        out[key] = line[:-len(end)]
    return out


# Values that a sample line written as prefix + floatToGoString(value) must show as client_python
# does: each format is checked with these before its lines are reused for other values.
_PROBE_VALUES = (0.0, -0.0, 1, 1.0, True, 0.5, -2.5, 1e-9, 123456.0, 1234567.0, 2.5e21, 2**53 + 1,
                 float("inf"), float("-inf"), float("nan"))


class _FamilyEncoder:
    """Families encoded in one format by client_python's encoder, reusing the last
    encoding of each: whole where the family is equal, else line by line: a series seen in
    the last encoding gets its line up to the value from there and its value as client_python
    spells it (utils.floatToGoString), and only new series go through the encoder. Keeps the
    families and series of its last call alone (no growth)."""

    def __init__(self, encoder: Callable[[Any], bytes]) -> None:
        self.encoder = encoder
        self.trailer = encoder(_Families([]))  # OpenMetrics' `# EOF`, or nothing
        self._last: Dict[str, _FamilyText] = {}
        self._lock = threading.Lock()
        probe = Metric("mps_exporter_probe", "Probe.", "gauge")
        for i, value in enumerate(_PROBE_VALUES):
            probe.add_sample("mps_exporter_probe", {"i": str(i)}, value)
        keys = [(s.name, tuple(s.labels.items())) for s in probe.samples]
        # False: this format's lines are not prefix + value (reused only whole)
        self.by_line = _prefixes(self._text([probe]), self._header(probe), keys, probe.samples) is not None

    def _text(self, families: List[Metric]) -> bytes:
        text = self.encoder(_Families(families))
        return text[:-len(self.trailer)] if self.trailer and text.endswith(self.trailer) else text

    def _header(self, family: Metric) -> bytes:
        bare = copy.copy(family)
        bare.samples = []
        return self._text([bare])

    def encode(self, families: List[Metric]) -> bytes:
        """The families' encoding, without the trailer."""
        return b"".join(self.encode_each(families))

    def encode_each(self, families: List[Metric]) -> List[bytes]:
        """Each family's encoding, in order: the very bytes of the last call where the
        family is equal."""
        with self._lock:
            before = self._last
        now: Dict[str, _FamilyText] = {}
        texts = []
        for family in families:
            kept = before.get(family.name)
            if kept is None or kept.family != family:
                kept = self._encode(family, kept) if self.by_line else _FamilyText(family, self._text([family]))
            now[family.name] = kept
            texts.append(kept.text)
        with self._lock:
            self._last = now
        return texts

    def _encode(self, family: Metric, kept: Optional[_FamilyText]) -> _FamilyText:
        samples = family.samples
        keys: List[_SeriesKey] = []
        for sample in samples:
            key = _series_key(sample)
            if key is None:
                return _FamilyText(family, self._text([family]))
            keys.append(key)
        if kept is None or kept.prefixes is None or not _same_header(kept.family, family):
            text = self._text([family])
            header = self._header(family)
            return _FamilyText(family, text, header, _prefixes(text, header, keys, samples))
        known = kept.prefixes
        missing = [i for i, key in enumerate(keys) if key not in known]
        if missing:
            part = copy.copy(family)
            part.samples = [samples[i] for i in missing]
            found = _prefixes(self._text([part]), kept.header, [keys[i] for i in missing], part.samples)
            if found is None:
                return _FamilyText(family, self._text([family]))
            known = {**known, **found}
        parts = [kept.header]
        for key, sample in zip(keys, samples):
            parts.append(known[key])
            parts.append(_value_text(sample.value))
        if missing or len(known) > len(keys):  # only this family's series: no growth
            known = {key: known[key] for key in keys}
        return _FamilyText(family, b"".join(parts), kept.header, known)


def _same_header(a: Metric, b: Metric) -> bool:
    return a.name == b.name and a.type == b.type and a.documentation == b.documentation and a.unit == b.unit


@dataclass(frozen=True)
class _SeriesText:
    """Series of one shape (SeriesRecorder.shape) as client_python encoded them, around
    their values: `parts[i]` is the text before value i (its family's header lines where
    it is the family's first series, then its line up to the value); None: this format
    does not write one line per sample ending with its value (encoded whole each time)."""

    shape: object
    parts: Optional[Tuple[str, ...]]

    def fill(self, values: Sequence[float]) -> bytes:
        assert self.parts is not None
        return "".join([part + _go_string(value) + "\n" for part, value in zip(self.parts, values)]).encode()


class _OwnSeries:
    """The exporter's own series in one format. Each scrape renders them into a
    SeriesRecorder and writes its values into the text of the last scrape with the same
    series; samples, families and client_python's encoder only where the series changed
    (a source's first read, a command first sent). Each text is checked when made: written
    with the values it was made from, it equals client_python's encoding byte for byte,
    or it is not used. `process`: the exporter's process_* too, through the same encoder."""

    def __init__(self, encoder: _FamilyEncoder, process: Optional[OwnProcess] = None) -> None:
        self.encoder = encoder
        self._kept: Optional[_SeriesText] = None
        self.process = None if process is None else _ProcessText(encoder, process)

    def encode(self, snap: Snapshot) -> bytes:
        recorded = SeriesRecorder()
        render_self(recorded, snap)
        shape, values = recorded.shape(), recorded.values()
        kept = self._kept
        if kept is None or kept.shape != shape:
            kept = self._kept = self._made(snap, shape, values)
        if kept.parts is None:
            return self._encoded(snap)[0]
        return kept.fill(values)

    def _encoded(self, snap: Snapshot) -> Tuple[bytes, List[Metric]]:
        out = FamilyBuilder()
        render_self(out, snap)
        families = out.families()
        return b"".join(self.encoder._text([family]) for family in families), families

    def _made(self, snap: Snapshot, shape: object, values: Sequence[float]) -> _SeriesText:
        text, families = self._encoded(snap)
        made = _series_text(self.encoder, families, shape)
        return made if made.parts is not None and len(made.parts) == len(values) and made.fill(values) == text \
            else _SeriesText(shape, None)


def _series_text(encoder: _FamilyEncoder, families: List[Metric], shape: object) -> _SeriesText:
    """The text client_python encodes `families` to, around their values (parts None where
    this format or a sample does not allow that)."""
    if not encoder.by_line:
        return _SeriesText(shape, None)
    parts: List[str] = []
    for family in families:
        keys = [_series_key(sample) for sample in family.samples]
        if None in keys:
            return _SeriesText(shape, None)
        series = cast(List[_SeriesKey], keys)
        header = encoder._header(family)
        found = _prefixes(encoder._text([family]), header, series, family.samples)
        if found is None:
            return _SeriesText(shape, None)
        parts += [((header if i == 0 else b"") + found[key]).decode() for i, key in enumerate(series)]
    return _SeriesText(shape, tuple(parts))


class _ProcessText:
    """The exporter's process_* series in one format: client_python's encoding of
    ProcessCollector's families, made once for the series OwnProcess reads, and each
    scrape OwnProcess's values written into it. The text is checked when made: written
    with the families' own values, it equals their encoding byte for byte, or the
    families are encoded each scrape."""

    def __init__(self, encoder: _FamilyEncoder, process: OwnProcess) -> None:
        self.encoder = encoder
        self.process = process
        self._kept: Optional[_SeriesText] = None

    def encode(self) -> bytes:
        names, values = self.process.figures()
        kept = self._kept
        if kept is None or kept.shape != names:
            kept = self._kept = self._made(names)
        if kept.parts is None:
            return self.encoder.encode(self.process.collect())
        return kept.fill(values)

    def _made(self, names: Tuple[str, ...]) -> _SeriesText:
        families = self.process.collect()
        samples = [sample for family in families for sample in family.samples]
        if tuple(sample.name for sample in samples) != names:  # not the series OwnProcess reads
            return _SeriesText(names, None)
        made = _series_text(self.encoder, families, names)
        text = b"".join(self.encoder._text([family]) for family in families)
        return made if made.parts is not None and made.fill([s.value for s in samples]) == text \
            else _SeriesText(names, None)


# The gzip member header (RFC 1952) before the parts: deflate, no name, no time, Unix.
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"


class _DeflatedParts:
    """Each family's text deflated on its own, kept while the text is the very same
    bytes: a scrape whose GPUs' readings moved compresses those families, not the 400 KB
    of 384 clients' that stayed. A part starts with no history and ends on a byte
    boundary (Z_SYNC_FLUSH), so parts concatenate into one valid deflate stream (RFC 1951:
    no back reference crosses them)."""

    def __init__(self) -> None:
        self._last: Dict[int, Tuple[bytes, bytes]] = {}  # position -> (text, deflated)

    def deflate(self, texts: List[bytes]) -> bytes:
        now: Dict[int, Tuple[bytes, bytes]] = {}
        for i, text in enumerate(texts):
            kept = self._last.get(i)
            if kept is None or kept[0] is not text:
                compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15)  # -15: raw deflate
                kept = (text, compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH))
            now[i] = kept
        self._last = now
        return b"".join(deflated for _, deflated in now.values())


@dataclass
class _Encoded:
    """The readings' part of the exposition in one format: the bytes; with gzip, the
    gzip header and the deflated parts, the CRC-32 and length of the text, so that a
    scrape appends its own series and the body stays one gzip stream."""

    key: Tuple[object, ...]
    body: bytes
    crc: int = 0
    size: int = 0



class Exposition(CollectorRegistry):
    """The collector and the other collectors (process_*), encoded. The readings' part
    (everything but the exporter's own series) is encoded once per format and compression
    while the readings stay the same (render.readings_key), and reused: between the
    background refreshes, and by a second Prometheus, scrapes cost the exporter's own
    series and a copy, not an encoding. Where the readings changed, each family equal to
    its last encoding is reused, and in the others each sample's line (_FamilyEncoder).
    The own series' values are written into the text of the last scrape with the same
    series (_OwnSeries), process_*'s into client_python's text of theirs (_ProcessText).
    `collect` gives every family, as a registry does."""

    def __init__(self, collector: MpsCollector, process: bool = True) -> None:
        super().__init__(auto_describe=False)
        self.collector = collector
        self.register(collector)
        self._process: Optional[OwnProcess] = None
        if process:
            self._process = OwnProcess()
            self.register(self._process)
        self._encoded: Dict[Tuple[str, bool], _Encoded] = {}
        # content type -> the readings' families: where readings changed, most families did
        # not (a storm moves memory and activity, not who the clients are), and in a family
        # that did, most series are the same with new values.
        self._readings: Dict[str, _FamilyEncoder] = {}
        # content type -> the own series (their values move in every scrape, the series hardly
        # ever), and process_* alike
        self._own: Dict[str, _OwnSeries] = {}
        self._deflated: Dict[str, _DeflatedParts] = {}  # content type -> its readings' parts
        self._client_tables = ClientTableMemo()
        self._lock = threading.Lock()

    def _per_format(self, kept: Dict[str, T], content_type: str, make: Callable[[], T]) -> T:
        """This format's entry of `kept`, made at its first scrape."""
        with self._lock:
            found = kept.get(content_type)
            if found is None:
                found = kept[content_type] = make()
        return found

    def encode(self, encoder: Callable[[Any], bytes], content_type: str, gzip: bool) -> bytes:
        """One scrape's body, from `choose_encoder`'s encoder and content type."""
        snap = self.collector.collection()
        key = readings_key(snap, self.collector.granularity)
        with self._lock:
            part = self._encoded.get((content_type, gzip))
        if part is None or part.key != key:
            out = FamilyBuilder()
            render_readings(out, snap, self.collector.granularity, own_renders(), self._client_tables)
            texts = self._per_format(self._readings, content_type, lambda: _FamilyEncoder(encoder)).encode_each(
                out.families())
            if gzip:
                parts = self._per_format(self._deflated, content_type, _DeflatedParts)
                crc = 0
                for text in texts:
                    crc = zlib.crc32(text, crc)
                part = _Encoded(key, _GZIP_HEADER + parts.deflate(texts), crc, sum(map(len, texts)))
            else:
                part = _Encoded(key, b"".join(texts))
            with self._lock:
                self._encoded[(content_type, gzip)] = part
        own = self._per_format(self._own, content_type, lambda: _OwnSeries(_FamilyEncoder(encoder), self._process))
        rest = own.encode(snap) + (own.process.encode() if own.process is not None else b"") + own.encoder.trailer
        if not gzip:
            return part.body + rest
        compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15)
        size = (part.size + len(rest)) & 0xFFFFFFFF  # the trailer: CRC-32, then length modulo 2^32
        return part.body + compressor.compress(rest) + compressor.flush() + \
            zlib.crc32(rest, part.crc).to_bytes(4, "little") + size.to_bytes(4, "little")


def build_registry(collector: MpsCollector, process: bool = True) -> Exposition:
    """The collector, and with `process` client_python's process_* metrics of the exporter
    itself (CPU, memory, open files; Linux only). A one-shot dump leaves those out:
    its own start-up is not the exporter's."""
    return Exposition(collector, process)
