"""All configuration in one place: flags, the YAML config file, defaults.

Flags follow Prometheus exporter conventions (`--web.listen-address`,
`--collector.<name>` / `--no-collector.<name>`, `--log.level`). A bad flag or
config file ends the program with one clear line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, NoReturn, Optional, Sequence

from . import __version__
from .errors import ConfigError
from .units import parse_size

if TYPE_CHECKING:
    from .webconfig import WebConfig

# Port 10138: the 9100-9999 block of Prometheus' default port allocations is
# full; new exporters are allocated from 10000 up, and 10138 is not listed there.
DEFAULT_PORT = 10138
DEFAULT_LISTEN = f":{DEFAULT_PORT}"

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
DEFAULT_DAEMON_NAME = "default"

# DCGM puts its Python bindings here: 3.x, then 4.x (datacenter-gpu-manager-4).
DEFAULT_DCGM_BINDINGS = (
    "/usr/local/dcgm/bindings/python3",
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
)

# Collector name -> enabled by default. "auto": on if its library imports.
COLLECTORS: Dict[str, object] = {
    "nvml": True,
    "dcgm": "auto",
    "control": True,
    "proc": True,
    "logs": True,
}


@dataclass
class DaemonConfig:
    name: str
    pipe_directory: str
    log_directory: str


@dataclass
class CaptureOptions:
    out: str = ""  # a bundle file, or a directory to put one in
    duration_seconds: float = 60.0
    interval_seconds: float = 1.0
    # Of what the log files already hold at the start, keep the last this many bytes:
    # MPS never rotates its logs, and control.log logs every control command.
    log_history_bytes: int = 16 << 20


@dataclass
class ReplayOptions:
    bundle: Optional[str] = None  # None: the bundle shipped inside the package
    speed: float = 1.0
    loop: bool = False


@dataclass
class Config:
    listen_address: str = DEFAULT_LISTEN
    telemetry_path: str = "/metrics"
    web_config_file: Optional[str] = None
    web_config: Optional["WebConfig"] = None  # the file, read and checked once by parse_args
    max_requests: int = 40  # --web.max-requests: scrapes at once; 0 = no cap
    collectors: Dict[str, object] = field(default_factory=lambda: dict(COLLECTORS))
    daemons: List[DaemonConfig] = field(default_factory=list)
    control_binary: str = "nvidia-cuda-mps-control"
    command_timeout: float = 2.0
    # Server facts (thread percentage, pinned limits) and daemon defaults change
    # only through set_* commands; re-read them at most this often.
    facts_refresh_seconds: float = 60.0
    procfs: str = "/proc"
    dcgm_bindings: Sequence[str] = DEFAULT_DCGM_BINDINGS
    state_file: Optional[str] = None
    log_timezone: str = "local"
    log_level: str = "info"
    log_format: str = "logfmt"
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    replay: ReplayOptions = field(default_factory=ReplayOptions)

    def enabled(self, collector: str) -> bool:
        return self.collectors.get(collector) is not False


PROG = "mps-exporter"


class _Parser(argparse.ArgumentParser):
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
    env_pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    env_log = os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY
    p.add_argument("--mps.pipe-directory", dest="pipe_directory", default=env_pipe,
                   help=f"pipe directory of the MPS control daemon (default: $CUDA_MPS_PIPE_DIRECTORY or {DEFAULT_PIPE_DIRECTORY})")
    p.add_argument("--mps.log-directory", dest="log_directory", default=env_log,
                   help=f"log directory of the MPS control daemon (default: $CUDA_MPS_LOG_DIRECTORY or {DEFAULT_LOG_DIRECTORY})")
    p.add_argument("--mps.control-binary", dest="control_binary", default="nvidia-cuda-mps-control",
                   help="the nvidia-cuda-mps-control program")
    p.add_argument("--mps.command-timeout", dest="command_timeout", type=float, default=2.0,
                   help="seconds one control command may take before it is killed (default 2)")
    p.add_argument("--mps.facts-refresh", dest="facts_refresh_seconds", type=float, default=60.0,
                   help="seconds between re-reads of per-server limits and daemon defaults (default 60)")
    p.add_argument("--mps.state-file", dest="state_file", default=None,
                   help="file where the log follower keeps offsets and counters across restarts")
    p.add_argument("--mps.log-timezone", dest="log_timezone", default="local",
                   help="time zone of MPS log timestamps, an IANA name or 'local' (default local)")
    p.add_argument("--config.file", dest="config_file", default=None,
                   help="YAML file listing several control daemons (name, pipe_directory, log_directory)")
    p.add_argument("--path.procfs", dest="procfs", default="/proc", help="procfs mount point (default /proc)")
    p.add_argument("--dcgm.bindings-path", dest="dcgm_bindings", action="append", default=None,
                   help="directory holding DCGM's Python bindings (repeatable; default: the DCGM 3.x and 4.x install paths)")
    _add_logging(p)
    for name, default in COLLECTORS.items():
        p.add_argument(f"--collector.{name}", dest=f"collector_{name}", action="store_true", default=None,
                       help=f"enable the {name} collector (default: {'on' if default is True else default})")
        p.add_argument(f"--no-collector.{name}", dest=f"collector_{name}", action="store_false",
                       help=f"disable the {name} collector")


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log.level", dest="log_level", default="info", choices=["debug", "info", "warn", "error"])
    p.add_argument("--log.format", dest="log_format", default="logfmt", choices=["logfmt", "json"])


def _add_web(p: argparse.ArgumentParser) -> None:
    p.add_argument("--web.listen-address", dest="listen_address", default=DEFAULT_LISTEN,
                   help=f"address to listen on (default {DEFAULT_LISTEN})")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics",
                   help="path under which to expose metrics (default /metrics)")
    p.add_argument("--web.config.file", dest="web_config_file", default=None,
                   help="exporter-toolkit web config: TLS and basic auth")
    p.add_argument("--web.max-requests", dest="max_requests", type=int, default=40,
                   help="scrapes of the metrics path served at once; more get 503 (0: no limit; default 40)")


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(prog=PROG, description="Prometheus exporter for NVIDIA MPS.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    serve = sub.add_parser("serve", help="serve /metrics (the default)")
    _add_common(serve)
    _add_web(serve)
    parser.serve_parser = serve
    dump = sub.add_parser("dump", help="run every enabled collector once, print the exposition, exit")
    _add_common(dump)
    sub.add_parser("metrics", help="print the metric contract as a Markdown table")
    capture = sub.add_parser("capture", help="record what every source returns, and the MPS logs as they grow, "
                             "into one bundle file (docs/capture-format.md)")
    _add_common(capture)
    capture.add_argument("--out", required=True,
                         help="bundle file to write (.jsonl.gz), or an existing directory to write one into")
    capture.add_argument("--duration", type=float, default=60.0, help="seconds to record (default 60)")
    capture.add_argument("--interval", type=float, default=1.0,
                         help="seconds between two readings of the sources (default 1)")
    capture.add_argument("--log-history", default="16M",
                         help="of what each log file holds when the capture starts, record at most the last "
                              "SIZE (from a line start; e.g. 0, 512K, 16M; default 16M). Growth is always recorded")
    replay = sub.add_parser("replay", help="serve /metrics from a capture bundle as if it were live")
    replay.add_argument("bundle", nargs="?", default=None,
                        help="bundle written by `capture` (default: the recorded session shipped with mps-exporter)")
    replay.add_argument("--speed", type=float, default=1.0, help="replay this many times faster (default 1)")
    replay.add_argument("--loop", action="store_true",
                        help="start over at the end of the bundle (always, for the shipped session)")
    _add_web(replay)
    _add_logging(replay)
    return parser


def load_daemons_file(path: str) -> List[DaemonConfig]:
    import yaml  # here, not at the top: `capture` must run where PyYAML is not installed

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("daemons"), list) or not doc["daemons"]:
        raise ConfigError(f"config file {path}: expected a non-empty list under 'daemons'")
    daemons, seen = [], set()
    for i, entry in enumerate(doc["daemons"]):
        if not isinstance(entry, dict):
            raise ConfigError(f"config file {path}: daemons[{i}] must be a mapping")
        unknown = set(entry) - {"name", "pipe_directory", "log_directory"}
        if unknown:
            raise ConfigError(f"config file {path}: daemons[{i}] has unknown keys {sorted(unknown)}")
        name = entry.get("name")
        pipe = entry.get("pipe_directory")
        if not isinstance(name, str) or not name or not isinstance(pipe, str) or not pipe:
            raise ConfigError(f"config file {path}: daemons[{i}] needs 'name' and 'pipe_directory'")
        if name in seen:
            raise ConfigError(f"config file {path}: daemon name {name!r} appears twice")
        seen.add(name)
        daemons.append(DaemonConfig(name, pipe, entry.get("log_directory") or DEFAULT_LOG_DIRECTORY))
    return daemons


def parse_args(argv: Optional[Sequence[str]] = None) -> "tuple[str, Config]":
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
    if getattr(ns, "listen_address", None) is not None:
        _web_flags(cfg, ns, check_address=command in ("serve", "replay"))
    if command == "replay":
        if ns.speed <= 0:
            raise ConfigError(f"--speed must be positive, not {ns.speed}")
        cfg.replay = ReplayOptions(ns.bundle, ns.speed, ns.loop)
        return cfg  # daemons and collectors come from the bundle
    for key in ("control_binary", "command_timeout", "facts_refresh_seconds", "state_file",
                "log_timezone", "procfs"):
        setattr(cfg, key, getattr(ns, key))
    for flag, value in (("--mps.pipe-directory", ns.pipe_directory), ("--mps.log-directory", ns.log_directory),
                        ("--mps.control-binary", cfg.control_binary), ("--path.procfs", cfg.procfs)):
        if not value:
            raise ConfigError(f"{flag} must not be empty")
    if cfg.command_timeout <= 0:
        raise ConfigError("--mps.command-timeout must be positive")
    if cfg.facts_refresh_seconds < 0:
        raise ConfigError("--mps.facts-refresh must not be negative")
    # Paths that may appear later (a mount, a daemon's directories) are not checked here.
    if cfg.state_file is not None and (not cfg.state_file or os.path.isdir(cfg.state_file)):
        raise ConfigError(f"--mps.state-file {cfg.state_file!r}: give a file name, not a directory")
    _check_timezone(cfg.log_timezone)
    if ns.dcgm_bindings:
        if not all(ns.dcgm_bindings):
            raise ConfigError("--dcgm.bindings-path must not be empty")
        cfg.dcgm_bindings = tuple(ns.dcgm_bindings)
    for name in COLLECTORS:
        value = getattr(ns, f"collector_{name}")
        if value is not None:
            cfg.collectors[name] = value
    if command == "capture":
        if ns.duration <= 0 or ns.interval <= 0:
            raise ConfigError("--duration and --interval must be positive")
        history = parse_size(ns.log_history)
        if history is None:
            raise ConfigError(f"--log-history: not a size: {ns.log_history!r} (e.g. 0, 512K, 16M)")
        out_dir = ns.out if os.path.isdir(ns.out) else os.path.dirname(os.path.abspath(ns.out))
        if not ns.out or not os.path.isdir(out_dir):
            raise ConfigError(f"--out {ns.out!r}: neither a directory nor a file in an existing directory")
        cfg.capture = CaptureOptions(ns.out, ns.duration, ns.interval, history)
    if ns.config_file:
        cfg.daemons = load_daemons_file(ns.config_file)
    else:
        cfg.daemons = [DaemonConfig(DEFAULT_DAEMON_NAME, ns.pipe_directory, ns.log_directory)]
    return cfg


def _web_flags(cfg: Config, ns: argparse.Namespace, check_address: bool) -> None:
    from .webconfig import load_web_config, resolve_listen_address  # PyYAML: not needed by `capture`

    cfg.listen_address, cfg.telemetry_path = ns.listen_address, ns.telemetry_path
    cfg.web_config_file, cfg.max_requests = ns.web_config_file, ns.max_requests
    if not cfg.telemetry_path.startswith("/"):
        raise ConfigError(f"--web.telemetry-path must start with '/': {cfg.telemetry_path!r}")
    if cfg.max_requests < 0:
        raise ConfigError(f"--web.max-requests must be 0 (no limit) or more, not {cfg.max_requests}")
    if check_address:
        resolve_listen_address(cfg.listen_address)
    if cfg.web_config_file:  # read once, here: a bad file fails at start-up, not at the first request
        cfg.web_config = load_web_config(cfg.web_config_file)


def _check_timezone(name: str) -> None:
    from .logs.parser import resolve_timezone

    try:
        resolve_timezone(name)
    except ValueError as e:
        raise ConfigError(f"--mps.log-timezone: {e}") from e
