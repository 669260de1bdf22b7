"""Xid source: the GPUs' Xid errors, from NVML's event API, per GPU and code.

A thread of its own (`XidWatcher`) creates an NVML event set, registers every GPU for
`nvmlEventTypeXidCriticalError` and waits on the set (`nvmlEventSetWait_v2`); each event
counts under (GPU, Xid code) with the time it was seen. An event ends a wait at once, so
the wait's timeout only says how often the thread looks at `close`: long, since each
wake-up costs CPU (issue 44), and `close` does not wait for it. A scrape only copies
those counters: it never asks NVML anything, and an Xid between two scrapes is counted,
not sampled away.

A module of its own, not a part of the NVML source: that source reads every GPU
once per refresh in a pool of threads and re-initialises NVML when it stops
answering, while this one holds one event set for as long as the exporter runs.
NVML's initialisation is reference-counted (nvmlInit / nvmlShutdown, in pynvml too),
so each holds its own; sharing it would tie a blocking wait to a refresher it must
not delay, and give the collector flag (`--no-collector.xid`) nothing to turn off.

A GPU whose registration fails (NOT_SUPPORTED: a GPU or driver without Xid events;
NO_PERMISSION) says so: `mps_gpu_xid_events_registered` 0, not silence. Counters start
at 0 when the exporter starts (Prometheus' increase() sees a reset): Xids from before
are in the kernel log (`dmesg | grep -i xid`), not in NVML's events.

Serve starts the thread (`Reader.start`); dump and status register and take in what
has arrived so far without blocking (`Reader.catch_up`). A reader neither started nor
caught up (tests that build every reader) reads as no GPU at all.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import Config
from ..contract import DEVICE, GPU, OTHER, UUID, Label, counter, gauge, table
from ..families import FamilyBuilder
from ..model import Snapshot
from .base import Backends, ReadContext, Reader, Source
from .nvml import import_pynvml

log = logging.getLogger(__name__)

# How long one nvmlEventSetWait_v2 waits when no event comes: how late the thread hears
# `close` (NVIDIA's device plugin waits 5000 ms). At 1000 ms the wake-ups were a fifth
# of the exporter's CPU at 15 s scrapes on the synthetic 8 x 48 node (issue 44).
WAIT_MS = 10_000
# How long `close` waits for the thread to end; past it the thread frees the set and
# shuts NVML down itself when its wait ends (or the process exits first).
CLOSE_WAIT_SECONDS = 1.0
# After NVML could not be initialised, or a wait failed otherwise than by its timeout:
# seconds before the next try (no busy loop on a driver that went away).
RETRY_SECONDS = 30.0
# Distinct Xid codes counted per GPU; past it an Xid counts under xid="other". NVIDIA's
# catalogue has about 150 codes; a GPU shows a handful in its life.
MAX_XID_CODES = 32
# Events taken in by one catch_up (dump, status): a flood must not hold the command.
CATCH_UP_MAX_EVENTS = 10000
# pynvml.nvmlEventTypeXidCriticalError, where a pynvml lacks the name.
XID_EVENT_TYPE = 0x8

XID = Label("xid", DEVICE, "NVML Xid event (its eventData): NVIDIA's Xid code",
            f"at most {MAX_XID_CODES} codes per GPU, the rest counted under `{OTHER}`")

XID_METRICS = table(
    "Xid errors",
    counter("mps_gpu_xid_errors_total", "Xid errors NVML reported for the GPU since the exporter started, by Xid "
            "code (NVML's event API, nvmlEventTypeXidCriticalError).", GPU, UUID, XID),
    gauge("mps_gpu_xid_last_seen_timestamp_seconds", "Unix time the exporter last received this Xid code for the "
          "GPU.", GPU, UUID, XID),
    gauge("mps_gpu_xid_events_registered", "1 where the exporter receives the GPU's Xid events; 0 where NVML "
          "refused to register them (not supported, no permission): its Xid errors are not counted.", GPU, UUID),
)


# ---------------------------------------------------------------- the reading
@dataclass
class XidCount:
    count: int
    last_seen: float  # unix time the exporter received the newest one


@dataclass
class XidGpu:
    index: int
    uuid: str
    registered: bool
    error: str = ""  # why not registered
    xids: Dict[str, XidCount] = field(default_factory=dict)  # Xid code ("79", or "other") -> its count


@dataclass
class XidReading:
    gpus: List[XidGpu] = field(default_factory=list)


class XidUnavailable(RuntimeError):
    """NVML cannot be used (no library, no driver): no GPU's Xid events are received."""


