"""DCGM source (optional): SM active, SM occupancy, tensor and DRAM activity.

Reads DCGM's profiling fields by number through `DcgmReader`, the helper class
that ships with DCGM's Python bindings (DCGM 3.x: /usr/local/dcgm/bindings/python3,
4.x: /usr/share/datacenter-gpu-manager-4/bindings/python3). The bindings are not
on PyPI; this module imports them from those directories when present, and the
exporter falls back to NVML GPM without them. The collector prefers these values
over GPM: DCGM is what the rest of a fleet's dashboards usually show.

`DcgmReader` connects to nv-hostengine (never an embedded engine: that would
load DCGM inside the exporter), watches the fields, and returns the latest
value per GPU and field id from `GetLatestGpuValuesAsFieldIdDict()`. It skips
blank values itself; values are checked again here because a reader built with
`ignoreBlank=False` (DCGM 4.x) hands the sentinels through.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from ..config import DEFAULT_DCGM_BINDINGS, Config
from ..model import DcgmReading, Snapshot
from .base import Backends, Flag, Reader, Source, not_empty

log = logging.getLogger(__name__)

# DCGM profiling field id -> GpuReading.activity key. All four are ratios 0..1.
PROFILING_FIELDS: Dict[int, str] = {
    1002: "sm_active",  # DCGM_FI_PROF_SM_ACTIVE
    1003: "sm_occupancy",  # DCGM_FI_PROF_SM_OCCUPANCY
    1004: "tensor_active",  # DCGM_FI_PROF_PIPE_TENSOR_ACTIVE
    1005: "dram_active",  # DCGM_FI_PROF_DRAM_ACTIVE
}

# Blank sentinels of dcgmvalue.py: a value at or above the base is "no value"
# (plain blank, NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED are base + 0..3).
DCGM_FP64_BLANK = 140737488355328.0  # 2**47
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0

FIELD_GROUP_NAME = "mps_exporter_profiling"  # DcgmReader deletes a group of its own name first


class DcgmUnavailable(RuntimeError):
    """DCGM cannot be read in this scrape."""


def is_blank(value: Any) -> bool:
    """True for DCGM's blank sentinels and anything that is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True  # None, strings (DCGM_STR_BLANK and friends)
    if isinstance(value, int):  # int32 blanks arrive widened to int64 ones (DcgmValue.SetFromInt32)
        return value >= DCGM_INT64_BLANK
    return not math.isfinite(value) or value >= DCGM_FP64_BLANK


def activity_from_values(values: Mapping[int, Mapping[int, Any]]) -> Dict[int, Dict[str, float]]:
    """{gpu: {field id: value}} as DcgmReader returns it -> {gpu: {activity key: ratio}}."""
    out: Dict[int, Dict[str, float]] = {}
    for gpu, fields in values.items():
        activity = {key: float(fields[fid]) for fid, key in PROFILING_FIELDS.items()
                    if fid in fields and not is_blank(fields[fid])}
        out[int(gpu)] = activity
    return out


def import_reader_class(paths: Sequence[str]) -> "tuple[Optional[type], str]":
    """(DcgmReader class, '') from the first directory that imports, else (None, why)."""
    reasons = []
    for path in paths:
        if not os.path.isfile(os.path.join(path, "DcgmReader.py")):
            reasons.append(f"{path}: no DcgmReader.py")
            continue
        # The bindings import their siblings (pydcgm, dcgm_structs, ...) by plain
        # name, so the directory itself has to be on sys.path. Appended, so that
        # the bindings' generic module names cannot shadow anything of ours.
        added = path not in sys.path
        if added:
            sys.path.append(path)
        try:
            return importlib.import_module("DcgmReader").DcgmReader, ""
        except Exception as e:  # a broken install must not stop the exporter
            reasons.append(f"{path}: {type(e).__name__}: {e}")
            if added:
                sys.path.remove(path)
    return None, "; ".join(reasons) or "no bindings path given"


