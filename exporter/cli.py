"""`mps-exporter`: parse the command line and dispatch: serve /metrics (default),
`dump` once, `capture`, `replay`, `status`, or print the metric table.

Flags follow Prometheus exporter conventions (`--web.listen-address`,
`--collector.<name>` / `--no-collector.<name>`, `--log.level`); the collector
flags come from the sources themselves (sources/registry.py). A bad flag or
config file ends the program with one clear line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import json
import logging
import os
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

from . import __version__
from .capture import capture
from .config import (DEFAULT_DAEMON_NAME, DEFAULT_LOG_DIRECTORY, DEFAULT_PIPE_DIRECTORY, GLOB, GRANULARITIES, LAYOUTS,
                     CaptureOptions, Config, DaemonConfig, DiscoveryRoot, ReplayOptions, StatusOptions,
                     load_daemons_file)
from .catalog import metrics_markdown
from .errors import ConfigError
from .sources.registry import SOURCES
from .units import parse_size
from .wiring import dump

# The web server, its config file and replay (which serves) need PyYAML; `capture`
# must run where it is missing, so those modules are imported where they are used.

log = logging.getLogger("mps_exporter")
DEFAULTS = Config()  # every flag's default, where a Config field holds its setting
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(Config)) - {"settings"}


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
    formatter = JsonFormatter() if fmt == "json" else LogfmtFormatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel({"warn": logging.WARNING}.get(level, getattr(logging, level.upper(), logging.INFO)))


# ---------------------------------------------------------------- flags
PROG = "mps-exporter"


def doc(name: str) -> str:
    """Where a user finds docs/NAME: a pip install has no docs/ beside it, so the
    package's Documentation URL (pyproject.toml) when the package is installed."""
    base = _documentation_url()
    return f"{base}/{name}" if base else f"docs/{name} in the source repository"


