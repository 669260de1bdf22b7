"""NVML source: one `NvmlReading` per scrape, through the pynvml module.

Only this module touches pynvml (the `nvidia-ml-py` package). It is handed the
module, so tests and the benchmark pass `tests/fakes/fake_pynvml.FakeNvml`.

What it keeps between scrapes, per GPU index:
- the last-seen timestamp of `nvmlDeviceGetProcessUtilization`, so each scrape
  asks only for samples newer than the previous one;
- the previous NVML GPM sample, so SM activity, occupancy, tensor and DRAM
  activity are computed over the scrape interval (absent on the first scrape);
- name and UUID, which cannot change while NVML stays initialised.

Failure scopes: NVML that cannot initialise fails the whole read (retried on the
next scrape); an error on a required call of one GPU marks that GPU down; an
error on an optional field (power, temperature, process utilization, GPM) only
drops that field.
"""

from __future__ import annotations

import ctypes
import functools
import struct as structlib
import dataclasses
import logging
import math
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import (Any, Callable, Dict, Generic, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Type,
                    TypeVar, Union, cast)

from ..config import Config
from ..model import Derived, GpuReading, NvmlReading, ProcessMemory, ProcessUtilization, Snapshot, same_objects
from .base import Backends, Reader, Source

log = logging.getLogger(__name__)

# NVML compute modes (nvmlComputeMode_t) as the lowercase names the contract uses.
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# GpuReading.activity key -> name of the pynvml GPM metric constant.
GPM_METRICS: Tuple[Tuple[str, str], ...] = (
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)

# NVML returns this for usedGpuMemory it cannot tell; pynvml maps it to None,
# but older versions and other wrappers pass it through.
_VALUE_NOT_AVAILABLE_ULL = 2**64 - 1


T = TypeVar("T")
R = TypeVar("R")
Kept = TypeVar("Kept")  # a list or a GPU's reading kept by _as_last


# NVML's GPM calls are not thread-safe on driver 580, whatever its documentation says: two
# reader threads (one per GPU) inside nvmlGpmSampleGet and nvmlGpmMetricsGet at once
# crashed the process with SIGSEGV in 4 of 8 starts on 2 x H100 (issue 38); one lock
# around them, 0 crashes. Process-wide, since NVML's state is. Every GPM call of this
# module goes through `gpm_call` (in the GpmSampler's one thread, or at shutdown); the
# GPU's other calls still run side by side.
GPM_LOCK = threading.Lock()

# How long a GPU's read waits for its GPM activity before it serves the last one: with GPM
# calls in one line, a GPU whose nvmlGpmSampleGet takes 0.49 s (the H100 storm of issue 12)
# would otherwise hold up every other GPU's reading by as much.
GPM_WAIT_SECONDS = 0.05


def gpm_call(fn: Callable[..., T], *args: Any) -> T:
    """One NVML GPM call, never beside another."""
    with GPM_LOCK:
        return fn(*args)


# How long one read of every GPU waits for a GPU before it serves that GPU's last reading.
# While MPS admits a storm of clients single NVML calls took up to 0.49 s (the H100 storm of
# issue 12) and a GPU's whole read seconds: read as one, the NVML reading was 4.3 s old at
# worst and a scrape waited out its 0.5 s budget for it (4 x H200, issue 45).
GPU_WAIT_SECONDS = 0.25


# How long closing waits for a read in flight: an NVML call that hangs must not keep the
# exporter from exiting.
CLOSE_WAIT_SECONDS = 2.0


