"""`serve`: the collector behind the HTTP server until SIGTERM/SIGINT."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Callable, Dict, Optional

from .collector import build_registry
from .config import Config
from .exitstatus import ExitWatcher
from .sources.base import Reader
from .httpd.web import serve as serve_http
from .wiring import build_collector, build_readers, stop_on_signals


def serve(cfg: Config, stop: Optional[threading.Event] = None, ready: Optional[threading.Event] = None,
          readers: Optional[Dict[str, Reader[Any]]] = None, clock: Callable[[], float] = time.time,
          notice: str = "") -> int:
    """Serve until SIGTERM/SIGINT or `stop`. `readers` replaces the live ones and `clock`
    the collector's time (replay, tests); `notice` is said on the landing page."""
    readers = build_readers(cfg) if readers is None else readers
    for reader in readers.values():
        reader.start()
    watcher = ExitWatcher() if cfg.exit_status else None
    if watcher is not None and watcher.start():  # fails softly: exits then count as outcome="unknown"
        for reader in readers.values():
            reader.hear_exits(watcher)
    collector = build_collector(cfg, readers, clock, statuses=watcher)
    collector.start()
    # Start-up objects (modules, parsers, NVML bindings) live as long as the process:
    # keep them out of the garbage collector's full passes, which otherwise land
    # inside scrapes as latency spikes.
    gc.freeze()
    stop = stop or threading.Event()
    stop_on_signals(stop)
    try:
        serve_http(build_registry(collector, process=not cfg.disable_exporter_metrics), cfg.listen_address, cfg.telemetry_path, cfg.web_config,
                   max_requests=cfg.max_requests, ready=ready, stop=stop, listener=cfg.listen_socket,
                   readiness=lambda: all(reader.ready() for reader in readers.values()), notice=notice)
    finally:
        collector.close()
        if watcher is not None:
            watcher.close()
        for reader in readers.values():
            reader.close()
    return 0