@functools.lru_cache(maxsize=1)
def _documentation_url() -> Optional[str]:
    """Looked up once: each lookup scans the installed distributions (start-up, issue 44)."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata(PROG).get_all("Project-URL") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        urls = []
    return next((url.split(",", 1)[1].strip() for url in urls if url.split(",", 1)[0].strip() == "Documentation"),
                None)


class _Formatter(argparse.HelpFormatter):
    def _split_lines(self, text: str, width: int) -> "list[str]":  # a URL stays whole, to be copied
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False,
                             break_long_words=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one clear line, exit 2, whichever subcommand
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


class _TopParser(_Parser):
    """Top-level help also lists the flags of `serve`, the command that runs without one."""

    serve_parser: Optional[argparse.ArgumentParser] = None

    def format_help(self) -> str:
        text = super().format_help()
        if self.serve_parser is not None:
            options = self.serve_parser.format_help().split("\n\n", 1)[-1]
            text += f"\nWithout a subcommand {PROG} serves; the serve flags ({PROG} serve --help):\n\n{options}"
        return text


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps.pipe-directory", dest="pipe_directory", default=None,
                   help=f"pipe directory of the MPS control daemon (default: $CUDA_MPS_PIPE_DIRECTORY or "
                        f"{DEFAULT_PIPE_DIRECTORY}; with --mps.discover only where given)")
    p.add_argument("--mps.log-directory", dest="log_directory", default=None,
                   help=f"log directory of the MPS control daemon (default: $CUDA_MPS_LOG_DIRECTORY or {DEFAULT_LOG_DIRECTORY})")
    p.add_argument("--mps.discover", dest="discover", default="", metavar="LAYOUTS",
                   help=f"find the daemons that NVIDIA's Kubernetes software starts, re-scanned while running: "
                        f"a comma-separated list of {', '.join(LAYOUTS)} (see {doc('deploy.md')})")
    for layout in LAYOUTS.values():
        p.add_argument(f"--mps.discover.{layout.name}-root", dest=f"discover_root_{layout.name}",
                       default=layout.default_root,
                       help=f"root of the {layout.name} layout as this process sees it: {layout.settings} "
                            f"(default {layout.default_root})")
    p.add_argument("--mps.discover-glob", dest="discover_globs", action="append", default=[], metavar="PATTERN",
                   help="glob of daemon directories, each holding pipe/control and log/ (repeatable); the "
                        "daemon is named by the path below the pattern's fixed part")
    p.add_argument("--mps.discover-processes", dest="discover_processes", action="store_true",
                   default=DEFAULTS.discover_processes,
                   help="also watch every nvidia-cuda-mps-control process on the host, wherever it was started "
                        "(its pipe and log directories from its environment, through /proc/PID/root; needs the "
                        f"host's PID namespace) (default: {'on' if DEFAULTS.discover_processes else 'off'})")
    p.add_argument("--no-mps.discover-processes", dest="discover_processes", action="store_false",
                   help="watch only the daemons named or found under roots")
    p.add_argument("--mps.discover-interval", dest="discovery_interval", type=float,
                   default=DEFAULTS.discovery_interval,
                   help="seconds between scans for daemons that came or went (default %(default)s)")
    p.add_argument("--config.file", dest="config_file", default=None,
                   help="YAML file listing control daemons (daemons: name, pipe_directory, log_directory) "
                        "and discovery roots (discover: layout and root, or glob)")
    _add_logging(p)
    for name, source in SOURCES.items():
        for flag in source.flags:  # the sources' own flags, defaults from Config
            p.add_argument(flag.name, dest=flag.dest, type=flag.type, help=flag.help, metavar=flag.metavar,
                           action="append" if flag.repeatable else "store",
                           default=None if flag.repeatable else getattr(DEFAULTS, flag.dest, flag.default))
        default = "on" if source.default is True else "off" if source.default is False else source.default
        p.add_argument(f"--collector.{name}", dest=f"collector_{name}", action="store_true", default=None,
                       help=f"enable the {name} collector: {source.help} (default: {default})")
        p.add_argument(f"--no-collector.{name}", dest=f"collector_{name}", action="store_false",
                       help=f"disable the {name} collector")


def _add_granularity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps.client-granularity", dest="client_granularity", default=DEFAULTS.client_granularity,
                   choices=list(GRANULARITIES),
                   help="client: series per MPS client process (pid label); pod: client memory, "
                        "limits and counts summed per MPS server and pod, no pid label; server: client memory "
                        f"and limits summed per MPS server, no pid or pod ({doc('cardinality.md')}; default %(default)s)")


def _add_edges(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps.oom-margin-ratio", dest="oom_margin_ratio", type=float, default=DEFAULTS.oom_margin_ratio,
                   help="a client that exits with a memory reading of its last 30 s within this share of its pinned limit "
                        "counts as exited at its limit (mps_client_exits_at_memory_limit_total{reason=\"client_limit\"};"
                        " default %(default)s)")
    p.add_argument("--mps.device-full-ratio", dest="device_full_ratio", type=float,
                   default=DEFAULTS.device_full_ratio,
                   help="a client that exits while its GPU's used memory was at least this share of the total counts "
                        "as exited at a full GPU (reason=\"device_full\"; default %(default)s)")
    p.add_argument("--mps.exit-status", dest="exit_status", action="store_true", default=DEFAULTS.exit_status,
                   help="ask the kernel how clients ended (the proc connector over netlink: the host's PID namespace, "
                        "and CAP_NET_ADMIN before Linux 6.6; elsewhere the outcome is unknown) (default: on)")
    p.add_argument("--no-mps.exit-status", dest="exit_status", action="store_false",
                   help="do not ask the kernel: every exit at the edge counts with outcome unknown")


def _edge_flags(cfg: Config, ns: argparse.Namespace) -> None:
    cfg.oom_margin_ratio, cfg.device_full_ratio = ns.oom_margin_ratio, ns.device_full_ratio
    cfg.exit_status = ns.exit_status
    if not 0 <= cfg.oom_margin_ratio < 1:
        raise ConfigError(f"--mps.oom-margin-ratio must be at least 0 and below 1, not {ns.oom_margin_ratio}")
    if not 0 < cfg.device_full_ratio <= 1:
        raise ConfigError(f"--mps.device-full-ratio must be above 0 and at most 1, not {ns.device_full_ratio}")


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log.level", dest="log_level", default=DEFAULTS.log_level,
                   choices=["debug", "info", "warn", "error"], help="(default %(default)s)")
    p.add_argument("--log.format", dest="log_format", default=DEFAULTS.log_format, choices=["logfmt", "json"],
                   help="(default %(default)s)")


def _add_web(p: argparse.ArgumentParser) -> None:
    p.add_argument("--web.listen-address", dest="listen_address", default=DEFAULTS.listen_address,
                   help="address to listen on (default %(default)s)")
    p.add_argument("--web.systemd-socket", dest="systemd_socket", action="store_true",
                   help="serve on the socket systemd passes (socket activation: a .socket unit or "
                        "systemd-socket-activate) instead of binding --web.listen-address")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default=DEFAULTS.telemetry_path,
                   help="path under which to expose metrics (default %(default)s)")
    p.add_argument("--web.config.file", dest="web_config_file", default=None,
                   help="exporter-toolkit web config: TLS and basic auth")
    p.add_argument("--web.max-requests", dest="max_requests", type=int, default=DEFAULTS.max_requests,
                   help="scrapes of the metrics path served at once; more get 503 (0: no limit; default %(default)s)")
    p.add_argument("--web.disable-exporter-metrics", dest="disable_exporter_metrics", action="store_true",
                   help="leave the exporter's own process_* metrics (CPU, memory, open files) out of the metrics "
                        "path; the collectors' own series stay")
    p.add_argument("--scrape.max-duration", dest="scrape_max_seconds", type=float, default=DEFAULTS.scrape_max_seconds,
                   help="seconds a scrape waits for the sources; a source later than that fails its collector "
                        "and its last reading is served, marked (0: no limit; default %(default)s)")
    p.add_argument("--scrape.timeout-offset", dest="scrape_timeout_offset", type=float,
                   default=DEFAULTS.scrape_timeout_offset,
                   help="seconds of Prometheus' scrape timeout (X-Prometheus-Scrape-Timeout-Seconds) kept for "
                        "encoding and sending; the sources get the rest, at most --scrape.max-duration "
                        "(default %(default)s)")


def _add_refresh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collector.refresh-interval", dest="refresh_interval", type=float,
                   default=DEFAULTS.refresh_interval,
                   help="seconds between background reads of the sources that are slow or slow down in a client "
                        "storm (NVML, DCGM); a scrape serves their latest reading, at most two intervals old. Scraped "
                        "less often, they are read once per scrape, just before the next is due. 0: "
                        "read them in every scrape (default %(default)s)")
    p.add_argument("--collector.pause-after", dest="pause_after", type=float, default=DEFAULTS.pause_after,
                   help="seconds without a scrape after which the background reads pause; the next scrape reads "
                        "and resumes them (default %(default)s)")
    p.add_argument("--collector.control-wait", dest="control_wait", type=float, default=DEFAULTS.control_wait,
                   help="seconds a scrape waits for the control daemon's answers; not there by then, it serves "
                        "their last reading (its age in mps_exporter_collector_last_success_timestamp_seconds) and "
                        "the read ends for the next scrape. 0: wait as for any source (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(prog=PROG, description="Prometheus exporter for NVIDIA MPS.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    serve = sub.add_parser("serve", help="serve /metrics (the default)")
    _add_common(serve)
    _add_granularity(serve)
    _add_edges(serve)
    _add_web(serve)
    _add_refresh(serve)
    parser.serve_parser = serve
    dump = sub.add_parser("dump", help="run every enabled collector once, print the exposition, exit")
    _add_common(dump)
    dump.add_argument("--textfile", default=None, metavar="PATH",
                      help="write the exposition to PATH atomically (for node_exporter's textfile collector) "
                           "instead of printing it")
    _add_granularity(dump)
    sub.add_parser("metrics", help="print the metric contract as a Markdown table")
    capture = sub.add_parser("capture", help="record what every source returns, and the MPS logs as they grow, "
                             f"into one bundle file ({doc('capture-format.md')})")
    _add_common(capture)
    capture.add_argument("--out", required=True,
                         help="bundle file to write (.jsonl.gz), or an existing directory to write one into")
    capture.add_argument("--duration", type=float, default=DEFAULTS.capture.duration_seconds,
                         help="seconds to record (default %(default)s)")
    capture.add_argument("--interval", type=float, default=DEFAULTS.capture.interval_seconds,
                         help="seconds between two readings of the sources (default %(default)s)")
    capture.add_argument("--log-history", default="16M",
                         help="of what each log file holds when the capture starts, record at most the last "
                              "SIZE (from a line start; e.g. 0, 512K, 16M; default 16M). Growth is always recorded")
    replay = sub.add_parser("replay", help="serve /metrics from a capture bundle as if it were live")
    replay.add_argument("bundle", nargs="?", default=None,
                        help="bundle written by `capture` (default: the recorded session shipped with mps-exporter)")
    replay.add_argument("--speed", type=float, default=DEFAULTS.replay.speed,
                        help="replay this many times faster (default %(default)s)")
    replay.add_argument("--loop", action="store_true",
                        help="start over at the end of the bundle (always, for the shipped session)")
    _add_granularity(replay)
    _add_edges(replay)
    _add_web(replay)
    _add_logging(replay)
    status = sub.add_parser("status", help="collect once and print the node's MPS state as a report "
                            "(daemons, GPUs, servers, clients, queue, recent events); what a failed source "
                            "could not tell shows as unknown, and the exit code is 1 when a source failed",
                            description="Collect once and print the node's MPS state. Exit code: 0; 1 when a "
                            "source failed (what it could not tell shows as unknown); 2 for a bad flag or "
                            "bundle.")
    _add_common(status)
    _add_edges(status)
    status.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh in place every SECONDS (default 2) until q or Ctrl-C")
    status.add_argument("--output", choices=["text", "json"], default=DEFAULTS.status.output,
                        help="text or json, the same data for scripts (default %(default)s)")
    status.add_argument("--bundle", default=None, metavar="FILE",
                        help="read a bundle written by `capture` instead of this node (daemons and sources "
                             "come from the bundle)")
    status.add_argument("--at", type=float, default=None, metavar="SECONDS",
                        help="with --bundle: the moment to show, in seconds into the recording (default: its "
                             "end; with --watch the recording plays from here, default its start)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[str, Config]:
    """Returns (command, config). Exits 2 with one line on any error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, "serve")
    ns = parser.parse_args(argv)
    command = ns.command
    try:
        return command, _config(command, ns)
    except ConfigError as e:
        parser.error(str(e))