class DaemonWorker:
    """One daemon thread running the calls given to it, in order. Not a ThreadPoolExecutor:
    its threads are joined at interpreter exit, so an NVML call that never returns would
    keep the exporter from exiting on SIGTERM."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.SimpleQueue[Optional[Tuple[Callable[[], Any], Future[Any]]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        future: "Future[T]" = Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # raised to whoever takes the result
                    future.set_exception(e)
            # The call may hold its owner (the NvmlClient): let it go while this thread waits.
            del job, fn, future

    def stop(self) -> None:
        """End the thread after the call in flight, if any (not waited for)."""
        self._jobs.put(None)


def _stop_all(workers: Dict[int, DaemonWorker]) -> None:
    for worker in workers.values():
        worker.stop()
    workers.clear()


def _settle(futures: Iterable["Future[Any]"], timeout: Optional[float]) -> None:
    """Wait for these to end (at most `timeout` seconds), whatever they raise."""
    wait_futures(list(futures), timeout=timeout)


class _WorkInFlight(Generic[R]):
    """Work per GPU index in daemon threads, the last result of each kept: what PerGpuReads
    and GpmSampler share. Threads end when their owner is collected, closed or not."""

    def __init__(self) -> None:
        self._workers: Dict[int, DaemonWorker] = {}
        weakref.finalize(self, _stop_all, self._workers)
        self._pending: Dict[int, "Future[Any]"] = {}  # GPU index -> its work in flight (or its round's, GPM)
        self._last: Dict[int, R] = {}

    @property
    def threads(self) -> List[threading.Thread]:
        """Its threads now (one per GPU for reads, one for GPM)."""
        return [w._thread for w in self._workers.values()]

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait for the work in flight; its results go to the next ask."""
        _settle(self._pending.values(), timeout)

    def forget(self) -> None:
        """Wait for the work in flight and drop every kept result (re-initialisation)."""
        self.drain()
        self._pending.clear()
        self._last.clear()

    def close(self) -> None:
        """Stop the threads, waiting a bounded time for the work in flight."""
        self.drain(CLOSE_WAIT_SECONDS)
        _stop_all(self._workers)
        self._pending.clear()
        self._last.clear()


class PerGpuReads(_WorkInFlight[GpuReading]):
    """Each GPU read in a thread of its own, side by side: NVML's calls other than GPM's
    are thread-safe and release the GIL. A read of every GPU waits for each at most
    `wait_seconds`; a GPU whose read is still running then stands in with its last
    reading, and that read's result goes to a later read of every GPU (one read per GPU
    at a time, never a second beside it). A GPU with no reading yet is waited for. So a
    slow GPU holds up neither the others' readings nor the source's."""

    def __init__(self, wait_seconds: Optional[float] = GPU_WAIT_SECONDS) -> None:
        super().__init__()  # a thread per GPU index
        self.wait_seconds = wait_seconds  # None: wait for every GPU (the benchmark's reference)

    def read(self, indexes: Sequence[int], read_one: Callable[[int], GpuReading]) -> List[Tuple[GpuReading, bool]]:
        """One reading per index, in their order, each with whether it is new (False: the
        stand-in). An exception of `read_one` is raised here."""
        futures = {i: self._pending.get(i) or self._pending.setdefault(i, self._worker(i).submit(
            functools.partial(read_one, i))) for i in indexes}
        _settle(futures.values(), self.wait_seconds)
        out = []
        for i in indexes:
            future = futures[i]
            new = future.done() or i not in self._last
            if new:
                del self._pending[i]
                self._last[i] = future.result()  # waits where there is no stand-in
            out.append((self._last[i], new))
        return out

    def keep(self, index: int, reading: GpuReading) -> None:
        """The GPU's stand-in from now on: its new reading as finished (an equal, older one)."""
        self._last[index] = reading

    def _worker(self, index: int) -> DaemonWorker:
        worker = self._workers.get(index)
        if worker is None:
            worker = self._workers[index] = DaemonWorker(f"mps-read-nvml-{index}")
        return worker



# Said where NVML is missing altogether (a laptop, a CI runner): where the demo is.
DEMO_HINT = "for a demo without a GPU: mps-exporter replay"


class GpmSampler(_WorkInFlight[Dict[str, float]]):
    """Every GPU's GPM work in one thread, in the order asked: never two GPM calls at once.
    A round's GPUs are asked at once, once their other readings are in (GPM beside the
    same GPU's other calls cost the H200 several times the CPU), as one job: one hand-off
    and one wait of at most `wait_seconds` a round, not one per GPU (issue 44). A GPU
    whose work is not done by then gets the last activity it had (one interval older),
    and the work's result is taken by the next round. So a slow GPU delays the others'
    GPM figures, never their readings."""

    def __init__(self, wait_seconds: Optional[float] = GPM_WAIT_SECONDS) -> None:
        super().__init__()  # 0 -> the one thread, started at the first GPM work
        self.wait_seconds = wait_seconds

    def activities(self, works: Mapping[int, Callable[[], Dict[str, float]]]
                   ) -> Dict[int, Union[Dict[str, float], BaseException]]:
        """Each GPU's activity: its work's result, or its last one while its work (this
        round's or an earlier one's) is still in line; an exception of its work, once.
        A GPU whose earlier work is still in line gets no new work."""
        new = [index for index in works if index not in self._pending]
        if new:
            if 0 not in self._workers:
                self._workers[0] = DaemonWorker("mps-read-gpm")
            job = self._workers[0].submit(functools.partial(_each, [(index, works[index]) for index in new]))
            self._pending.update(dict.fromkeys(new, job))
        jobs = {index: self._pending[index] for index in works}
        _settle(set(jobs.values()), self.wait_seconds)
        out: Dict[int, Union[Dict[str, float], BaseException]] = {}
        for index, job in jobs.items():
            if not job.done():
                out[index] = self._last.get(index, {})
                continue
            del self._pending[index]
            result = job.result()[index]
            if isinstance(result, BaseException):
                self._last.pop(index, None)
            else:
                self._last[index] = result
            out[index] = result
        return out


