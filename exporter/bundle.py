"""The capture bundle format (docs/capture-format.md), shared by `capture` and `replay`.

A bundle is one gzip-compressed JSON Lines file:

    {"kind": "header", "format": "mps-exporter-capture", "version": 1, ...}
    {"kind": "log", "t": 0.0, "daemon": "default", "file": "control.log", "text": "..."}
    {"kind": "scrape", "t": 0.01, "now": 1763700000.51, "sources": {...}, "durations": {...}}
    ...
    {"kind": "end", "t": 90.0, "scrapes": 91, "log_chunks": 40, "driver_version": "...", "gpus": [...]}

Events are in time order; `t` is seconds since the capture started. Source
results are the model dataclasses (model.py) as JSON; `decode()` rebuilds them
from the dataclasses' own type hints, so the format follows model.py without a
second schema to keep in sync.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import os
import re
import typing
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

from .model import DaemonReading, NvmlReading, ProcessFacts

FORMAT = "mps-exporter-capture"
VERSION = 1
SUFFIX = ".jsonl.gz"

# What each source's `read()` returns; "control" holds one entry per daemon.
SOURCE_TYPES: Dict[str, Any] = {
    "nvml": NvmlReading,
    "dcgm": Dict[int, Dict[str, float]],
    "control": DaemonReading,
    "proc": Dict[int, ProcessFacts],
}


class BundleError(Exception):
    """The bundle cannot be replayed; the message is one line for the user."""


# ------------------------------------------------------------------ values
def encode(value: Any) -> Any:
    """A source's result as JSON-ready data (int dict keys become strings, as JSON wants)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


_hints: Dict[type, Dict[str, Any]] = {}


def decode(tp: Any, value: Any) -> Any:
    """JSON data back into `tp` (a model dataclass, Optional, List, Dict or a scalar).

    Unknown keys are ignored (a newer exporter may add fields); a missing
    required field or a wrong type raises ValueError."""
    if dataclasses.is_dataclass(tp):
        hints = _hints.get(tp)
        if hints is None:
            hints = _hints[tp] = typing.get_type_hints(tp)
        obj = _expect(value, dict, tp.__name__)
        try:
            return tp(**{k: decode(hints[k], v) for k, v in obj.items() if k in hints})
        except TypeError as e:  # a required field is missing
            raise ValueError(f"{tp.__name__}: {e}") from e
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        return decode(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [decode(args[0], v) for v in _expect(value, list, "list")]
    if origin is dict:
        return {decode(args[0], k): decode(args[1], v) for k, v in _expect(value, dict, "object").items()}
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)  # dict keys arrive as strings
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if tp in (str, bool) and not isinstance(value, tp):
        raise ValueError(f"expected {tp.__name__}, got {value!r}")
    return value


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"expected {what}, got {type(value).__name__}")
    return value


def source_result(name: str, entry: Any) -> Any:
    """One recorded `{"value": ...}` or `{"error": "..."}` entry: the value, or a RecordedFailure."""
    entry = _expect(entry, dict, f"{name} entry")
    if "error" in entry:
        return RecordedFailure(str(entry["error"]))
    if "value" not in entry:
        raise ValueError(f"{name} entry has neither 'value' nor 'error'")
    return decode(SOURCE_TYPES[name], entry["value"])


class RecordedFailure(Exception):
    """The source raised this error at this moment of the capture."""


# ------------------------------------------------------------------ events
@dataclass
class Scrape:
    t: float
    now: float  # the collector's clock (unix time) at that moment
    # source name -> its result, or RecordedFailure; "control": one per daemon
    results: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LogChunk:
    t: float
    daemon: str
    file: str  # control.log or server.log
    data: bytes
    new_file: bool = False  # the file was replaced or truncated before these bytes


@dataclass
class Bundle:
    path: str
    header: Dict[str, Any]
    end: Dict[str, Any]
    scrapes: List[Scrape]
    logs: List[LogChunk]

    @property
    def duration(self) -> float:
        return float(self.end["t"])


def log_record(chunk: LogChunk) -> Dict[str, Any]:
    rec: Dict[str, Any] = {"kind": "log", "t": chunk.t, "daemon": chunk.daemon, "file": chunk.file}
    if chunk.new_file:
        rec["new_file"] = True
    try:  # readable text when the bytes are UTF-8, else base64: byte-exact either way
        rec["text"] = chunk.data.decode("utf-8")
    except UnicodeDecodeError:
        rec["base64"] = base64.b64encode(chunk.data).decode("ascii")
    return rec


