"""The state file (`--mps.state-file`): where the log pipelines keep offsets, counters
and pending state across restarts.

One JSON file for all daemons, keyed by daemon name. Written atomically (a
temporary file in the same directory, fsync, rename), so a crash leaves either the
old or the new file, never half of one. A missing, unreadable or malformed file
means "start from the logs": it is never fatal. Its content is input like any other:
the pipeline checks its shape, its counters (none negative) and its positions (no
offset past its file, the file's first bytes and the bytes before the offset as
saved) before it trusts any of it. Each doubt is logged once per reason and counted
in `errors` (mps_exporter_state_file_errors_total), and so is each failed save.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from typing import Any, Collection, Dict, Optional

# Why a state file was not trusted or not written (plain data, with the log events).
from .events import NEGATIVE_COUNTER as NEGATIVE_COUNTER
from .events import POSITION as POSITION
from .events import SAVE_FAILED as SAVE_FAILED
from .events import SHAPE as SHAPE
from .events import STATE_FILE_ERROR_REASONS as STATE_FILE_ERROR_REASONS
from .events import UNREADABLE as UNREADABLE

log = logging.getLogger(__name__)

# Version 2 keeps the counted log events as one map keyed by metric name (logs/state.py);
# version 1 entries (the exporter before it) still load, converted as they are read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)



class StateStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()  # several pipelines (one per daemon) share one file
        # What the file holds, once read: this process is its only writer, and each save
        # re-reading every daemon's entry made N daemons' saves cost N squared.
        self._doc: Optional[Dict[str, Any]] = None
        self.errors: Dict[str, int] = {}  # reason -> times

    def count_error(self, reason: str, message: str) -> None:
        """Count a doubt or failure; the first of each reason is logged as a warning."""
        first = reason not in self.errors
        self.errors[reason] = self.errors.get(reason, 0) + 1
        (log.warning if first else log.debug)("state file %s: %s", self.path, message)

    def load(self, daemon: str) -> Optional[Dict[str, Any]]:
        """The saved entry of `daemon`, or None."""
        with self._lock:
            entry = self._read().get(daemon)
        if entry is None:
            return None
        if not isinstance(entry, dict) or entry.get("version") not in READABLE_VERSIONS:
            self.count_error(SHAPE, f"the entry of daemon {daemon} is not a version "
                                    f"{' or '.join(map(str, READABLE_VERSIONS))} entry; starting from the logs")
            return None
        return entry

    def save(self, daemon: str, entry: Dict[str, Any]) -> bool:
        """Replace `daemon`'s entry. False (and a log line) when the file cannot be written."""
        with self._lock:
            doc = dict(self._read())
            doc[daemon] = {**entry, "version": FORMAT_VERSION}
            try:
                self._write(doc)
                self._doc = doc
            except OSError as e:
                self.count_error(SAVE_FAILED, f"cannot write it: {e}")
                return False
        return True

    def retain(self, daemons: Collection[str]) -> None:
        """Drop the entries of every daemon not in `daemons` (one that left while the
        exporter was not running, or just now): nothing of a gone daemon stays in the file."""
        with self._lock:
            doc = self._read()
            if set(doc) <= set(daemons):
                return
            try:
                self._write({k: v for k, v in doc.items() if k in daemons})
                self._doc = {k: v for k, v in doc.items() if k in daemons}
            except OSError as e:
                self.count_error(SAVE_FAILED, f"cannot write it: {e}")

    def _read(self) -> Dict[str, Any]:
        if self._doc is None:
            self._doc = self._read_file()
        return self._doc

    def _read_file(self) -> Dict[str, Any]:
        """The whole document; {} when there is none yet, or (counted) when unusable."""
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self.count_error(UNREADABLE, f"cannot be read ({e}); starting from the logs")
            return {}
        if not isinstance(doc, dict):
            self.count_error(SHAPE, "not a JSON object; starting from the logs")
            return {}
        return doc

    def _write(self, doc: Dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".mps-exporter-state.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
