"""A fake `pynvml` module: the NVML boundary for tests, the benchmark and replay.

`FakeNvml` is an object that stands in for the module: the source calls
`fake.nvmlInit()`, catches `fake.NVMLError`, reads `fake.NVML_ERROR_NOT_FOUND`,
exactly as with the real `pynvml` of nvidia-ml-py. Names, signatures, error codes
and the attribute names of returned structs are those of nvidia-ml-py 13.x
(tests/test_source_nvml.py checks every constant and function name against the
installed pynvml).

Constructors:
    FakeNvml.from_capture("busy")              # idle | busy | many: the H200 capture's NVML answers
    FakeNvml.from_capture("many", latency=True) # each call sleeps the capture's measured `us`
    FakeNvml.synthetic(gpus=8, clients_per_gpu=6)            # one MPS server, N x M clients
    FakeNvml.synthetic(gpus=2, clients_per_gpu=3, mps=False) # time-sliced processes, no MPS
    FakeNvml.no_driver()                       # nvmlInit raises NVML_ERROR_DRIVER_NOT_LOADED
    FakeNvml([FakeGpu(...), ...])              # anything else

Scenario knobs (plain attributes, change them between reads):
    fake.gpus[i]          a FakeGpu: name, memory, processes, utilization, GPM, errors
    fake.gpus[i].errors   {"nvmlDeviceGetPowerUsage": NVML_ERROR_NOT_SUPPORTED} or {"*": NVML_ERROR_GPU_IS_LOST}
    fake.errors           system calls: {"nvmlInit": NVML_ERROR_LIBRARY_NOT_FOUND}
    fake.latency_us       {"nvmlDeviceGetPowerUsage": 1596.0, ...}: sleep per call
    fake.driver_before_r510  unversioned process calls raise NVMLLibraryMismatchError, _v2 work
    fake.advance(seconds) time passes: GPM counters integrate each GPU's `gpm_percent`,
                          and every PID in `sm_util_by_pid` gets a new utilization sample
    fake.calls            Counter of calls by function name
    fake.live_gpm_samples GPM samples allocated and not yet freed
    fake.gpm_overlaps     (inside, entering) pairs of GPM calls that ran at the same time:
                          the driver crashes there (issue 38), so the fake raises
                          GpmCallsOverlap in the entering call and records the pair
    fake.gpm_hold_s       each nvmlGpmSampleGet stays inside this long, or until a second
                          GPM call enters: an overlap then shows in every run, not by luck
    fake.inject_xid(i, code)  an Xid on GPU i: every live event set that registered GPU i for
                          nvmlEventTypeXidCriticalError gets it (a queue its nvmlEventSetWait_v2 takes
                          from, waiting at most its timeout); 0 sets took it: nobody is listening
    fake.gpus[i].errors["nvmlDeviceRegisterEvents"] = NVML_ERROR_NOT_SUPPORTED  a GPU without events
    fake.event_sets       every set created (`.freed`, `.registered`: GPU index -> event types)

Process utilization behaves like NVML's: samples newer than the `timeStamp`
argument, NVML_ERROR_NOT_FOUND when there are none (the capture's idle answer).
GPM metrics are computed from the two samples' counters over their interval;
the capture recorded no GPM figures, so captured GPUs start at 0 % activity.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import threading
import time
from collections import Counter
from ctypes import Structure, c_uint, c_ulonglong
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Iterable, List, Optional, Tuple

from tests.support.data import CAPTURE  # noqa: E402

# ----------------------------------------------------------- pynvml constants
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
NVML_TEMPERATURE_GPU = 0
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)

NVML_GPM_METRIC_GRAPHICS_UTIL = 1
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_INTEGER_UTIL = 4
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_FP64_UTIL = 11
NVML_GPM_METRIC_FP32_UTIL = 12
NVML_GPM_METRIC_FP16_UTIL = 13
NVML_GPM_METRIC_MAX = 477
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1

# NVML event types (pynvml names them without the NVML_ prefix).
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeDoubleBitEccError = 0x0000000000000002

# pynvml's messages for the codes above (NVMLError.__str__).
_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

# Metrics an H200 answers through GPM (the fake answers NOT_SUPPORTED for others).
_GPM_KNOWN_METRICS = frozenset(
    (NVML_GPM_METRIC_GRAPHICS_UTIL, NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_SM_OCCUPANCY,
     NVML_GPM_METRIC_INTEGER_UTIL, NVML_GPM_METRIC_ANY_TENSOR_UTIL, NVML_GPM_METRIC_DRAM_BW_UTIL,
     NVML_GPM_METRIC_FP64_UTIL, NVML_GPM_METRIC_FP32_UTIL, NVML_GPM_METRIC_FP16_UTIL))

_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG, as captured
_RESERVED_BYTES = 644939776  # memory NVML counts as used on the idle H200
# The most of a synthetic GPU's memory its clients hold (FakeNvml.synthetic): real clients fit.
MAX_CLIENT_SHARE = 0.8
_UTIL_SAMPLE_BUFFER = 100  # NVML keeps a bounded ring of samples per GPU


# ------------------------------------------------------------------- errors
class NVMLError(Exception):
    """pynvml.NVMLError: `.value` is the code; NVMLError(code) returns the code's subclass."""

    _valClassMapping: Dict[int, type] = {}

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, *args):
        super().__init__(*args)

    def __str__(self):
        return _ERROR_STRINGS.get(self.value, "NVML Error with code %d" % self.value)