def _config(command: str, ns: argparse.Namespace) -> Config:
    """The namespace of one subcommand -> Config; raises ConfigError."""
    cfg = Config()
    if command == "metrics":
        return cfg
    cfg.log_level, cfg.log_format = ns.log_level, ns.log_format
    cfg.client_granularity = getattr(ns, "client_granularity", cfg.client_granularity)
    if getattr(ns, "listen_address", None) is not None:
        _web_flags(cfg, ns, check_address=command in ("serve", "replay"))
    if command == "serve":
        _refresh_flags(cfg, ns)
    if command in ("serve", "replay", "status"):
        _edge_flags(cfg, ns)
    if command == "replay":
        if ns.speed <= 0:
            raise ConfigError(f"--speed must be positive, not {ns.speed}")
        cfg.replay = ReplayOptions(ns.bundle, ns.speed, ns.loop)
        return cfg  # daemons and collectors come from the bundle
    for flag, value in (("--mps.pipe-directory", ns.pipe_directory), ("--mps.log-directory", ns.log_directory)):
        if value is None:
            continue
        if not value:
            raise ConfigError(f"{flag} must not be empty")
    _source_flags(cfg, ns)
    for name in SOURCES:
        value = getattr(ns, f"collector_{name}")
        if value is not None:
            cfg.collectors[name] = value
    if command == "dump" and ns.textfile is not None:
        _check_textfile(ns.textfile)
        cfg.textfile = ns.textfile
    if command == "capture":
        cfg.capture = _capture_options(ns)
    if command == "status":
        cfg.status = _status_options(ns)
    _daemon_flags(cfg, ns)
    return cfg