def xid_label(code: int, known: Dict[str, XidCount]) -> str:
    """The xid label of a code, given the codes already counted on that GPU."""
    value = str(code)
    if value in known or len(known) < MAX_XID_CODES:
        return value
    return OTHER


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A device handle as a dict key: the address a ctypes pointer holds (an event's
    `device` is another pointer object to the same device), else the handle itself."""
    try:
        return ("address", ctypes.cast(handle, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return handle


# ---------------------------------------------------------------- the watcher
class XidWatcher:
    """Holds the event set and the counters; see the module docstring."""

    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.time, wait_ms: int = WAIT_MS,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        self._nvml = nvml
        self._clock = clock
        self.wait_ms = wait_ms
        self.retry_seconds = retry_seconds
        self._lock = threading.Lock()  # the counters, and whether NVML is held
        self._changed = threading.Condition(self._lock)
        self._nvml_lock = threading.Lock()  # set-up, waits and tear-down: one at a time
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._leaving: Optional[threading.Thread] = None  # closed, still in its last wait
        self._initialised = False
        self._event_set: Any = None
        self._gpus: Dict[int, XidGpu] = {}
        self._by_handle: Dict[Any, int] = {}  # handle key -> GPU index
        self._error: Optional[str] = None  # NVML cannot be used: why
        self._set_up = False  # registration was tried (a reading has GPUs to say)
        self.events = 0  # Xid events taken in, counted and logged (tests wait on it)
        self.setups = 0  # registrations done (tests wait on it)

    # ---------------------------------------------------------- NVML
    def _module(self) -> Any:
        if self._nvml is None:
            self._nvml = import_pynvml(XidUnavailable)
        return self._nvml

    def _setup(self) -> bool:
        """Initialise NVML, create the set, register every GPU. True: there is a set to wait on."""
        if self._initialised:
            return self._event_set is not None
        try:
            nvml = self._module()
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as e:
                raise XidUnavailable(f"NVML cannot initialise: {e}") from e
        except XidUnavailable as e:
            with self._lock:
                self._error = str(e)
            return False
        self._initialised = True
        gpus: Dict[int, XidGpu] = {}
        handles: Dict[Any, int] = {}
        try:
            count = int(nvml.nvmlDeviceGetCount())
            try:
                event_set = nvml.nvmlEventSetCreate()
            except (nvml.NVMLError, AttributeError) as e:  # AttributeError: a pynvml without events
                event_set, why = None, f"no NVML event set: {e}"
            else:
                why = ""
            event_type = getattr(nvml, "nvmlEventTypeXidCriticalError", XID_EVENT_TYPE)
            for index in range(count):
                gpus[index] = gpu = XidGpu(index, "", False, why)
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    gpu.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                    if event_set is not None:
                        nvml.nvmlDeviceRegisterEvents(handle, event_type, event_set)
                        gpu.registered, gpu.error = True, ""
                        handles[_handle_key(handle)] = index
                except nvml.NVMLError as e:
                    gpu.error = f"cannot register its Xid events: {e}"
                    log.warning("GPU %d: %s; its Xid errors are not counted", index, gpu.error)
        except nvml.NVMLError as e:
            with self._lock:
                self._error = f"NVML stopped answering: {e}"
            self._teardown()
            return False
        if event_set is not None and not handles:
            self._free(event_set)  # nothing to wait for
            event_set = None
        with self._lock:
            self._event_set, self._by_handle = event_set, handles
            # Counters of a GPU seen before (a set-up after NVML went away) carry on.
            for index, gpu in gpus.items():
                old = self._gpus.get(index)
                if old is not None and old.uuid == gpu.uuid:
                    gpu.xids = old.xids
            self._gpus, self._error, self._set_up = gpus, None, True
            self.setups += 1
            self._changed.notify_all()
        return event_set is not None

    def _free(self, event_set: Any) -> None:
        nvml = self._module()
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError as e:
            log.debug("nvmlEventSetFree failed: %s", e)

    def _teardown(self) -> None:
        if not self._initialised:
            return
        nvml = self._module()
        if self._event_set is not None:
            self._free(self._event_set)
            self._event_set = None
        self._initialised = False
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.debug("nvmlShutdown failed: %s", e)

    def _wait_one(self, timeout_ms: int) -> bool:
        """Wait for one event and count it. False: the wait timed out (no event)."""
        nvml = self._module()
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nvml.NVMLError as e:
            if e.value == nvml.NVML_ERROR_TIMEOUT:
                return False
            raise
        self._count(data)
        return True

    def _count(self, data: Any) -> None:
        event_type = getattr(self._module(), "nvmlEventTypeXidCriticalError", XID_EVENT_TYPE)
        if not int(data.eventType) & event_type:
            return
        now = self._clock()
        with self._lock:
            index = self._by_handle.get(_handle_key(data.device))
            gpu = self._gpus.get(index) if index is not None else None
            if gpu is None:
                log.debug("Xid %s of a device not registered", data.eventData)
                return
            label = xid_label(int(data.eventData), gpu.xids)
            seen = gpu.xids.get(label)
            if seen is None:
                gpu.xids[label] = XidCount(1, now)
            else:
                seen.count += 1
                seen.last_seen = max(seen.last_seen, now)
        log.warning("GPU %d (%s): Xid %d", gpu.index, gpu.uuid, int(data.eventData))
        with self._changed:  # taken in once logged too: who waits for it sees its line written
            self.events += 1
            self._changed.notify_all()

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._nvml_lock:
                ready = self._setup()
            if not ready:
                if self._set_up and self._error is None:
                    return  # every GPU said why it is not registered: nothing to wait for
                self._stop.wait(self.retry_seconds)
                continue
            try:
                while not self._stop.is_set():
                    with self._nvml_lock:
                        self._wait_one(self.wait_ms)
            except Exception as e:  # NVMLError of a wait (GPU lost, driver gone), or a bug
                log.warning("waiting for Xid events failed: %s; registering again in %.0f s", e, self.retry_seconds)
                with self._nvml_lock:
                    self._teardown()
                self._stop.wait(self.retry_seconds)
        with self._nvml_lock:
            self._teardown()

    def start(self) -> None:
        if self._thread is None:
            leaving, self._leaving = self._leaving, None
            if leaving is not None:  # one thread on the set at a time
                leaving.join()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mps-xid-events", daemon=True)
            self._thread.start()

    def catch_up(self) -> None:
        """Register (once) and take in the events waiting now, without blocking (dump, status)."""
        if self._thread is not None:
            return  # the thread takes them in
        with self._nvml_lock:
            if not self._setup():
                return
            try:
                for _ in range(CATCH_UP_MAX_EVENTS):
                    if not self._wait_one(0):
                        break
            except Exception as e:
                log.warning("reading Xid events failed: %s", e)
                self._teardown()

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """Stop the thread, free the set, shut NVML down. Safe twice. A thread still in
        its wait after `timeout` does the rest itself when the wait ends."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None and self._leaving is not None and self._leaving.is_alive():
            return  # closed already: the set is the leaving thread's to free
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.debug("the Xid event thread ends after its wait (at most %d ms)", self.wait_ms)
                self._leaving = thread
                return  # it still holds the set: freeing it under a wait would be worse
        with self._nvml_lock:
            self._teardown()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Until `done()` holds after an event or a registration, or `timeout` (tests)."""
        with self._changed:
            return self._changed.wait_for(done, timeout)

    def wait_for_events(self, n: int, timeout: float) -> bool:
        """Until `n` Xid events have been taken in, or `timeout`."""
        return self.wait_until(lambda: self.events >= n, timeout)

    # ---------------------------------------------------------- the read
    def read(self) -> XidReading:
        """The counters now (no NVML call). Raises XidUnavailable where NVML cannot be used."""
        with self._lock:
            if self._error is not None:
                raise XidUnavailable(self._error)
            return XidReading([dataclasses.replace(g, xids={k: dataclasses.replace(v) for k, v in g.xids.items()})
                               for _, g in sorted(self._gpus.items())])


# ---------------------------------------------------------------- the source
def render_xid(out: FamilyBuilder, reading: Optional[XidReading]) -> None:
    for gpu in (reading.gpus if reading is not None else []):
        ids = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        out.add("mps_gpu_xid_events_registered", 1 if gpu.registered else 0, **ids)
        for code, seen in sorted(gpu.xids.items(), key=lambda kv: _code_order(kv[0])):
            out.add("mps_gpu_xid_errors_total", seen.count, **ids, xid=code)
            out.add("mps_gpu_xid_last_seen_timestamp_seconds", seen.last_seen, **ids, xid=code)


def _code_order(code: str) -> Tuple[int, str]:
    return (int(code), "") if code.isdigit() else (1 << 62, code)


class XidSourceSpec(Source[XidReading]):
    name = "xid"
    help = "Xid errors per GPU and code, from NVML's event API (a thread waits for them)"
    reading_type = XidReading
    metrics = XID_METRICS

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[XidReading]]:
        if cfg.collectors.get("nvml") is False and cfg.collectors.get(self.name) is not True:
            return None  # no NVML wanted here (as DCGM): --collector.xid asks for it all the same
        watcher = XidWatcher(backends.nvml_module, clock=backends.clock)

        def read(ctx: ReadContext) -> XidReading:
            return watcher.read()

        return Reader(read, quick=read, start=watcher.start, catch_up=watcher.catch_up, close=watcher.close,
                      source=watcher)

    def render(self, out: FamilyBuilder, snap: Snapshot) -> None:
        render_xid(out, self.reading(snap))

    def shift(self, reading: XidReading, seconds: float) -> XidReading:
        return XidReading([dataclasses.replace(g, xids={k: XidCount(v.count, v.last_seen + seconds)
                                                       for k, v in g.xids.items()}) for g in reading.gpus])


SOURCE = XidSourceSpec()
