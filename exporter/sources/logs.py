"""The MPS logs as a source: one LogPipeline (exporter/logs/) per control daemon.

Its reading is each pipeline's last published snapshot (no I/O in a scrape).
Capture bundles carry the log bytes themselves, not readings: replay feeds
them to real pipelines, so this source is not recorded.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from ..config import Config
from ..logs.parser import resolve_timezone
from ..logs.pipeline import LogPipeline
from ..logs.state import LogSnapshot
from ..logs.statefile import StateStore
from ..model import Snapshot
from .base import Backends, Flag, PartialFailure, ReadContext, Reader, Source


def pipelines_reader(pipelines: Dict[str, LogPipeline]) -> Reader[Dict[str, LogSnapshot]]:
    """The reader over these pipelines (daemon name -> its pipeline)."""

    def read(ctx: ReadContext) -> Dict[str, LogSnapshot]:
        logs = {name: p.snapshot() for name, p in pipelines.items()}
        problems = [f"{name}: {problem}" for name, s in logs.items() for problem in s.problems]
        if problems:  # a file that cannot be read: what was read still counts, the collector fails
            raise PartialFailure("; ".join(problems), logs)
        return logs

    def start() -> None:
        for p in pipelines.values():
            p.start()

    def catch_up() -> None:
        for p in pipelines.values():
            p.read_once()

    def close() -> None:
        for p in pipelines.values():
            p.stop()

    return Reader(read, start=start, catch_up=catch_up, close=close, source=pipelines)


def _file_name(path: str) -> str:
    # Paths that may appear later (a mount, a daemon's directories) are not checked.
    if not path or os.path.isdir(path):
        raise ValueError(f"{path!r}: give a file name, not a directory")
    return path


def _timezone(name: str) -> str:
    resolve_timezone(name)  # ValueError: not a time zone
    return name


class LogsSourceSpec(Source[Dict[str, LogSnapshot]]):
    name = "logs"
    help = "control.log and server.log: queueing, handoffs, faults, lifecycle, commands"
    recorded = False
    flags = (
        Flag("--mps.state-file", "state_file", "file where the log follower keeps offsets and counters across "
             "restarts", refuses=("", "/"), check=_file_name),
        Flag("--mps.log-timezone", "log_timezone", "time zone of MPS log timestamps, an IANA name or 'local' "
             "(default %(default)s)", refuses=("Mars/Olympus", "Not A Zone"), check=_timezone),
    )

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[Dict[str, LogSnapshot]]]:
        if not cfg.daemons:
            return None
        store = StateStore(cfg.state_file) if cfg.state_file else None
        liveness = cfg.procfs if cfg.queued_client_liveness else None
        pipelines = {d.name: LogPipeline(d.name, d.log_directory, timezone=cfg.log_timezone, state_store=store,
                                         proc_root=liveness) for d in cfg.daemons}
        return pipelines_reader(pipelines)

    def store(self, snap: Snapshot, reading: Dict[str, LogSnapshot]) -> None:
        snap.logs = reading


SOURCE = LogsSourceSpec()
