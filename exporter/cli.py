"""`mps-exporter`: serve /metrics (default), `dump` once, or print the metric table."""

from __future__ import annotations

import gc
import json
import logging
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from prometheus_client.exposition import generate_latest

from .collector import MpsCollector, build_registry
from .config import Config, parse_args
from .contract import METRICS

log = logging.getLogger("mps_exporter")


# ---------------------------------------------------------------- logging
class LogfmtFormatter(logging.Formatter):
    def fields(self, record: logging.LogRecord) -> Dict[str, str]:
        fields = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                  "level": record.levelname.lower().replace("warning", "warn"), "source": record.name,
                  "msg": record.getMessage()}
        if record.exc_info:
            fields["err"] = self.formatException(record.exc_info).splitlines()[-1]
        return fields

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in self.fields(record).items())


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' ="\n'):
        return value
    return json.dumps(value)


class JsonFormatter(LogfmtFormatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record))


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    handler.formatter.converter = time.gmtime
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel({"warn": logging.WARNING}.get(level, getattr(logging, level.upper(), logging.INFO)))


# ---------------------------------------------------------------- wiring
def build_sources(cfg: Config, *, nvml_module=None, control_runner=None) -> Dict[str, object]:
    """The enabled sources; DCGM only when its bindings import ("auto")."""
    sources: Dict[str, object] = {}
    if cfg.enabled("nvml"):
        from .sources.nvml import NvmlSource

        sources["nvml"] = NvmlSource(nvml_module) if nvml_module is not None else NvmlSource()
    if cfg.enabled("dcgm") and cfg.enabled("nvml"):
        from .sources.dcgm import DcgmSource

        dcgm = DcgmSource(cfg.dcgm_bindings)
        if cfg.collectors["dcgm"] is True or dcgm.available():
            sources["dcgm"] = dcgm
        else:
            log.info("DCGM Python bindings not found in %s: SM activity comes from NVML GPM", list(cfg.dcgm_bindings))
    if cfg.enabled("control"):
        from .sources.mps_control import ControlClient, ControlSource

        kwargs = {"runner": control_runner} if control_runner else {}
        sources["control"] = [
            ControlSource(d, ControlClient(d.pipe_directory, cfg.control_binary, cfg.command_timeout, **kwargs),
                          facts_refresh_seconds=cfg.facts_refresh_seconds)
            for d in cfg.daemons]
    if cfg.enabled("proc"):
        from .sources.procfs import ProcSource

        sources["proc"] = ProcSource(root=cfg.procfs)
    return sources


def build_log_pipelines(cfg: Config) -> Dict[str, object]:
    if not cfg.enabled("logs"):
        return {}
    from .logs.pipeline import LogPipeline, StateStore

    store = StateStore(cfg.state_file) if cfg.state_file else None
    return {d.name: LogPipeline(d.name, d.log_directory, timezone=cfg.log_timezone, state_store=store)
            for d in cfg.daemons}


def build_collector(cfg: Config, sources: Dict[str, object], pipelines: Dict[str, object],
                    clock: Callable[[], float] = time.time) -> MpsCollector:
    return MpsCollector(nvml=sources.get("nvml"), dcgm=sources.get("dcgm"), controls=sources.get("control", ()),
                        proc=sources.get("proc"), logs=pipelines, clock=clock)


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (only the main thread may install handlers)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())


# ---------------------------------------------------------------- commands
def dump(cfg: Config, out=sys.stdout) -> int:
    pipelines = build_log_pipelines(cfg)
    for p in pipelines.values():
        p.read_once()  # from the files' beginning: a captured directory inspected offline
    registry = build_registry(build_collector(cfg, build_sources(cfg), pipelines))
    out.write(generate_latest(registry).decode())
    return 0


def serve(cfg: Config, stop: Optional[threading.Event] = None, ready: Optional[threading.Event] = None,
          sources: Optional[Dict[str, object]] = None, clock: Callable[[], float] = time.time) -> int:
    """Serve until SIGTERM/SIGINT or `stop`. `sources` replaces the live ones and `clock`
    the collector's time (replay, tests)."""
    from .web import serve as serve_http

    pipelines = build_log_pipelines(cfg)
    for p in pipelines.values():
        p.start()
    collector = build_collector(cfg, build_sources(cfg) if sources is None else sources, pipelines, clock)
    # Start-up objects (modules, parsers, NVML bindings) live as long as the process:
    # keep them out of the garbage collector's full passes, which otherwise land
    # inside scrapes as latency spikes.
    gc.freeze()
    stop = stop or threading.Event()
    stop_on_signals(stop)
    try:
        serve_http(build_registry(collector), cfg.listen_address, cfg.telemetry_path, cfg.web_config,
                   max_requests=cfg.max_requests, ready=ready, stop=stop)
    finally:
        for p in pipelines.values():
            p.stop()
    return 0


def metrics_markdown() -> str:
    rows: List[str] = []
    table = None
    for spec in METRICS.values():
        if spec.table != table:
            table = spec.table
            rows += ["", f"### {table}", "", "| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
        rows.append(f"| {spec.name} | {spec.type} | {', '.join(spec.labels)} | {spec.help} |")
    return "\n".join(rows).lstrip("\n") + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    command, cfg = parse_args(argv)
    if command == "metrics":
        sys.stdout.write(metrics_markdown())
        return 0
    setup_logging(cfg.log_level, cfg.log_format)
    if command == "dump":
        return dump(cfg)
    if command == "capture":
        from .capture import capture

        return capture(cfg)
    try:
        if command == "replay":
            from .replay import replay

            return replay(cfg)
        return serve(cfg)
    except OSError as e:  # the address is taken or not ours: one line, not a traceback
        log.error("cannot listen on %s: %s", cfg.listen_address, e.strerror or e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