def _error_classes() -> Dict[str, type]:
    """NVMLError_NotFound etc., named the way pynvml names them."""
    classes = {}
    for name, code in list(globals().items()):
        if not name.startswith("NVML_ERROR_"):
            continue
        class_name = "NVMLError_" + "".join(w.capitalize() for w in name[len("NVML_ERROR_"):].split("_"))

        def new(cls, *args, _code=code):
            return NVMLError.__new__(cls, _code)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        NVMLError._valClassMapping[code] = cls
        classes[class_name] = cls
    return classes


class GpmCallsOverlap(AssertionError):
    """Two NVML GPM calls ran at once: on driver 580 the process dies of SIGSEGV there."""


class NVMLLibraryMismatchError(Exception):
    """pynvml raises this (no NVMLError) when an unversioned call finds no _v3 in the driver."""


ERROR_CLASSES = _error_classes()
globals().update(ERROR_CLASSES)
_CODE_BY_CLASS_NAME = {name: cls().value for name, cls in ERROR_CLASSES.items()}


# ------------------------------------------------------- struct look-alikes
class _Struct:
    """Attribute bag standing in for pynvml's ctypes structs and friendly objects."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


# The ctypes structs the source fills through pynvml's C entry points (DirectLists):
# the same fields as pynvml's (test_source_nvml checks).
class c_nvmlProcessInfo_v2_t(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint)]


c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t


class c_nvmlProcessUtilizationSample_t(Structure):
    _fields_ = [("pid", c_uint), ("timeStamp", c_ulonglong), ("smUtil", c_uint), ("memUtil", c_uint),
                ("encUtil", c_uint), ("decUtil", c_uint)]


class c_nvmlGpmMetric_t(_Struct):
    def __init__(self):
        super().__init__(metricId=0, nvmlReturn=0, value=0.0, metricInfo=None)


class _MetricArray:
    """The struct's fixed array of NVML_GPM_METRIC_MAX slots, built on first touch."""

    def __init__(self):
        self._slots: Dict[int, c_nvmlGpmMetric_t] = {}

    def __getitem__(self, i: int) -> c_nvmlGpmMetric_t:
        if not 0 <= i < NVML_GPM_METRIC_MAX:
            raise IndexError("invalid index")
        return self._slots.setdefault(i, c_nvmlGpmMetric_t())

    def __len__(self):
        return NVML_GPM_METRIC_MAX


class c_nvmlGpmMetricsGet_t(_Struct):
    def __init__(self):
        super().__init__(version=0, numMetrics=0, sample1=None, sample2=None, metrics=_MetricArray())


@dataclass(eq=False)
class FakeGpmSample:
    """An opaque sample from nvmlGpmSampleAlloc; filled by nvmlGpmSampleGet."""

    gpu_index: Optional[int] = None
    time_us: int = 0
    counters: Dict[int, float] = field(default_factory=dict)  # metric id -> percent x seconds
    freed: bool = False


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass(eq=False)
class FakeEventSet:
    """An opaque set from nvmlEventSetCreate: the events waiting for nvmlEventSetWait_v2."""

    registered: Dict[int, int] = field(default_factory=dict)  # GPU index -> event types registered
    events: "queue.Queue[_Struct]" = field(default_factory=queue.Queue)
    freed: bool = False