def _each(works: Sequence[Tuple[int, Callable[[], T]]]) -> Dict[int, Union[T, BaseException]]:
    """Each call in turn: its result or its exception, by index."""
    out: Dict[int, Union[T, BaseException]] = {}
    for index, work in works:
        try:
            out[index] = work()
        except BaseException as e:  # raised to whoever takes the result
            out[index] = e
    return out


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all in this scrape (no library, no driver, no GPU)."""


def import_pynvml(unavailable: Type[Exception], hint: str = "") -> Any:
    """The pynvml module (the nvidia-ml-py package), imported where first needed; where it
    is missing, `unavailable` saying so."""
    try:
        import pynvml
    except ImportError as e:
        raise unavailable(f"cannot import pynvml (install nvidia-ml-py{hint}): {e}") from e
    return pynvml


def _text(value: Any) -> str:
    """pynvml returns str since 11.x; older versions returned bytes."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _used_bytes(value: Optional[int]) -> Optional[int]:
    if value is None or value == _VALUE_NOT_AVAILABLE_ULL:
        return None
    return int(value)


def _ratio(percent: float) -> float:
    """Percent (0..100) to a ratio clamped to 0..1: GPM can round a hair past 100."""
    return min(max(float(percent) / 100.0, 0.0), 1.0)


# Compute and MIG mode are read again after this many seconds, not in every round: they
# change only when an administrator changes them, and while MPS admits a storm of
# clients every NVML call costs CPU (13-20 ms/s for NVML in the H100 storm of issue 29,
# 6.4 settled), these two up to 0.1 s each.
MODES_SECONDS = 30.0


# _as_last's key for a GPU's whole reading, beside the NVML functions' lists
GPU_READING = "GpuReading"


def _no_lookup(name: str) -> Any:
    raise RuntimeError(f"this pynvml has no C entry point lookup for {name}")


# The fields DirectLists reads of each row, in the order they lie in the struct
PID_AND_MEMORY = ("pid", "usedGpuMemory")  # of PROCESS_LIST_VERSIONS' structs
PID_TIME_AND_SM = ("pid", "timeStamp", "smUtil")  # of UTILIZATION_VERSIONS' struct
_UNSIGNED = {4: "I", 8: "Q"}  # a field's size -> its struct format
# A list's C entry points, newest first: (suffix, the struct's name in pynvml); DirectLists._entry
PROCESS_LIST_VERSIONS = (("_v3", "c_nvmlProcessInfo_v3_t"), ("_v2", "c_nvmlProcessInfo_v2_t"))
UTILIZATION_VERSIONS = (("", "c_nvmlProcessUtilizationSample_t"),)


def _unpackable(struct: Any, names: Tuple[str, ...]) -> bool:
    """Whether _fields_of can read these fields of the struct: each an unsigned 4- or
    8-byte integer, in this order, none overlapping the next."""
    types = {field[0]: field[1] for field in getattr(struct, "_fields_", ())}
    end = 0
    for name in names:
        field = getattr(struct, name, None)
        unsigned = getattr(types.get(name), "_type_", None) in ("I", "L", "Q")
        if field is None or not unsigned or field.size not in _UNSIGNED or field.offset < end:
            return False
        end = field.offset + field.size
    return end <= ctypes.sizeof(struct)


