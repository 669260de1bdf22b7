"""The exporter's wiring: readers from the configuration, the collector over them,
and `dump` (every collector once). `serve` (service.py) runs them behind HTTP."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, TextIO

from prometheus_client import write_to_textfile
from prometheus_client.exposition import generate_latest

from .collector import REAL_TIME, MpsCollector, Timing, build_registry
from .config import Config
from .discovery import DaemonSet
from .exits import ExitStatuses, ExitTracker, Margins, proc_alive
from .sources.base import Backends, Reader
from .sources.registry import SOURCES

log = logging.getLogger("mps_exporter")


def build_readers(cfg: Config, backends: Optional[Backends] = None,
                  recorded: Optional[bool] = None) -> Dict[str, Reader[Any]]:
    """The enabled sources' readers (a source that is not available here is left out);
    `recorded` True or False: only the sources capture records, or only the others."""
    readers: Dict[str, Reader[Any]] = {}
    backends = with_daemon_set(cfg, backends or Backends())
    for name, source in SOURCES.items():
        if source.enabled(cfg) and recorded in (None, source.recorded):
            reader = source.build(cfg, backends)
            if reader is not None:
                readers[name] = reader
    return readers


def with_daemon_set(cfg: Config, backends: Backends) -> Backends:
    """`backends` with the watched daemons: the static list, and discovery's when configured."""
    if backends.daemon_set is not None:
        return backends
    return dataclasses.replace(backends, daemon_set=DaemonSet(cfg.daemons, cfg.discover, cfg.discovery_interval,
                                                              processes=cfg.discover_processes,
                                                              proc_root=cfg.procfs))


def build_collector(cfg: Config, readers: Mapping[str, Reader[Any]], clock: Callable[[], float] = time.time,
                    bounded: bool = True, timing: Timing = REAL_TIME,
                    statuses: Optional[ExitStatuses] = None) -> MpsCollector:
    """`bounded`: scrapes wait for the sources at most as long as the scrape settings say
    (serve); else every source is waited for (dump, capture). `timing`: the collector's
    monotonic clock and wait (tests). `statuses`: how processes exited (serve's
    exitstatus.ExitWatcher; None: unknown)."""
    max_seconds = cfg.scrape_max_seconds or None if bounded else None
    # /proc tells whether a client that left MPS still runs; not for a bundle's PIDs (replay).
    alive = proc_alive(cfg.procfs) if cfg.queued_client_liveness else (lambda pid: None)
    exits = ExitTracker(Margins(cfg.oom_margin_ratio, cfg.device_full_ratio), statuses, alive)
    return MpsCollector(readers, clock=clock, max_seconds=max_seconds, timeout_offset=cfg.scrape_timeout_offset,
                        granularity=cfg.client_granularity, refresh_interval=cfg.refresh_interval,
                        pause_after=cfg.pause_after, control_wait=cfg.control_wait, timing=timing, exits=exits)


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (only the main thread may install handlers)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())


def dump(cfg: Config, out: TextIO = sys.stdout) -> int:
    """Every collector once, from the log files' beginning (a directory inspected offline),
    printed, or written atomically to `cfg.textfile` (node_exporter's textfile collector
    must never read half a file)."""
    readers = build_readers(cfg)
    for reader in readers.values():
        reader.catch_up()
    registry = build_registry(build_collector(cfg, readers, bounded=False), process=False)
    try:
        if cfg.textfile:
            write_to_textfile(cfg.textfile, registry)
        else:
            out.write(generate_latest(registry).decode())
    finally:
        for reader in readers.values():
            reader.close()
    return 0