def _capture_options(ns: argparse.Namespace) -> CaptureOptions:
    if ns.duration <= 0 or ns.interval <= 0:
        raise ConfigError("--duration and --interval must be positive")
    history = parse_size(ns.log_history)
    if history is None:
        raise ConfigError(f"--log-history: not a size: {ns.log_history!r} (e.g. 0, 512K, 16M)")
    out_dir = ns.out if os.path.isdir(ns.out) else os.path.dirname(os.path.abspath(ns.out))
    if not ns.out or not os.path.isdir(out_dir):
        raise ConfigError(f"--out {ns.out!r}: neither a directory nor a file in an existing directory")
    return CaptureOptions(ns.out, ns.duration, ns.interval, history)


def _daemon_flags(cfg: Config, ns: argparse.Namespace) -> None:
    """The daemons to watch: discovery, the config file, else the flags' (or MPS's) directories."""
    cfg.discover = _discover_flags(ns)
    cfg.discovery_interval = ns.discovery_interval
    cfg.discover_processes = ns.discover_processes
    if not cfg.discovery_interval > 0:
        raise ConfigError("--mps.discover-interval must be positive")
    if ns.config_file:
        cfg.daemons, roots = load_daemons_file(ns.config_file)
        cfg.discover += roots
    pipe = ns.pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    # With discovery, the flags' daemon only where named: a DRA node has no /tmp/nvidia-mps.
    if not ns.config_file and (pipe or not cfg.discover):
        log_dir = ns.log_directory or os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY
        cfg.daemons = [DaemonConfig(DEFAULT_DAEMON_NAME, pipe or DEFAULT_PIPE_DIRECTORY, log_dir)]


