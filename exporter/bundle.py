"""The capture bundle format (docs/capture-format.md), shared by `capture` and `replay`.

A bundle is one gzip-compressed JSON Lines file:

    {"kind": "header", "format": "mps-exporter-capture", "version": 1, ...}
    {"kind": "log", "t": 0.0, "daemon": "default", "file": "control.log", "text": "..."}
    {"kind": "scrape", "t": 0.01, "now": 1763700000.51, "sources": {...}, "durations": {...}}
    ...
    {"kind": "end", "t": 90.0, "scrapes": 91, "log_chunks": 40, "driver_version": "...", "gpus": [...]}

Events are in time order; `t` is seconds since the capture started. Each source
says how its readings are recorded (sources/base.py: the model dataclasses as
JSON, codec.py); a scrape record holds one entry per recorded source.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .codec import decode, expect
from .sources.registry import SOURCES

FORMAT = "mps-exporter-capture"
VERSION = 1
SUFFIX = ".jsonl.gz"

def recorded_sources() -> Tuple[str, ...]:
    """The sources a bundle holds readings of."""
    return tuple(name for name, source in SOURCES.items() if source.recorded)


class BundleError(Exception):
    """The bundle cannot be replayed; the message is one line for the user."""


# ------------------------------------------------------------------ events
@dataclass
class Scrape:
    t: float
    now: float  # the collector's clock (unix time) at that moment
    # source name -> its recorded entry as the source's `load` checked it
    results: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LogChunk:
    t: float
    daemon: str
    file: str  # control.log or server.log
    data: bytes
    new_file: bool = False  # the file was replaced or truncated before these bytes


@dataclass
class LogError:
    """From `t` on, the daemon's log file could not be read, for this reason (as the
    exporter's log follower words it); `error` None: readable again."""

    t: float
    daemon: str
    file: str
    error: Optional[str]
    reason: str = ""  # mps_log_read_errors_total's reason label while `error` is set


@dataclass
class Bundle:
    path: str
    header: Dict[str, Any]
    end: Dict[str, Any]
    scrapes: List[Scrape]
    logs: List[LogChunk]
    log_errors: List[LogError] = field(default_factory=list)

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


def log_error_record(e: LogError) -> Dict[str, Any]:
    return {"kind": "log_error", "t": e.t, "daemon": e.daemon, "file": e.file, "error": e.error, "reason": e.reason}


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
    log_errors: List[LogError] = []
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
            elif kind == "log_error":
                log_errors.append(_log_error(rec))
                if log_errors[-1].daemon not in {d["name"] for d in header["daemons"]}:
                    raise ValueError(f"log error of unknown daemon {log_errors[-1].daemon!r}")
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
    return Bundle(path, header, end, sorted(scrapes, key=lambda s: s.t), sorted(logs, key=lambda c: c.t),
                  sorted(log_errors, key=lambda e: e.t))


def _records(path: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
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
    if not isinstance(sources, list) or not set(sources) <= set(recorded_sources()):
        raise ValueError(f"header: 'sources' must list some of {sorted(recorded_sources())}")
    return rec


def _scrape(rec: Dict[str, Any]) -> Scrape:
    results: Dict[str, Any] = {}
    for name, entry in expect(rec.get("sources", {}), dict, "sources").items():
        if name in SOURCES and SOURCES[name].recorded:
            results[name] = SOURCES[name].load(entry)
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


def _log_error(rec: Dict[str, Any]) -> LogError:
    error = rec.get("error")
    return LogError(t=decode(float, rec["t"]), daemon=decode(str, rec["daemon"]), file=decode(str, rec["file"]),
                    error=None if error is None else decode(str, error), reason=decode(str, rec.get("reason", "")))
