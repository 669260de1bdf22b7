"""The MPS logs as a source: one LogPipeline (exporter/logs/) per control daemon.

Its reading is each pipeline's last published snapshot (no I/O in a scrape).
Capture bundles carry the log bytes themselves, not readings: replay feeds
them to real pipelines, so this source is not recorded.
"""

from __future__ import annotations

from typing import Dict, Optional

from ..config import Config
from ..logs.pipeline import LogPipeline
from ..logs.state import LogSnapshot
from ..logs.statefile import StateStore
from ..model import Snapshot
from .base import Backends, PartialFailure, ReadContext, Reader, Source


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


class LogsSourceSpec(Source[Dict[str, LogSnapshot]]):
    name = "logs"
    help = "control.log and server.log: queueing, handoffs, faults, lifecycle, commands"
    recorded = False

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