def _source_flags(cfg: Config, ns: argparse.Namespace) -> None:
    """The sources' own flags into cfg: a Config field, else cfg.settings."""
    for source in SOURCES.values():
        for flag in source.flags:
            value = getattr(ns, flag.dest)
            if value is None and flag.repeatable:
                continue  # not given: the Config default stands
            if value is not None and flag.check is not None:
                try:
                    value = flag.check(value)
                except ValueError as e:
                    raise ConfigError(f"{flag.name} {e}") from e
            if flag.dest in CONFIG_FIELDS:
                setattr(cfg, flag.dest, value)
            else:
                cfg.settings[flag.dest] = value


def _discover_flags(ns: argparse.Namespace) -> List[DiscoveryRoot]:
    roots = []
    for name in LAYOUTS:
        if not getattr(ns, f"discover_root_{name}"):
            raise ConfigError(f"--mps.discover.{name}-root must not be empty")
    for name in (n.strip() for n in ns.discover.split(",") if n.strip()):
        if name not in LAYOUTS:
            raise ConfigError(f"--mps.discover: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
        roots.append(DiscoveryRoot(name, getattr(ns, f"discover_root_{name}")))
    for pattern in ns.discover_globs:
        if not pattern:
            raise ConfigError("--mps.discover-glob must not be empty")
        roots.append(DiscoveryRoot(GLOB, pattern))
    return roots


def _status_options(ns: argparse.Namespace) -> StatusOptions:
    if ns.watch is not None and ns.watch <= 0:
        raise ConfigError(f"--watch must be positive, not {ns.watch}")
    if ns.watch is not None and ns.output == "json":
        raise ConfigError("--watch shows the text report; --output json prints once")
    if ns.at is not None and (ns.bundle is None or ns.at < 0):
        raise ConfigError("--at needs --bundle and is seconds into it (0 or more)")
    return StatusOptions(ns.bundle, ns.at, ns.watch, ns.output)


def _web_flags(cfg: Config, ns: argparse.Namespace, check_address: bool) -> None:
    from .httpd.webconfig import load_web_config, resolve_listen_address  # PyYAML: not needed by `capture`

    cfg.listen_address, cfg.telemetry_path = ns.listen_address, ns.telemetry_path
    cfg.scrape_max_seconds, cfg.scrape_timeout_offset = ns.scrape_max_seconds, ns.scrape_timeout_offset
    if cfg.scrape_max_seconds < 0 or cfg.scrape_timeout_offset < 0:
        raise ConfigError("--scrape.max-duration and --scrape.timeout-offset must not be negative")
    cfg.web_config_file, cfg.max_requests = ns.web_config_file, ns.max_requests
    cfg.disable_exporter_metrics = ns.disable_exporter_metrics
    if not cfg.telemetry_path.startswith("/"):
        raise ConfigError(f"--web.telemetry-path must start with '/': {cfg.telemetry_path!r}")
    if cfg.max_requests < 0:
        raise ConfigError(f"--web.max-requests must be 0 (no limit) or more, not {cfg.max_requests}")
    if ns.systemd_socket and check_address:
        from .httpd.systemd import listening_socket

        cfg.listen_socket = listening_socket()
    elif check_address:
        resolve_listen_address(cfg.listen_address)
    if cfg.web_config_file:  # read once, here: a bad file fails at start-up, not at the first request
        cfg.web_config = load_web_config(cfg.web_config_file)


def _refresh_flags(cfg: Config, ns: argparse.Namespace) -> None:
    cfg.refresh_interval, cfg.pause_after = ns.refresh_interval, ns.pause_after
    if not cfg.refresh_interval >= 0:
        raise ConfigError(f"--collector.refresh-interval must be 0 (read at scrape) or more, not {ns.refresh_interval}")
    if not cfg.pause_after > 0:
        raise ConfigError(f"--collector.pause-after must be positive, not {ns.pause_after}")
    cfg.control_wait = ns.control_wait
    if not cfg.control_wait >= 0:
        raise ConfigError(f"--collector.control-wait must be 0 (wait as for any source) or more, not {ns.control_wait}")


def _check_textfile(path: str) -> None:
    """Before collecting: the file must be one that can be written in place of the old."""
    if not path or os.path.isdir(path):
        raise ConfigError(f"--textfile {path!r}: give a file name, not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"--textfile {path!r}: its directory {parent} {what}")
    try:  # the new exposition is written beside the old file, then renamed over it
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError(f"--textfile {path!r}: cannot write in {parent}: {e.strerror or e}") from e


# ---------------------------------------------------------------- dispatch
def main(argv: Optional[Sequence[str]] = None) -> int:
    command, cfg = parse_args(argv)
    if command == "metrics":
        sys.stdout.write(metrics_markdown())
        return 0
    setup_logging(cfg.log_level, cfg.log_format)
    # A crash inside a native library (NVML, DCGM) leaves its Python stacks in the log,
    # where systemd's journal and `kubectl logs --previous` keep them (issue 38).
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # a stderr without a file (tests' capture)
            log.debug("faulthandler not enabled: stderr has no file descriptor")
    for warning in cfg.web_config.warnings if cfg.web_config else ():  # read before logging was set up
        log.warning("%s", warning)
    if command == "dump":
        try:
            return dump(cfg)
        except OSError as e:  # the textfile's directory went away or filled up after the check
            sys.stderr.write(f"{PROG}: error: --textfile {cfg.textfile!r}: {e.strerror or e}\n")
            return 2
    if command == "capture":
        return capture(cfg)
    if command == "status":
        from .status.command import status  # replay, for bundles; not imported by serve and replay (start-up)

        return status(cfg)
    from .replay import replay  # PyYAML (see the top)
    from .service import serve

    try:
        if command == "replay":
            return replay(cfg)
        return serve(cfg)
    except OSError as e:  # the address is taken or not ours: one line, not a traceback
        log.error("cannot listen on %s: %s", cfg.listen_address, e.strerror or e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
