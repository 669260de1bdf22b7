"""A test double of DCGM's Python bindings: `DcgmReader` and the hostengine behind it.

Modelled on NVIDIA/DCGM testing/python3 (DcgmReader.py, DcgmHandle.py,
dcgm_field_helpers.py, dcgmvalue.py), DCGM 3.x and 4.x:

- `DcgmReader(hostname='localhost', fieldIds=None, updateFrequency=10000000,
  maxKeepAge=3600.0, ignoreList=None, fieldGroupName='dcgm_fieldgroupData',
  gpuIds=None, entities=None, fieldIntervalMap=None[, ignoreBlank=True])`:
  `ignoreBlank` exists from DCGM 4.x on (`version=4`); 3.x rejects it. The
  constructor only stores its arguments; the first query connects.
- Connecting (`Reconnect`) makes a handle to nv-hostengine at `hostname`, creates
  the field group (deleting one of the same name first, as the real one does),
  watches the fields every `updateFrequency` us and learns each GPU's UUID.
- `GetLatestGpuValuesAsFieldIdDict()` -> {gpuId: {fieldId: value}} with plain
  values (`val.value`), the latest per field. Blank values (`val.isBlank`,
  computed as DcgmFieldValue does: FP64 >= DCGM_FP64_BLANK, INT64 >=
  DCGM_INT64_BLANK, strings "<<<...>>>") are skipped (always in 3.x; when
  `ignoreBlank` in 4.x). When the hostengine cannot be reached the reader catches
  DCGM_ST_CONNECTION_NOT_VALID, logs "Can't connection to nv-hostengine...",
  drops its handle and returns {}; other DCGMErrors propagate.

`install_bindings(directory, engine)` writes a bindings directory:
DcgmReader.py plus the sibling modules it imports by plain name (pydcgm,
dcgm_structs, dcgm_fields, dcgmvalue), so the import only works when the
directory is on sys.path, as with the real bindings. `FakeHostengine` is the
scenario: GPUs, field values (sentinels allowed), up or down.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

# --------------------------------------------------------- dcgmvalue.py
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0
DCGM_STR_BLANK = "<<<NULL>>>"
DCGM_INT64_NOT_FOUND = DCGM_INT64_BLANK + 1
DCGM_FP64_NOT_FOUND = DCGM_FP64_BLANK + 1.0
DCGM_FP64_NOT_SUPPORTED = DCGM_FP64_BLANK + 2.0
DCGM_FP64_NOT_PERMISSIONED = DCGM_FP64_BLANK + 3.0
DCGM_STR_NOT_SUPPORTED = "<<<NOT_SUPPORTED>>>"

# --------------------------------------------------------- dcgm_structs.py
DCGM_ST_OK = 0
DCGM_ST_CONNECTION_NOT_VALID = -21
DCGM_ST_LIBRARY_NOT_FOUND = -25
DCGM_OPERATION_MODE_AUTO = 1


class DCGMError(Exception):
    """dcgm_structs.DCGMError: `.value` is the DCGM_ST_* status."""

    def __init__(self, value: int):
        super().__init__(f"DCGM error {value}")
        self.value = value


_EXCEPTION_CLASSES: Dict[int, type] = {}


def dcgmExceptionClass(status: int) -> type:
    """One DCGMError subclass per status, like dcgm_structs.dcgmExceptionClass."""
    if status not in _EXCEPTION_CLASSES:
        _EXCEPTION_CLASSES[status] = type(f"DCGMError_{abs(status)}", (DCGMError,),
                                          {"__init__": lambda self: DCGMError.__init__(self, status)})
    return _EXCEPTION_CLASSES[status]


# --------------------------------------------------------- dcgm_fields.py
DCGM_FT_DOUBLE = "d"
DCGM_FT_INT64 = "i"
DCGM_FT_STRING = "s"
DCGM_FI_DEV_GPU_TEMP = 150
DCGM_FI_DEV_POWER_USAGE = 155
DCGM_FI_PROF_GR_ENGINE_ACTIVE = 1001
DCGM_FI_PROF_SM_ACTIVE = 1002
DCGM_FI_PROF_SM_OCCUPANCY = 1003
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE = 1004
DCGM_FI_PROF_DRAM_ACTIVE = 1005
# field id -> (tag, type) for the fields this double knows
FIELDS = {
    DCGM_FI_DEV_GPU_TEMP: ("gpu_temp", DCGM_FT_INT64),
    DCGM_FI_DEV_POWER_USAGE: ("power_usage", DCGM_FT_DOUBLE),
    DCGM_FI_PROF_GR_ENGINE_ACTIVE: ("gr_engine_active", DCGM_FT_DOUBLE),
    DCGM_FI_PROF_SM_ACTIVE: ("sm_active", DCGM_FT_DOUBLE),
    DCGM_FI_PROF_SM_OCCUPANCY: ("sm_occupancy", DCGM_FT_DOUBLE),
    DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: ("tensor_active", DCGM_FT_DOUBLE),
    DCGM_FI_PROF_DRAM_ACTIVE: ("dram_active", DCGM_FT_DOUBLE),
}

log = logging.getLogger("DcgmReader")


@dataclass
class FakeDcgmValue:
    """dcgm_field_helpers.DcgmFieldValue: ts, fieldId, fieldType, value, isBlank."""

    ts: int
    fieldId: int
    fieldType: str
    value: object
    isBlank: bool = field(init=False)

    def __post_init__(self):
        if self.value is None:
            self.isBlank = True
        elif self.fieldType == DCGM_FT_DOUBLE:
            self.value = float(self.value)
            self.isBlank = self.value >= DCGM_FP64_BLANK
        elif self.fieldType == DCGM_FT_INT64:
            self.value = int(self.value)
            self.isBlank = self.value >= DCGM_INT64_BLANK
        else:
            self.value = str(self.value)
            self.isBlank = self.value.startswith("<<<") and ">>>" in self.value


@dataclass
class FakeHostengine:
    """nv-hostengine as the reader sees it. Change `values` or `running` between reads."""

    gpus: Dict[int, str] = field(default_factory=dict)  # DCGM gpuId -> UUID
    values: Dict[int, Dict[int, object]] = field(default_factory=dict)  # gpuId -> fieldId -> latest value
    running: bool = True
    library_present: bool = True  # False: libdcgm.so cannot be loaded
    ts: int = 1795234906000000
    # Bookkeeping a test can assert on
    connections: List[str] = field(default_factory=list)  # hostnames connected to
    field_groups: Dict[str, List[int]] = field(default_factory=dict)
    watches: List[dict] = field(default_factory=list)
    generation: int = 0  # bumped on restart: older handles become invalid

    def restart(self) -> None:
        self.generation += 1
        self.running = True

    def connect(self, hostname: Optional[str]) -> int:
        if not self.library_present:
            raise dcgmExceptionClass(DCGM_ST_LIBRARY_NOT_FOUND)()
        if hostname is None:
            raise AssertionError("DcgmReader with hostname=None would start an embedded hostengine")
        if not self.running:
            raise dcgmExceptionClass(DCGM_ST_CONNECTION_NOT_VALID)()
        self.connections.append(hostname)
        return self.generation

    def latest(self, handle: int, gpu_ids: List[int], field_ids: List[int]) -> Dict[int, Dict[int, List[FakeDcgmValue]]]:
        """dcgmGroup.samples.GetLatest(fieldGroup).values for watched fields."""
        if not self.running or handle != self.generation:
            raise dcgmExceptionClass(DCGM_ST_CONNECTION_NOT_VALID)()
        out: Dict[int, Dict[int, List[FakeDcgmValue]]] = {}
        for gpu in gpu_ids:
            out[gpu] = {}
            for fid in field_ids:
                # A watched field without data yet reads as a blank of its type.
                kind = FIELDS.get(fid, ("", DCGM_FT_DOUBLE))[1]
                blank = {DCGM_FT_DOUBLE: DCGM_FP64_BLANK, DCGM_FT_INT64: DCGM_INT64_BLANK}.get(kind, DCGM_STR_BLANK)
                out[gpu][fid] = [FakeDcgmValue(self.ts, fid, kind, self.values.get(gpu, {}).get(fid, blank))]
        return out


class FakeDcgmReader:
    """DcgmReader of DCGM 4.x (ignoreBlank); `DcgmReader3` below is the 3.x signature."""

    engine: FakeHostengine  # set by reader_class()

    def __init__(self, hostname='localhost', fieldIds=None, updateFrequency=10000000,
                 maxKeepAge=3600.0, ignoreList=None, fieldGroupName='dcgm_fieldgroupData', gpuIds=None,
                 entities=None, fieldIntervalMap=None, ignoreBlank=True):
        self.m_dcgmHostName = hostname
        self.m_updateFreq = updateFrequency
        self.m_fieldGroupName = fieldGroupName
        self.m_publishFields = fieldIntervalMap if fieldIntervalMap is not None else {
            updateFrequency: fieldIds or [DCGM_FI_DEV_POWER_USAGE, DCGM_FI_DEV_GPU_TEMP]}
        self.m_ignoreBlank = ignoreBlank
        self.m_requestedGpuIds = gpuIds
        self.m_requestedEntities = entities
        self.m_dcgmIgnoreFields = ignoreList or []
        self.m_maxKeepAge = maxKeepAge
        self.m_dcgmHandle = None
        self.m_gpuIdToUUId: Dict[int, str] = {}
        self.m_fieldIdToInfo: Dict[int, str] = {}
        self.m_allFieldIds: List[int] = []
        self.m_lock = threading.Lock()

    def __enter__(self):
        return self

    def __exit__(self, type, value, traceback):
        self.Shutdown()

    def LogError(self, msg):
        log.error(msg)

    def SetDisconnected(self):
        self.m_dcgmHandle = None

    def Shutdown(self):
        with self.m_lock:
            self.SetDisconnected()

    def Reconnect(self):
        if self.m_dcgmHandle is not None:
            return
        self.m_dcgmHandle = self.engine.connect(self.m_dcgmHostName)
        gpu_ids = self.m_requestedGpuIds or sorted(self.engine.gpus)
        self.m_gpuIdToUUId = {g: self.engine.gpus[g] for g in gpu_ids}
        self.m_allFieldIds = []
        for interval, field_ids in self.m_publishFields.items():
            for fid in field_ids:
                if fid not in FIELDS:
                    raise DCGMError(-1)  # DCGM_ST_UNKNOWN_FIELD in the real reader
                self.m_fieldIdToInfo[fid] = FIELDS[fid][0]
                if fid not in self.m_allFieldIds:
                    self.m_allFieldIds.append(fid)
            self.engine.watches.append({"interval_us": interval, "maxKeepAge": self.m_maxKeepAge,
                                        "fieldIds": list(field_ids)})
        self.engine.field_groups.pop(self.m_fieldGroupName, None)  # "Remove our field group if it exists"
        self.engine.field_groups[self.m_fieldGroupName] = list(self.m_allFieldIds)

    def _skip(self, val: FakeDcgmValue) -> bool:
        return val.isBlank and self.m_ignoreBlank

    def GetLatestGpuValuesAsDict(self, mapById):
        systemDictionary = {}
        with self.m_lock:
            try:
                self.Reconnect()
                fvs = self.engine.latest(self.m_dcgmHandle, list(self.m_gpuIdToUUId), self.m_allFieldIds)
                for gpuId, gpuFv in fvs.items():
                    systemDictionary[gpuId] = {}
                    for fieldId, series in gpuFv.items():
                        val = series[-1]
                        if self._skip(val):
                            continue
                        key = fieldId if mapById else self.m_fieldIdToInfo[fieldId]
                        systemDictionary[gpuId][key] = val.value
            except dcgmExceptionClass(DCGM_ST_CONNECTION_NOT_VALID):
                self.LogError("Can't connection to nv-hostengine. Please verify that it is running.")
                self.SetDisconnected()
        return systemDictionary

    def GetLatestGpuValuesAsFieldIdDict(self):
        return self.GetLatestGpuValuesAsDict(True)

    def GetLatestGpuValuesAsFieldNameDict(self):
        return self.GetLatestGpuValuesAsDict(False)


class DcgmReader3(FakeDcgmReader):
    """DCGM 3.x: no `ignoreBlank` argument; blanks are always skipped."""

    def __init__(self, hostname='localhost', fieldIds=None, updateFrequency=10000000,
                 maxKeepAge=3600.0, ignoreList=None, fieldGroupName='dcgm_fieldgroupData', gpuIds=None,
                 entities=None, fieldIntervalMap=None):
        super().__init__(hostname, fieldIds, updateFrequency, maxKeepAge, ignoreList, fieldGroupName,
                         gpuIds, entities, fieldIntervalMap, ignoreBlank=True)


# ------------------------------------------------------------ installation
_INSTALLS: Dict[str, type] = {}  # bindings directory -> reader class bound to its engine


def reader_class(directory: str) -> type:
    """The DcgmReader class a generated bindings directory exports."""
    return _INSTALLS[directory]


def install_bindings(directory, engine: FakeHostengine, version: int = 4, broken: bool = False) -> Path:
    """Write a fake DCGM bindings directory bound to `engine`; returns its path.

    broken=True leaves out pydcgm.py, so `import DcgmReader` fails the way a
    partial install does.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = DcgmReader3 if version == 3 else FakeDcgmReader
    _INSTALLS[str(directory)] = type("DcgmReader", (base,), {"engine": engine})
    here = __name__
    modules = {
        "dcgmvalue.py": f"from {here} import DCGM_INT32_BLANK, DCGM_INT64_BLANK, DCGM_FP64_BLANK, DCGM_STR_BLANK\n",
        "dcgm_structs.py": f"from {here} import DCGMError, dcgmExceptionClass, DCGM_ST_OK, "
                           "DCGM_ST_CONNECTION_NOT_VALID, DCGM_OPERATION_MODE_AUTO\n",
        "dcgm_fields.py": f"from {here} import DCGM_FI_PROF_SM_ACTIVE, DCGM_FI_PROF_SM_OCCUPANCY, "
                          "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, DCGM_FI_PROF_DRAM_ACTIVE\n",
        "pydcgm.py": "import dcgm_structs  # sibling, as in the real bindings\n",
        "DcgmReader.py": (
            "# Generated by tests/fakes/fake_dcgm.py. Like DCGM's own DcgmReader.py it imports\n"
            "# its siblings by plain name, so it loads only with this directory on sys.path.\n"
            "import pydcgm\nimport dcgm_structs\nimport dcgm_fields\nimport dcgmvalue\n"
            f"from {here} import reader_class as _reader_class\n"
            f"DcgmReader = _reader_class({str(directory)!r})\n"
        ),
    }
    if broken:
        del modules["pydcgm.py"]
    for name, text in modules.items():
        (directory / name).write_text(text)
    return directory


BINDING_MODULES = ("DcgmReader", "pydcgm", "dcgm_structs", "dcgm_fields", "dcgmvalue")