# --------------------------------------------------------------- the model
@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: Optional[int]
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


@dataclass
class FakeUtilSample:
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int = 0
    encUtil: int = 0
    decUtil: int = 0


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-4000-8000-000000000000"
    compute_mode: int = NVML_COMPUTEMODE_DEFAULT
    mig_mode: Optional[Tuple[int, int]] = (0, 0)  # None: a GPU without MIG (NOT_SUPPORTED)
    memory_total: int = 150754820096
    memory_used: int = _RESERVED_BYTES
    util_gpu: int = 0
    util_memory: int = 0
    power_mw: int = 78707
    temperature: int = 38
    compute_processes: List[FakeProcess] = field(default_factory=list)
    mps_processes: List[FakeProcess] = field(default_factory=list)
    util_samples: List[FakeUtilSample] = field(default_factory=list)
    # pid -> (smUtil, memUtil) in percent; advance() records a sample for each.
    sm_util_by_pid: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    gpm_supported: bool = True
    # GPM metric id -> current activity in percent; advance() integrates it.
    gpm_percent: Dict[int, float] = field(default_factory=dict)
    gpm_counters: Dict[int, float] = field(default_factory=dict)
    # function name (or "*" for every call on this GPU) -> NVML error code to raise
    errors: Dict[str, int] = field(default_factory=dict)


# Capture JSON key -> the pynvml function whose latency it measured, and how many
# calls the probe made for it (its `util` lambda called nvmlDeviceGetUtilizationRates twice).
CAPTURE_LATENCY_KEYS: Dict[str, Tuple[str, int]] = {
    "driver": ("nvmlSystemGetDriverVersion", 1),
    "count": ("nvmlDeviceGetCount", 1),
    "name": ("nvmlDeviceGetName", 1),
    "uuid": ("nvmlDeviceGetUUID", 1),
    "compute_mode": ("nvmlDeviceGetComputeMode", 1),
    "util": ("nvmlDeviceGetUtilizationRates", 2),
    "mem": ("nvmlDeviceGetMemoryInfo", 1),
    "compute_procs": ("nvmlDeviceGetComputeRunningProcesses", 1),
    "mps_procs": ("nvmlDeviceGetMPSComputeRunningProcesses", 1),
    "proc_util": ("nvmlDeviceGetProcessUtilization", 1),
    "temp": ("nvmlDeviceGetTemperature", 1),
    "power_mw": ("nvmlDeviceGetPowerUsage", 1),
    "mig_mode": ("nvmlDeviceGetMigMode", 1),
}


def load_capture(name: str) -> dict:
    """The probe's JSON for `idle`, `busy` or `many`."""
    return json.loads((CAPTURE / "nvml" / f"nvml_{name}.json").read_text())


def capture_latency_us(doc: dict) -> Dict[str, float]:
    """Per-call latency (us) by pynvml function name, from a capture document."""
    return {fn: doc[key]["us"] / calls for key, (fn, calls) in CAPTURE_LATENCY_KEYS.items() if key in doc}


def _captured_error(entry: dict) -> Optional[int]:
    """'ERR NVMLError_NotFound: Not Found' -> NVML_ERROR_NOT_FOUND; None if the call succeeded."""
    if entry.get("ok", True):
        return None
    class_name = str(entry["v"]).split()[1].rstrip(":")
    return _CODE_BY_CLASS_NAME.get(class_name, NVML_ERROR_UNKNOWN)


def _processes(rows: Iterable[dict]) -> List[FakeProcess]:
    return [FakeProcess(r["pid"], r["usedGpuMemory"], r.get("gpuInstanceId", _NO_INSTANCE),
                        r.get("computeInstanceId", _NO_INSTANCE)) for r in rows]


def _uuid(index: int) -> str:
    return f"GPU-{index:08x}-0000-4000-8000-{index:012x}"


# Synthetic clock start: 2026-11-21 04:21:26 UTC, when the captured daemon started.
_EPOCH_US = 1795234886_000000