# ------------------------------------------------------------------ writing
class BundleWriter:
    """Streams records into `path + ".partial"`, renamed to `path` by close():
    a capture that dies never leaves a file that looks complete."""

    def __init__(self, path: str, header: Dict[str, Any]) -> None:
        self.path = path
        self._partial = path + ".partial"
        self._file = gzip.open(self._partial, "wt", encoding="utf-8", compresslevel=9)
        self.write({"kind": "header", "format": FORMAT, "version": VERSION, **header})

    def write(self, record: Dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n")

    def close(self, end: Dict[str, Any]) -> None:
        self.write({"kind": "end", **end})
        self._file.close()
        os.replace(self._partial, self.path)


# ------------------------------------------------------------------ reading
def load(path: str) -> Bundle:
    """Read and check a whole bundle. Raises BundleError with one clear line."""
    header: Optional[Dict[str, Any]] = None
    end: Optional[Dict[str, Any]] = None
    scrapes: List[Scrape] = []
    logs: List[LogChunk] = []
    lineno = 0
    try:
        for lineno, rec in _records(path):
            kind = rec.get("kind")
            if header is None:
                header = _check_header(path, rec)
            elif end is not None:
                raise BundleError(f"{path}: damaged: line {lineno} follows the end record")
            elif kind == "scrape":
                scrapes.append(_scrape(rec))
            elif kind == "log":
                logs.append(_log_chunk(rec))
                if logs[-1].daemon not in {d["name"] for d in header["daemons"]}:
                    raise ValueError(f"log chunk of unknown daemon {logs[-1].daemon!r}")
            elif kind == "end":
                end = rec
            # other kinds: added by a later exporter without changing the version; skipped
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: damaged: line {lineno}: {e}") from e
    if header is None:
        raise BundleError(f"{path} is empty: not a capture bundle")
    if end is None or not isinstance(end.get("t"), (int, float)):
        raise BundleError(f"{path} is truncated: it stops after line {lineno} without its end record "
                          "(was the capture interrupted or the file cut short?)")
    if not scrapes:
        raise BundleError(f"{path} holds no reading of the sources: nothing to replay")
    return Bundle(path, header, end, sorted(scrapes, key=lambda s: s.t), sorted(logs, key=lambda c: c.t))


def _records(path: str) -> Iterator["tuple[int, Dict[str, Any]]"]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BundleError(f"{path}: damaged: line {lineno} is not JSON ({e.msg})") from e
                if not isinstance(rec, dict):
                    raise BundleError(f"{path}: damaged: line {lineno} is not a JSON object")
                yield lineno, rec
    except FileNotFoundError as e:
        raise BundleError(f"cannot read bundle {path}: no such file") from e
    except OSError as e:  # gzip.BadGzipFile is an OSError too
        if isinstance(e, gzip.BadGzipFile):
            raise BundleError(f"{path} is not a capture bundle (not gzip-compressed)") from e
        raise BundleError(f"cannot read bundle {path}: {e.strerror or e}") from e
    except EOFError as e:
        raise BundleError(f"{path} is truncated: the compressed stream ends early "
                          "(was the capture interrupted or the download cut short?)") from e
    except (zlib.error, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is corrupt: {e}") from e


def _check_header(path: str, rec: Dict[str, Any]) -> Dict[str, Any]:
    if rec.get("kind") != "header" or rec.get("format") != FORMAT:
        raise BundleError(f"{path} is not an mps-exporter capture bundle (no '{FORMAT}' header)")
    if rec.get("version") != VERSION:
        raise BundleError(f"{path} is capture format version {rec.get('version')!r}; "
                          f"this mps-exporter reads version {VERSION}")
    daemons = rec.get("daemons")
    if not isinstance(daemons, list) or not all(
            isinstance(d, dict) and all(isinstance(d.get(k), str) for k in ("name", "pipe_directory", "log_directory"))
            for d in daemons):
        raise ValueError("header: 'daemons' must list objects with name, pipe_directory and log_directory")
    if len({d["name"] for d in daemons}) != len(daemons):
        raise ValueError("header: a daemon name appears twice")
    sources = rec.get("sources")
    if not isinstance(sources, list) or not set(sources) <= set(SOURCE_TYPES):
        raise ValueError(f"header: 'sources' must list some of {sorted(SOURCE_TYPES)}")
    return rec


def _scrape(rec: Dict[str, Any]) -> Scrape:
    results: Dict[str, Any] = {}
    for name, entry in _expect(rec.get("sources", {}), dict, "sources").items():
        if name == "control":
            results[name] = [source_result(name, e) for e in _expect(entry, list, "control list")]
        elif name in SOURCE_TYPES:
            results[name] = source_result(name, entry)
    return Scrape(t=decode(float, rec["t"]), now=decode(float, rec["now"]), results=results)


_LOG_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")


def _log_chunk(rec: Dict[str, Any]) -> LogChunk:
    name = decode(str, rec["file"])
    if not _LOG_FILE_NAME.match(name):  # replay writes it into its own directory: no paths
        raise ValueError(f"log file name {name!r} is not a plain file name")
    if "base64" in rec:
        data = base64.b64decode(rec["base64"], validate=True)
    else:
        data = decode(str, rec.get("text", "")).encode("utf-8")
    return LogChunk(t=decode(float, rec["t"]), daemon=decode(str, rec["daemon"]), file=name,
                    data=data, new_file=bool(rec.get("new_file", False)))