@functools.lru_cache(maxsize=None)
def _fields_of(struct: Any, names: Tuple[str, ...]) -> "structlib.Struct":
    """These fields of one row of an NVML struct, by their offsets: the struct's own
    layout, whichever version."""
    layout, end = "=", 0
    for name in names:
        field = getattr(struct, name)
        layout += f"{field.offset - end}x{_UNSIGNED[field.size]}"
        end = field.offset + field.size
    return structlib.Struct(f"{layout}{ctypes.sizeof(struct) - end}x")


def _rows(buffer: Any, count: int, struct: Any, names: Tuple[str, ...]) -> List[Tuple[int, ...]]:
    """The first `count` rows of the buffer, these fields of each, unpacked in C (a ctypes
    struct per row cost a microsecond or two, 97 a GPU at 48 clients)."""
    raw = ctypes.string_at(buffer, count * ctypes.sizeof(struct)) if count else b""
    return list(_fields_of(struct, names).iter_unpack(raw))


class DirectLists:
    """NVML's list functions (compute and MPS processes, per-process utilization) called
    straight through pynvml's entry points, each into a buffer kept from the last round.

    pynvml calls each of them twice per read: with no buffer to learn the count, then
    with a fresh one. While MPS admits a storm of clients every call into the driver
    costs CPU (these three were 15 of the 21 ms/s NVML took in the H100 storm of issue
    29), so one call where the kept buffer is large enough, the usual case; a second
    only when the list outgrew it. `usable` is False where this pynvml lacks the entry
    point lookup or the structs (the source then calls pynvml's public functions)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lookup: Callable[[str], Any] = getattr(nvml, "_nvmlGetFunctionPointer", None) or _no_lookup
        # (function, GPU index) -> ctypes array kept for the next call on that GPU
        self._buffers: Dict[Tuple[str, int], Any] = {}
        # (function, GPU index) -> its list, built again only where the (pid, bytes) rows moved
        self._lists: Dict[Tuple[str, int], Derived[List[ProcessMemory]]] = {}
        # pynvml's function -> its C entry point's name, struct and the entry point, looked up
        # once (_entry): not a lookup per list, GPU and round, nor before R510 an NVMLError
        self._entries: Dict[str, Tuple[str, Any, Any]] = {}
        self._looking_up = threading.Lock()

    @property
    def usable(self) -> bool:
        structs = {**{struct: PID_AND_MEMORY for _, struct in PROCESS_LIST_VERSIONS},
                   **{struct: PID_TIME_AND_SM for _, struct in UTILIZATION_VERSIONS}}
        return self._lookup is not _no_lookup and all(
            hasattr(self._nvml, struct) and _unpackable(getattr(self._nvml, struct), names)
            for struct, names in structs.items())

    def processes(self, function: str, handle: Any, index: int) -> List[ProcessMemory]:
        """Compute or MPS processes: `function` is pynvml's name; its _v3 entry point,
        _v2 where the driver lacks _v3 (before R510)."""
        name, struct, entry = self._entry(function, PROCESS_LIST_VERSIONS)
        buffer, count = self._filled(name, index, struct,
                                     lambda buffer, count: entry(handle, ctypes.byref(count), buffer))
        # An answer equal to the last gives the last list, built once.
        rows = _rows(buffer, count, struct, PID_AND_MEMORY)
        return self._lists.setdefault((name, index), Derived()).get(
            (), rows, lambda: [ProcessMemory(pid, _used_bytes(used)) for pid, used in rows])

    def utilization(self, handle: Any, index: int, since_us: int) -> List[Tuple[int, ...]]:
        """(pid, timeStamp, smUtil) of each per-process utilization sample newer than
        `since_us` (NVMLError NOT_FOUND where there is none, as pynvml)."""
        name, struct, entry = self._entry("nvmlDeviceGetProcessUtilization", UTILIZATION_VERSIONS)
        since = ctypes.c_ulonglong(since_us)
        buffer, count = self._filled(name, index, struct,
                                     lambda buffer, count: entry(handle, buffer, ctypes.byref(count), since))
        return _rows(buffer, count, struct, PID_TIME_AND_SM)

    def _entry(self, function: str, versions: Sequence[Tuple[str, str]]) -> Tuple[str, Any, Any]:
        """pynvml's `function` as the first of `versions` (the entry point's suffix, its
        struct's name in pynvml) the driver has: the entry point's name, struct and itself."""
        found = self._entries.get(function)
        if found is None:
            with self._looking_up:  # the GPU threads' first calls come at once: one lookup
                found = self._entries.get(function)
                if found is None:
                    found = self._entries[function] = self._first_entry(function, versions)
        return found

    def _first_entry(self, function: str, versions: Sequence[Tuple[str, str]]) -> Tuple[str, Any, Any]:
        nvml = self._nvml
        for suffix, struct in versions[:-1]:
            try:
                return function + suffix, getattr(nvml, struct), self._lookup(function + suffix)
            except nvml.NVMLError as e:  # _v3 where the driver has only _v2 (before R510)
                if e.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
        suffix, struct = versions[-1]
        return function + suffix, getattr(nvml, struct), self._lookup(function + suffix)

    def _filled(self, name: str, index: int, struct: Any, call: Callable[[Any, ctypes.c_uint], int]) -> Tuple[Any, int]:
        """The kept buffer after the call, and how many rows of it the call filled."""
        nvml = self._nvml
        buffer = self._buffers.get((name, index))
        count = ctypes.c_uint(len(buffer) if buffer is not None else 0)
        code = call(buffer, count)
        if code == nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            # Room for twice as many as now (pynvml's own margin), kept for the next rounds.
            buffer = (struct * (count.value * 2 + 5))()
            self._buffers[(name, index)] = buffer
            count.value = len(buffer)
            code = call(buffer, count)
        if code != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(code)
        return buffer, 0 if buffer is None else min(count.value, len(buffer))


class NvmlClient:
    """Reads the GPU table, processes, per-process SM utilization and GPM."""

    def __init__(self, nvml: Any = None, wait_for_every_answer: bool = False) -> None:
        self._nvml = nvml
        # Fakes and recordings answer at once: a late answer there is the scheduler's, not
        # the GPU's, and a stand-in would make a test depend on the machine's load.
        self._waits = (None, None) if wait_for_every_answer else (GPU_WAIT_SECONDS, GPM_WAIT_SECONDS)
        self._initialised = False
        self._identity: Dict[int, Tuple[str, str]] = {}  # index -> (name, uuid)
        # index -> its device handle, valid until nvmlShutdown; asked again after an error
        # (one NVML call fewer per GPU and round, issue 44)
        self._handles: Dict[int, Any] = {}
        self._last_seen_us: Dict[int, int] = {}  # index -> newest process-utilization sample
        self._gpm_prev: Dict[int, Any] = {}  # index -> previous GPM sample (to free later)
        # index -> the sample before it, its interval taken: the next sample is taken into it
        # (an alloc and a free fewer per GPU and round)
        self._gpm_spare: Dict[int, Any] = {}
        self._gpm_supported: Dict[int, bool] = {}
        self._down: Set[int] = set()  # GPUs whose last read failed
        # index -> (time.monotonic() of the read, compute mode, MIG enabled): see MODES_SECONDS
        self._modes: Dict[int, Tuple[float, str, bool]] = {}
        # (index, NVML function or GPU_READING) -> the list or GPU reading it gave last, and
        # the last reading of all: the same objects again while equal, so that a collection
        # of a steady node is known unchanged by identity (the join, the exit tracker and the
        # readings key then compare nothing; issue 44)
        self._kept: Dict[Tuple[int, str], Any] = {}
        # index -> its process utilization, built again only where its (pid, smUtil) pairs moved
        self._utilization: Dict[int, Derived[List[ProcessUtilization]]] = {}
        self._last_reading: Optional[NvmlReading] = None
        self._direct: Optional[DirectLists] = None  # None: pynvml's public list functions
        self.gpm = GpmSampler(self._waits[1])  # the only caller of GPM while NVML is initialised
        self.gpus = PerGpuReads(self._waits[0])

    # ------------------------------------------------------------ lifecycle
    def _module(self) -> Any:
        if self._nvml is None:
            self._nvml = import_pynvml(NvmlUnavailable, f"; {DEMO_HINT}")
        return self._nvml

    def _ensure_initialised(self, nvml: Any) -> None:
        if self._initialised:
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML cannot initialise: {e} (no NVIDIA driver or no GPU? {DEMO_HINT})") from e
        self._forget_state(nvml)
        direct = DirectLists(nvml)  # buffers sized anew after a re-initialisation
        self._direct = direct if direct.usable else None
        self._initialised = True

    def _forget_state(self, nvml: Any) -> None:
        """Drop per-GPU state: after a re-initialisation handles and samples are stale."""
        self.gpus.forget()  # reads in flight use the handles and state dropped here
        self.gpm.forget()  # its work in line uses the samples freed here
        for sample in [*self._gpm_prev.values(), *self._gpm_spare.values()]:
            self._free_sample(nvml, sample)
        self._gpm_prev.clear()
        self._gpm_spare.clear()
        self._gpm_supported.clear()
        self._last_seen_us.clear()
        self._identity.clear()
        self._handles.clear()
        self._modes.clear()
        self._kept.clear()
        self._utilization.clear()
        self._direct = None

    def close(self) -> None:
        """Free GPM samples and shut NVML down. Safe to call twice."""
        if not self._initialised:
            return
        nvml = self._module()
        self.gpus.close()  # first: a hung read is left behind, not waited for
        self.gpm.close()
        self._forget_state(nvml)
        self.gpm = GpmSampler(self._waits[1])  # a thread only once a read asks again
        self.gpus = PerGpuReads(self._waits[0])
        self._initialised = False
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.debug("nvmlShutdown failed: %s", e)

    # ---------------------------------------------------------------- read
    def read(self) -> NvmlReading:
        """One reading of every GPU. Raises NvmlUnavailable when NVML is unusable."""
        nvml = self._module()
        self._ensure_initialised(nvml)
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            # The driver went away under us (unloaded, GPU lost): start over next time.
            self._initialised = False
            raise NvmlUnavailable(f"NVML stopped answering: {e}") from e
        readings = self.gpus.read(range(count), lambda index: self._read_gpu(nvml, index))
        gpus = self._with_activity(nvml, readings)
        last = self._last_reading
        if last is not None and last.driver_version == driver and same_objects(last.gpus, gpus):
            return last
        self._last_reading = NvmlReading(driver_version=driver, gpus=gpus)
        return self._last_reading

    def _with_activity(self, nvml: Any, readings: List[Tuple[GpuReading, bool]]) -> List[GpuReading]:
        """The GPUs' readings, each new one with its GPM activity and then kept by _as_last
        (a stand-in already was)."""
        works = {g.index: functools.partial(self._gpm_activity, nvml, self._handles[g.index], g.index)
                 for g, new in readings if new and g.up and g.index in self._handles}
        activities = self.gpm.activities(works) if works else {}
        gpus = []
        for g, new in readings:
            if new:
                activity = activities.get(g.index)
                if isinstance(activity, nvml.NVMLError):
                    log.debug("GPU %d: no GPM activity: %s", g.index, activity)
                elif isinstance(activity, BaseException):
                    raise activity
                elif activity is not None:
                    g.activity = activity
                g = self._as_last(g.index, GPU_READING, g)
                self.gpus.keep(g.index, g)
            gpus.append(g)
        return gpus

    def _read_gpu(self, nvml: Any, index: int) -> GpuReading:
        uuid = self._identity.get(index, ("", ""))[1]
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
            name, uuid = self._identify(nvml, index, handle)
            gpu = GpuReading(index=index, uuid=uuid, up=True, name=name)
            self._read_required(nvml, handle, gpu)
        except nvml.NVMLError as e:
            self._handles.pop(index, None)
            # Warn when a GPU goes down, not at every scrape while it stays down.
            (log.debug if index in self._down else log.warning)("NVML error on GPU %d: %s", index, e)
            self._down.add(index)
            return GpuReading(index=index, uuid=uuid, up=False)
        self._down.discard(index)
        self._read_optional(nvml, handle, gpu)
        return gpu

    def _identify(self, nvml: Any, index: int, handle: Any) -> Tuple[str, str]:
        if index not in self._identity:
            self._identity[index] = (_text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle)))
        return self._identity[index]

    def _read_modes(self, nvml: Any, handle: Any, index: int) -> Tuple[str, bool]:
        kept = self._modes.get(index)
        if kept is not None and time.monotonic() - kept[0] < MODES_SECONDS:
            return kept[1], kept[2]
        mode = int(nvml.nvmlDeviceGetComputeMode(handle))
        modes = (COMPUTE_MODES.get(mode, f"unknown_{mode}"), self._mig_enabled(nvml, handle))
        self._modes[index] = (time.monotonic(), *modes)
        return modes

    def _read_required(self, nvml: Any, handle: Any, gpu: GpuReading) -> None:
        gpu.compute_mode, gpu.mig_enabled = self._read_modes(nvml, handle, gpu.index)
        memory = self._memory_info(nvml, handle)
        gpu.memory_total_bytes = int(memory.total)
        gpu.memory_used_bytes = int(memory.used)
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        gpu.utilization_ratio = _ratio(rates.gpu)
        gpu.memory_utilization_ratio = _ratio(rates.memory)
        compute = "nvmlDeviceGetComputeRunningProcesses"
        gpu.compute_processes = self._as_last(gpu.index, compute, self._processes(nvml, compute, handle, gpu.index))
        # With several GPUs, NVML's MPS list names every client of the server on every
        # GPU, with 0 bytes where it has no context; the compute list (and nvidia-smi)
        # name it only where it runs (seen live on two H200s, tests/gpu/reports).
        running = {p.pid for p in gpu.compute_processes}
        mps = "nvmlDeviceGetMPSComputeRunningProcesses"
        gpu.mps_clients = self._as_last(gpu.index, mps, [p for p in self._processes(nvml, mps, handle, gpu.index)
                                                         if p.pid in running or (p.used_bytes or 0) > 0])

    def _as_last(self, index: int, what: str, value: Kept) -> Kept:
        """`value`, or the equal one `what` (an NVML function, GPU_READING) gave on this GPU
        last time (in the GPU's own thread)."""
        key = (index, what)
        last = self._kept.get(key)
        if last is not None and last == value:
            return cast(Kept, last)
        self._kept[key] = value
        return value

    @staticmethod
    def _memory_info(nvml: Any, handle: Any) -> Any:
        """Memory as nvidia-smi shows it: the v2 call, whose `used` leaves out what the
        driver reserves. On the H200 (driver 580) v1 said 14236 MiB used where v2 and
        nvidia-smi said 13621 (tests/data/captures, nvml_busy.json); v1 where v2 is missing."""
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except nvml.NVMLError as e:
                fallback = [getattr(nvml, name, None) for name in (
                    "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH")]
                if e.value not in fallback:
                    raise
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def _processes(self, nvml: Any, function: str, handle: Any, index: int) -> List[ProcessMemory]:
        if self._direct is not None:
            return self._direct.processes(function, handle, index)
        try:
            processes = getattr(nvml, function)(handle)
        except getattr(nvml, "NVMLLibraryMismatchError", ()):
            # pynvml calls the _v3 entry point, which drivers before R510 lack;
            # it then raises this (no NVMLError) and names _v2 as the way out.
            processes = getattr(nvml, function + "_v2")(handle)
        return [ProcessMemory(int(p.pid), _used_bytes(p.usedGpuMemory)) for p in processes]

    @staticmethod
    def _mig_enabled(nvml: Any, handle: Any) -> bool:
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as e:
            if e.value == nvml.NVML_ERROR_NOT_SUPPORTED:  # GPU without MIG
                return False
            raise
        return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)

    def _read_optional(self, nvml: Any, handle: Any, gpu: GpuReading) -> None:
        i = gpu.index
        try:
            gpu.power_watts = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
        except nvml.NVMLError as e:
            log.debug("GPU %d: no power reading: %s", i, e)
        try:
            gpu.temperature_celsius = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError as e:
            log.debug("GPU %d: no temperature reading: %s", i, e)
        try:
            gpu.process_utilization = self._process_utilization(nvml, handle, i)
        except nvml.NVMLError as e:
            log.debug("GPU %d: no process utilization: %s", i, e)
        # GPM activity comes after every GPU's readings (_with_activity).

    # ------------------------------------------------ per-process utilization
    def _process_utilization(self, nvml: Any, handle: Any, index: int) -> List[ProcessUtilization]:
        """Samples newer than the last one seen on this GPU; the newest per PID."""
        since = self._last_seen_us.get(index, 0)
        try:
            if self._direct is not None:
                samples = self._direct.utilization(handle, index, since)
            else:
                samples = [(int(s.pid), int(s.timeStamp), s.smUtil)
                           for s in nvml.nvmlDeviceGetProcessUtilization(handle, since)]
        except nvml.NVMLError as e:
            # NOT_FOUND: no sample since last_seen (an idle GPU always answers this).
            # pynvml raises NVMLError(SUCCESS) when the size query finds none at all.
            if e.value in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS):
                return []
            raise
        newest: Dict[int, Tuple[int, Any]] = {}  # pid -> (timeStamp, smUtil) of its newest sample
        for pid, ts, sm in samples:
            seen = newest.get(pid)
            if seen is None or ts > seen[0]:
                newest[pid] = (ts, sm)
        if newest:
            self._last_seen_us[index] = max(self._last_seen_us.get(index, 0), max(ts for ts, _ in newest.values()))
        # Newer samples at the same ratios are an equal reading (the sample time is not compared):
        # the last round's list, so that a scrape reuses the readings' encoding (issue 44).
        # Compared as (pid, smUtil) pairs, before a ProcessUtilization is made.
        ratios = sorted((pid, sm) for pid, (_, sm) in newest.items())
        return self._utilization.setdefault(index, Derived()).get(
            (), ratios, lambda: [ProcessUtilization(pid, _ratio(sm), newest[pid][0]) for pid, sm in ratios])

    # ------------------------------------------------------------------ GPM
    def _gpm_activity(self, nvml: Any, handle: Any, index: int) -> Dict[str, float]:
        """Activity ratios between the previous scrape's GPM sample and a new one."""
        if not self._gpm_is_supported(nvml, handle, index):
            return {}
        sample = self._gpm_spare.pop(index, None) or gpm_call(nvml.nvmlGpmSampleAlloc)
        try:
            gpm_call(nvml.nvmlGpmSampleGet, handle, sample)
        except nvml.NVMLError:
            self._free_sample(nvml, sample)
            raise
        previous = self._gpm_prev.pop(index, None)
        self._gpm_prev[index] = sample
        if previous is None:
            return {}  # first sample: no interval yet
        try:
            return self._gpm_metrics(nvml, previous, sample)
        finally:
            self._gpm_spare[index] = previous

    def _gpm_is_supported(self, nvml: Any, handle: Any, index: int) -> bool:
        if index not in self._gpm_supported:
            if not hasattr(nvml, "nvmlGpmQueryDeviceSupport"):  # nvidia-ml-py older than 12.520
                self._gpm_supported[index] = False
            else:
                try:
                    support = gpm_call(nvml.nvmlGpmQueryDeviceSupport, handle)
                    self._gpm_supported[index] = bool(support.isSupportedDevice)
                except nvml.NVMLError as e:
                    if e.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                        raise  # transient: ask again next scrape
                    self._gpm_supported[index] = False
        return self._gpm_supported[index]

    @staticmethod
    def _gpm_metrics(nvml: Any, sample1: Any, sample2: Any) -> Dict[str, float]:
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = sample1
        request.sample2 = sample2
        for slot, (_key, constant) in enumerate(GPM_METRICS):
            request.metrics[slot].metricId = getattr(nvml, constant)
        gpm_call(nvml.nvmlGpmMetricsGet, request)
        activity: Dict[str, float] = {}
        for slot, (key, _constant) in enumerate(GPM_METRICS):
            metric = request.metrics[slot]
            if metric.nvmlReturn == nvml.NVML_SUCCESS and math.isfinite(metric.value):
                activity[key] = _ratio(metric.value)
        return activity

    @staticmethod
    def _free_sample(nvml: Any, sample: Any) -> None:
        try:
            gpm_call(nvml.nvmlGpmSampleFree, sample)
        except nvml.NVMLError as e:
            log.debug("nvmlGpmSampleFree failed: %s", e)


class NvmlSourceSpec(Source[NvmlReading]):
    name = "nvml"
    help = "GPUs, their compute and MPS process lists, per-process SM utilization, GPM activity"
    reading_type = NvmlReading
    background = True

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[NvmlReading]]:
        source = NvmlClient(backends.nvml_module, wait_for_every_answer=backends.nvml_wait_for_every_answer)
        return Reader(lambda ctx: source.read(), close=source.close, source=source)

    def store(self, snap: Snapshot, reading: NvmlReading) -> None:
        snap.nvml = reading

    def shift(self, reading: NvmlReading, seconds: float) -> NvmlReading:
        micros = round(seconds * 1e6)  # NVML's sample times
        return dataclasses.replace(reading, gpus=[
            dataclasses.replace(g, process_utilization=[dataclasses.replace(u, timestamp_us=u.timestamp_us + micros)
                                                        for u in g.process_utilization])
            for g in reading.gpus])


SOURCE = NvmlSourceSpec()