class FakeNvml:
    """Module-like stand-in for pynvml. See the module docstring."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t
    c_nvmlGpmMetric_t = c_nvmlGpmMetric_t
    c_nvmlProcessInfo_v2_t = c_nvmlProcessInfo_v2_t
    c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v3_t
    c_nvmlProcessUtilizationSample_t = c_nvmlProcessUtilizationSample_t

    def __init__(self, gpus: List[FakeGpu], driver_version: str = "580.159.04",
                 errors: Optional[Dict[str, int]] = None, latency_us: Optional[Dict[str, float]] = None,
                 clock_us: int = _EPOCH_US) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.errors: Dict[str, int] = dict(errors or {})
        self.latency_us: Dict[str, float] = dict(latency_us or {})
        # (function, GPU index or -1) -> seconds the call takes; wins over latency_us
        # (the scrape benchmark replays a recorded storm through it).
        self.latency_of: Optional[Callable[[str, int], float]] = None
        self.clock_us = clock_us
        self.calls: Counter = Counter()
        self.live_gpm_samples: List[FakeGpmSample] = []
        # pynvml turns NVML_VALUE_NOT_AVAILABLE into None; False passes the raw value on.
        self.convert_not_available = True
        # A driver before R510: no _v3 process calls, so pynvml's unversioned ones fail.
        self.driver_before_r510 = False
        # False: a pynvml without the C entry point lookup (the source then calls the
        # public list functions above).
        self.entry_points = True
        self.entry_point_calls: Counter = Counter()  # C entry point -> calls
        self._init_count = 0
        self.gpm_overlaps: List[Tuple[str, str]] = []
        self.gpm_hold_s = 0.0
        self._gpm_guard = threading.Condition()
        self._gpm_inside: Optional[str] = None
        self.event_sets: List[FakeEventSet] = []

    # ---------------------------------------------------------- scenarios
    @classmethod
    def from_capture(cls, name: str, latency: bool = False) -> "FakeNvml":
        """The NVML view of the H200 capture: `idle`, `busy` (3 MPS clients) or `many` (30)."""
        doc = load_capture(name)
        v = {key: entry["v"] for key, entry in doc.items() if isinstance(entry, dict) and "v" in entry}
        gpu = FakeGpu(
            name=v["name"], uuid=v["uuid"], compute_mode=v["compute_mode"], mig_mode=tuple(v["mig_mode"]),
            memory_total=v["mem"]["total"], memory_used=v["mem"]["used"],
            util_gpu=v["util_gpu"], util_memory=v["util_mem"], power_mw=v["power_mw"], temperature=v["temp"],
            compute_processes=_processes(v["compute_procs"]), mps_processes=_processes(v["mps_procs"]),
        )
        clock = _EPOCH_US
        if _captured_error(doc["proc_util"]) is None:
            for s in v["proc_util"]:
                gpu.util_samples.append(FakeUtilSample(**s))
                gpu.sm_util_by_pid[s["pid"]] = (s["smUtil"], s["memUtil"])
                clock = max(clock, s["timeStamp"])
        # Any other recorded failure replays as that error (NOT_FOUND of proc_util
        # needs no injection: it follows from there being no samples).
        for key, (fn, _calls) in CAPTURE_LATENCY_KEYS.items():
            code = _captured_error(doc.get(key, {}))
            if code is not None and not (key == "proc_util" and code == NVML_ERROR_NOT_FOUND):
                gpu.errors[fn] = code
        return cls([gpu], driver_version=v["driver"], clock_us=clock,
                   latency_us=capture_latency_us(doc) if latency else None)

    @classmethod
    def synthetic(cls, gpus: int = 8, clients_per_gpu: int = 6, mps: bool = True,
                  server_pid: int = 4000, client_memory: int = 512 << 20) -> "FakeNvml":
        """`gpus` busy GPUs with `clients_per_gpu` clients each.

        mps=True: one MPS server (`server_pid`, on every GPU, 66 MiB as captured)
        and clients listed by both process calls; NVML's utilization goes to the
        server only, as the capture shows. mps=False: plain time-sliced processes,
        utilization split between them. Client k on GPU g has pid
        10000 + g * clients_per_gpu + k and holds (k + 1) * client_memory bytes, less where
        that would not fit: the clients of a GPU hold at most MAX_CLIENT_SHARE of its memory
        (48 clients at 512 MiB steps would be 4.2 times an H200's).
        """
        fake = cls([])
        steps = clients_per_gpu * (clients_per_gpu + 1) // 2
        if steps:
            fitting = int(MAX_CLIENT_SHARE * FakeGpu.memory_total) // steps
            client_memory = min(client_memory, fitting >> 20 << 20)
        for g in range(gpus):
            clients = [FakeProcess(10000 + g * clients_per_gpu + k, (k + 1) * client_memory)
                       for k in range(clients_per_gpu)]
            gpu = FakeGpu(uuid=_uuid(g), power_mw=78707, temperature=38)
            if mps:
                server = FakeProcess(server_pid, 69206016)
                gpu.compute_processes = [server] + copy.deepcopy(clients) if clients else []
                gpu.mps_processes = clients
                if clients:
                    gpu.sm_util_by_pid = {server_pid: (93, 3)}
            else:
                gpu.compute_processes = clients
                gpu.sm_util_by_pid = {p.pid: (90 // len(clients), 2) for p in clients}
            if clients:
                gpu.util_gpu, gpu.util_memory = 100, 6
                gpu.power_mw, gpu.temperature = 699221, 60
                gpu.gpm_percent = {NVML_GPM_METRIC_SM_UTIL: 60.0, NVML_GPM_METRIC_SM_OCCUPANCY: 30.0,
                                   NVML_GPM_METRIC_ANY_TENSOR_UTIL: 10.0, NVML_GPM_METRIC_DRAM_BW_UTIL: 20.0}
            gpu.memory_used = _RESERVED_BYTES + sum(p.usedGpuMemory or 0 for p in gpu.compute_processes)
            fake.gpus.append(gpu)
        fake.advance(1.0)  # one utilization sample per busy process
        return fake

    @classmethod
    def no_driver(cls, code: int = NVML_ERROR_DRIVER_NOT_LOADED) -> "FakeNvml":
        """nvmlInit fails: DRIVER_NOT_LOADED (no driver) or LIBRARY_NOT_FOUND (no libnvidia-ml)."""
        return cls([], errors={"nvmlInit": code})

    def advance(self, seconds: float) -> None:
        """Let time pass: integrate GPM activity and record utilization samples."""
        self.clock_us += int(seconds * 1e6)
        for gpu in self.gpus:
            for metric, percent in gpu.gpm_percent.items():
                gpu.gpm_counters[metric] = gpu.gpm_counters.get(metric, 0.0) + percent * seconds
            for pid, (sm, mem) in gpu.sm_util_by_pid.items():
                if sm or mem:  # NVML reports processes with non-zero utilization only
                    gpu.util_samples.append(FakeUtilSample(pid, self.clock_us, sm, mem))
            del gpu.util_samples[:-_UTIL_SAMPLE_BUFFER]

    # ------------------------------------------------------------ plumbing
    def _enter(self, fn: str, handle: Optional[FakeHandle] = None) -> Optional[FakeGpu]:
        """Count, sleep the injected latency, raise injected errors; the handle's GPU."""
        self.calls[fn] += 1
        if self.latency_of is not None:
            gpu_index = handle.index if isinstance(handle, FakeHandle) else -1
            time.sleep(self.latency_of(fn, gpu_index))
        elif self.latency_us.get(fn):
            time.sleep(self.latency_us[fn] / 1e6)
        if fn in self.errors:
            raise NVMLError(self.errors[fn])
        if self._init_count == 0 and fn != "nvmlInit":
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        code = gpu.errors.get(fn, gpu.errors.get("*"))
        if code is not None:
            raise NVMLError(code)
        return gpu

    def _process_list(self, processes: List[FakeProcess]) -> List[_Struct]:
        out = []
        for p in processes:
            used = p.usedGpuMemory
            if self.convert_not_available and used == NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                used = None
            out.append(_Struct(pid=p.pid, usedGpuMemory=used, gpuInstanceId=p.gpuInstanceId,
                               computeInstanceId=p.computeInstanceId))
        return out

    # ------------------------------------------------------ pynvml: system
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        handle = FakeHandle(index)
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    # ------------------------------------------------------ pynvml: device
    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetComputeMode(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetComputeMode", handle).compute_mode

    def nvmlDeviceGetMigMode(self, device: FakeHandle) -> List[int]:
        gpu = self._enter("nvmlDeviceGetMigMode", device)
        if gpu.mig_mode is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.mig_mode)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version=None) -> _Struct:
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        return _Struct(total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used, used=gpu.memory_used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> _Struct:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return _Struct(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        gpu = self._enter("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def _versioned(self, fn: str, handle: FakeHandle, unversioned: bool) -> FakeGpu:
        gpu = self._enter(fn, handle)
        if unversioned and self.driver_before_r510:
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match "
                                           f"the NVML lib version. ... use a versioned function such as {fn}_v2")
        return gpu

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> List[_Struct]:
        gpu = self._versioned("nvmlDeviceGetComputeRunningProcesses", handle, True)
        return self._process_list(gpu.compute_processes)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> List[_Struct]:
        gpu = self._versioned("nvmlDeviceGetComputeRunningProcesses_v2", handle, False)
        return self._process_list(gpu.compute_processes)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> List[_Struct]:
        gpu = self._versioned("nvmlDeviceGetMPSComputeRunningProcesses", handle, True)
        return self._process_list(gpu.mps_processes)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: FakeHandle) -> List[_Struct]:
        gpu = self._versioned("nvmlDeviceGetMPSComputeRunningProcesses_v2", handle, False)
        return self._process_list(gpu.mps_processes)

    def nvmlDeviceGetProcessUtilization(self, handle: FakeHandle, timeStamp: int) -> List[_Struct]:
        gpu = self._enter("nvmlDeviceGetProcessUtilization", handle)
        newer = [s for s in gpu.util_samples if s.timeStamp > timeStamp]
        if not newer:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return [_Struct(**s.__dict__) for s in newer]

    # ------------------------------------------------ pynvml: C entry points
    def __getattr__(self, name: str):
        if name == "_nvmlGetFunctionPointer" and self.__dict__.get("entry_points", True):
            return self._function_pointer
        raise AttributeError(name)

    def _function_pointer(self, name: str) -> Callable[..., int]:
        """pynvml's `_nvmlGetFunctionPointer`: the C entry point `name`, as a callable over
        ctypes arguments with NVML's return codes (count in, count out; INSUFFICIENT_SIZE
        with the count needed when the buffer is missing or short). Counted, slowed and
        failed as the public function of the same list (`calls`, `latency_us`, `errors`)."""
        if name.endswith("_v3") and self.driver_before_r510:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        public = name[:-3] if name.endswith("_v3") else name
        if public in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
                      "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2"):
            def processes(handle, count_ref, infos) -> int:
                gpu = self._versioned(public, handle, False)
                listed = gpu.mps_processes if "MPS" in public else gpu.compute_processes
                rows = [(p.pid, p.usedGpuMemory) for p in listed]
                return self._into(name, rows, count_ref, infos, ("pid", "usedGpuMemory"))
            return self._c_call(processes)
        if name == "nvmlDeviceGetProcessUtilization":
            def utilization(handle, samples, count_ref, time_stamp) -> int:
                gpu = self._enter(name, handle)
                newer = [(s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil)
                         for s in gpu.util_samples if s.timeStamp > time_stamp.value]
                if not newer and samples is not None:
                    return NVML_ERROR_NOT_FOUND
                return self._into(name, newer, count_ref, samples,
                                  ("pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil"))
            return self._c_call(utilization)
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)

    @staticmethod
    def _c_call(fn: Callable[..., int]) -> Callable[..., int]:
        def call(*args) -> int:
            try:
                return fn(*args)
            except NVMLError as e:  # C reports errors as return codes
                return e.value
        return call

    def _into(self, name: str, rows: List[tuple], count_ref, buffer, fields: Tuple[str, ...]) -> int:
        self.entry_point_calls[name] += 1
        count = count_ref._obj
        if buffer is None or count.value < len(rows):
            count.value = len(rows)
            return NVML_ERROR_INSUFFICIENT_SIZE if rows else NVML_SUCCESS
        for slot, row in zip(buffer, rows):
            for key, value in zip(fields, row):
                setattr(slot, key, NVML_VALUE_NOT_AVAILABLE_ulonglong.value if value is None else value)
        count.value = len(rows)
        return NVML_SUCCESS

    # ------------------------------------------------------ pynvml: events
    def inject_xid(self, index: int, xid: int, eventType: int = nvmlEventTypeXidCriticalError) -> int:
        """An event on GPU `index`, queued in every live set registered for its type; how many."""
        taken = 0
        for event_set in self.event_sets:
            if not event_set.freed and event_set.registered.get(index, 0) & eventType:
                event_set.events.put(_Struct(device=FakeHandle(index), eventType=eventType, eventData=xid,
                                             gpuInstanceId=_NO_INSTANCE, computeInstanceId=_NO_INSTANCE))
                taken += 1
        return taken

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        if not isinstance(eventSet, FakeEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        eventSet.registered[handle.index] = eventSet.registered.get(handle.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> _Struct:
        """The next event, waiting at most `timeoutms`; NVML_ERROR_TIMEOUT where none came."""
        self._enter("nvmlEventSetWait_v2")
        if not isinstance(eventSet, FakeEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        try:
            return eventSet.events.get(timeout=timeoutms / 1000.0) if timeoutms else eventSet.events.get_nowait()
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        if not isinstance(eventSet, FakeEventSet) or eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        eventSet.freed = True

    # --------------------------------------------------------- pynvml: GPM
    @contextlib.contextmanager
    def _gpm(self, fn: str, hold_s: float = 0.0) -> Iterator[None]:
        """Inside one GPM call: a second one entering meanwhile is the driver's crash."""
        with self._gpm_guard:
            if self._gpm_inside is not None:
                self.gpm_overlaps.append((self._gpm_inside, fn))
                self._gpm_guard.notify_all()
                raise GpmCallsOverlap(f"{fn} called while {self._gpm_inside} ran (SIGSEGV on driver 580)")
            self._gpm_inside = fn
        try:
            if hold_s:
                with self._gpm_guard:
                    self._gpm_guard.wait_for(lambda: bool(self.gpm_overlaps), timeout=hold_s)
            yield
        finally:
            with self._gpm_guard:
                self._gpm_inside = None

    def nvmlGpmQueryDeviceSupport(self, device: FakeHandle) -> _Struct:
        with self._gpm("nvmlGpmQueryDeviceSupport"):
            gpu = self._enter("nvmlGpmQueryDeviceSupport", device)
            return _Struct(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(gpu.gpm_supported))

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        with self._gpm("nvmlGpmSampleAlloc"):
            self._enter("nvmlGpmSampleAlloc")
            sample = FakeGpmSample()
            self.live_gpm_samples.append(sample)
            return sample

    def nvmlGpmSampleFree(self, gpmSample: FakeGpmSample) -> None:
        with self._gpm("nvmlGpmSampleFree"):
            self._enter("nvmlGpmSampleFree")
            if gpmSample.freed or gpmSample not in self.live_gpm_samples:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            gpmSample.freed = True
            self.live_gpm_samples.remove(gpmSample)

    def nvmlGpmSampleGet(self, device: FakeHandle, gpmSample: FakeGpmSample) -> FakeGpmSample:
        with self._gpm("nvmlGpmSampleGet", self.gpm_hold_s):
            return self._gpm_sample_get(device, gpmSample)

    def _gpm_sample_get(self, device: FakeHandle, gpmSample: FakeGpmSample) -> FakeGpmSample:
        gpu = self._enter("nvmlGpmSampleGet", device)
        if gpmSample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.gpm_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        gpmSample.gpu_index = device.index
        gpmSample.time_us = self.clock_us
        gpmSample.counters = dict(gpu.gpm_counters)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        with self._gpm("nvmlGpmMetricsGet"):
            return self._gpm_metrics_get(metricsGet)

    def _gpm_metrics_get(self, metricsGet: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        self._enter("nvmlGpmMetricsGet")
        if metricsGet.version != NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        s1, s2 = metricsGet.sample1, metricsGet.sample2
        for s in (s1, s2):
            if not isinstance(s, FakeGpmSample) or s.freed or s.gpu_index is None:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if s1.gpu_index != s2.gpu_index or s2.time_us <= s1.time_us or not 0 < metricsGet.numMetrics <= NVML_GPM_METRIC_MAX:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        seconds = (s2.time_us - s1.time_us) / 1e6
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in _GPM_KNOWN_METRICS:
                delta = s2.counters.get(metric.metricId, 0.0) - s1.counters.get(metric.metricId, 0.0)
                metric.nvmlReturn, metric.value = NVML_SUCCESS, delta / seconds
            else:
                metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
        return metricsGet


# The module's constants and error classes are attributes of the fake module object too.
for _name, _value in list(globals().items()):
    if _name.startswith(("NVML_", "NVMLError_", "nvmlEventType")):
        setattr(FakeNvml, _name, _value)