class DcgmClient:
    """`available()` says whether DCGM's bindings import; `read()` the activity per GPU."""

    def __init__(self, bindings_paths: Sequence[str] = DEFAULT_DCGM_BINDINGS,
                 reader_factory: Optional[Callable[..., Any]] = None, hostname: str = "localhost",
                 update_interval_seconds: float = 10.0, max_keep_age_seconds: float = 60.0) -> None:
        self.bindings_paths = tuple(bindings_paths)
        self.hostname = hostname
        self.update_interval_seconds = update_interval_seconds
        self.max_keep_age_seconds = max_keep_age_seconds
        self.unavailable_reason = ""
        self._factory = reader_factory
        self._imported = reader_factory is not None
        self._reader: Any = None

    def available(self) -> bool:
        """Can DcgmReader be imported (or was a factory given)? Imports at most once."""
        if not self._imported:
            self._imported = True
            self._factory, self.unavailable_reason = import_reader_class(self.bindings_paths)
            if self._factory is None:
                log.debug("DCGM bindings not available: %s", self.unavailable_reason)
        return self._factory is not None

    def _reader_instance(self) -> Any:
        if self._reader is None:
            factory = self._factory if self.available() else None
            if factory is None:
                raise DcgmUnavailable(f"DCGM Python bindings not found ({self.unavailable_reason})")
            # Keyword names of DcgmReader.__init__ (DCGM 3.x and 4.x). `ignoreBlank`
            # is left out: 3.x does not know it, and both skip blanks by default.
            self._reader = factory(
                hostname=self.hostname,
                fieldIds=list(PROFILING_FIELDS),
                updateFrequency=int(self.update_interval_seconds * 1_000_000),  # microseconds
                maxKeepAge=self.max_keep_age_seconds,
                fieldGroupName=FIELD_GROUP_NAME,
            )
        return self._reader

    def read(self) -> DcgmReading:
        """{DCGM GPU id: {sm_active, sm_occupancy, tensor_active, dram_active}}.

        DCGM GPU ids follow NVML's enumeration on ordinary hosts."""
        reader = self._reader_instance()
        try:
            values = reader.GetLatestGpuValuesAsFieldIdDict()
        except Exception as e:  # DCGMError and whatever a broken install raises
            raise DcgmUnavailable(f"DCGM read failed: {type(e).__name__}: {e}") from e
        if not values:
            # DcgmReader swallows "connection not valid", logs it and returns {}.
            raise DcgmUnavailable(f"DCGM returned no GPUs: is nv-hostengine running at {self.hostname}?")
        return activity_from_values(values)

    def close(self) -> None:
        if self._reader is not None:
            try:
                self._reader.Shutdown()
            except Exception as e:
                log.debug("DcgmReader.Shutdown failed: %s", e)
            self._reader = None


class DcgmSourceSpec(Source[DcgmReading]):
    name = "dcgm"
    help = "SM activity, occupancy, tensor and DRAM activity from DCGM (wins over NVML GPM)"
    default = "auto"
    reading_type = DcgmReading
    background = True
    flags = (Flag("--dcgm.bindings-path", "dcgm_bindings", "directory holding DCGM's Python bindings (repeatable; "
                  f"default: {' and '.join(DEFAULT_DCGM_BINDINGS)})", refuses=("",), repeatable=True,
                  check=lambda paths: tuple(not_empty(p) for p in paths)),)

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[DcgmReading]]:
        if cfg.collectors.get("nvml") is False:
            return None  # its values are joined into NVML's GPUs
        source = DcgmClient(cfg.dcgm_bindings)
        if cfg.collectors.get(self.name) is not True and not source.available():
            log.info("DCGM Python bindings not found in %s: SM activity comes from NVML GPM", list(cfg.dcgm_bindings))
            return None
        return Reader(lambda ctx: source.read(), close=source.close, source=source)

    def store(self, snap: Snapshot, reading: DcgmReading) -> None:
        snap.dcgm = reading


SOURCE = DcgmSourceSpec()
