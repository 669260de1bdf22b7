"""The custom collector: run every enabled source once per scrape, time each,
join the results (render.py) into fresh families.

One broken source costs its own series and flips its
`mps_exporter_collector_success` to 0; the scrape still answers. Concurrent
scrapes share the collection in flight instead of stacking up behind slow
NVML calls (one took 350 ms under 30 busy clients in the capture).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, TypeVar

from prometheus_client.registry import Collector, CollectorRegistry

from .render import Outcome, Snapshot, render

log = logging.getLogger(__name__)
T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Callers arriving while a call is running wait for it and share its result."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._current: Optional["_Call[T]"] = None

    def __call__(self) -> T:
        with self._lock:
            call = self._current
            leader = call is None
            if leader:
                call = self._current = _Call()
        if leader:
            try:
                call.result = self._fn()
            except BaseException as e:  # handed to every waiter, then re-raised
                call.error = e
            finally:
                with self._lock:
                    self._current = None
                call.done.set()
        else:
            call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result


class _Call(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Optional[T] = None
        self.error: Optional[BaseException] = None


class MpsCollector(Collector):
    """Sources are optional: pass only those enabled.

    nvml: `.read() -> NvmlReading`; dcgm: `.read() -> {gpu index: activity}`;
    controls: `[ControlSource]` (`.read(devices) -> DaemonReading`); proc:
    `.read(pids) -> {pid: ProcessFacts}`; logs: `{daemon: LogPipeline}`.
    """

    def __init__(self, *, nvml=None, dcgm=None, controls: Sequence = (), proc=None,
                 logs: Optional[Dict[str, object]] = None, clock: Callable[[], float] = time.time) -> None:
        self.nvml, self.dcgm, self.controls, self.proc = nvml, dcgm, list(controls), proc
        self.logs = dict(logs or {})
        self.clock = clock
        self._failing: Dict[str, str] = {}
        self._collect_once = SingleFlight(self._collect)

    def describe(self) -> List:
        return []  # keeps registration from running a whole collection

    def collect(self):
        return self._collect_once()

    def snapshot(self) -> Snapshot:
        snap = Snapshot(now=self.clock())
        if self.nvml is not None:
            snap.nvml = self._timed(snap, "nvml", self.nvml.read)
        if self.dcgm is not None and snap.nvml is not None:
            activity = self._timed(snap, "dcgm", self.dcgm.read) or {}
            for gpu in snap.nvml.gpus:  # DCGM's profiling fields win over GPM
                gpu.activity.update(activity.get(gpu.index, {}))
        if self.controls:
            devices = [g.index for g in snap.nvml.gpus] if snap.nvml and snap.nvml.gpus else [0]
            snap.daemons = self._timed(snap, "control", lambda: self._read_daemons(devices)) or []
        if self.proc is not None:
            pids = {s.pid for d in snap.daemons for s in d.servers} | {c.pid for d in snap.daemons for c in d.clients}
            if snap.nvml:
                pids |= {p.pid for g in snap.nvml.gpus for p in g.mps_clients + g.compute_processes}
            snap.processes = self._timed(snap, "proc", lambda: self.proc.read(pids)) or {}
        if self.logs:
            snap.logs = self._timed(snap, "logs", self._read_logs) or {}
        return snap

    def _collect(self):
        return render(self.snapshot()).families()

    def _read_logs(self) -> Dict[str, Any]:
        logs = {name: p.snapshot() for name, p in self.logs.items()}
        problems = [f"{name}: {problem}" for name, s in logs.items() for problem in s.problems]
        if problems:  # a file that cannot be read: what was read still counts, the collector fails
            raise _PartialFailure("; ".join(problems), logs)
        return logs

    def _read_daemons(self, devices):
        readings = [c.read(devices) for c in self.controls]
        errors = [f"{r.name}: {r.error}" for r in readings if r.error]
        if errors:
            raise _PartialFailure("; ".join(errors), readings)
        return readings

    def _timed(self, snap: Snapshot, name: str, fn: Callable[[], T]) -> Optional[T]:
        start = time.perf_counter()
        result, ok = None, True
        try:
            result = fn()
        except _PartialFailure as e:
            result, ok = e.result, False
            self._note_failure(name, str(e))
        except Exception as e:  # a broken source must never break the scrape
            ok = False
            self._note_failure(name, f"{type(e).__name__}: {e}")
        else:
            if name in self._failing:
                log.info("collector %s recovered", name)
                del self._failing[name]
        snap.outcomes[name] = Outcome(ok, time.perf_counter() - start)
        return result

    def _note_failure(self, name: str, message: str) -> None:
        # Log a failure when it starts or changes, not on every scrape.
        if self._failing.get(name) != message:
            log.warning("collector %s failed: %s", name, message)
            self._failing[name] = message


class _PartialFailure(Exception):
    """A source failed in part: keep what it read, report the collector as failed."""

    def __init__(self, message: str, result) -> None:
        super().__init__(message)
        self.result = result


def build_registry(collector: MpsCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
