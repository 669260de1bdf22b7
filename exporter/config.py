"""All configuration in one place: the settings, their defaults, the YAML config file.

cli.py turns flags into a `Config` (Prometheus exporter conventions:
`--web.listen-address`, `--collector.<name>` / `--no-collector.<name>`,
`--log.level`); a bad flag or config file ends the program with one clear line
on stderr and exit code 2.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from .errors import ConfigError, yaml_error_line

if TYPE_CHECKING:
    from .httpd.webconfig import WebConfig

# Port 10138: the 9100-9999 block of Prometheus' default port allocations is
# full; new exporters are allocated from 10000 up, and 10138 is not listed there.
DEFAULT_PORT = 10138
DEFAULT_LISTEN = f":{DEFAULT_PORT}"

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
DEFAULT_DAEMON_NAME = "default"

# --collector.refresh-interval and --collector.pause-after. The pause outlasts the longest
# usual scrape interval (Prometheus' 1 m), so that only an exporter nobody scrapes pauses.
DEFAULT_REFRESH_INTERVAL = 1.0
DEFAULT_PAUSE_AFTER = 300.0
# --collector.control-wait: a scrape waits this long for the control daemon's answers, then
# serves their last reading. Settled, a control read takes 4-13 ms on an H100 (0-32 busy
# clients); while MPS admits a storm of clients it takes 30-60 ms, up to 0.5 s. In the
# H100 storm of issue 29, 0.05 made most storm scrapes wait it out (45-90 ms); 0.01 served
# the last reading instead (25-40 ms) and settled reads still came within it (docs/performance.md).
# gzip level of the scrape bodies. 1, not 6: 48 clients' 53 KB compress to 5.7 KB in
# 0.05 ms instead of 5.0 KB in 0.18 ms (this machine); the body is re-compressed in
# every scrape whose readings changed, and 0.7 KB is nothing to a scrape.
GZIP_LEVEL = 1
DEFAULT_CONTROL_WAIT = 0.01

# DCGM puts its Python bindings here: 3.x, then 4.x (datacenter-gpu-manager-4).
DEFAULT_DCGM_BINDINGS = (
    "/usr/local/dcgm/bindings/python3",
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
)

# Where containerd (its CRI plugin's runtime v2 shims) and CRI-O keep each container's
# OCI bundle, and Docker each container's state (`config.v2.json`), `<root>/<container id>/`:
# the names of a client's container (runtime_metadata.py). The Helm chart mounts the first
# two read-only; a Docker or ECS host mounts the third.
DEFAULT_RUNTIME_ROOTS = ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                         "/run/containers/storage/overlay-containers",
                         "/var/lib/docker/containers")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass
class DaemonConfig:
    name: str
    pipe_directory: str
    log_directory: str
    layout: str = "static"  # how it was found: static (flags, config file), a LAYOUTS name, GLOB or PROCESS
    claim_uid: str = ""  # DRA: the resource claim whose daemon this is


@dataclass
class DiscoveryRoot:
    """Where daemons are looked for: a layout of LAYOUTS at its root, or
    (layout "glob") `path` is itself the pattern of daemon directories."""

    layout: str
    path: str


DEFAULT_DISCOVERY_INTERVAL = 5.0

# The layouts of discovery.py: where NVIDIA's Kubernetes software puts its daemons.
DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
GLOB = "glob"  # a pattern given as such: no layout-specific labels
PROCESS = "process"  # a control daemon process in /proc, found wherever it was started


@dataclass(frozen=True)
class Layout:
    name: str
    default_root: str
    below_root: str  # the glob of a daemon's directory under the root
    settings: str  # where the project that starts the daemons sets the root (docs, flag help)


LAYOUTS: Dict[str, Layout] = {
    DEVICE_PLUGIN: Layout(DEVICE_PLUGIN, "/run/nvidia/mps", "*/*",
                          "k8s-device-plugin Helm value mps.root (flag --mps-root, env MPS_ROOT)"),
    DRA: Layout(DRA, "/var/lib/kubelet/plugins", "gpu.nvidia.com/mps/*",
                "dra-driver-nvidia-gpu flag --kubelet-plugins-directory-path (env KUBELET_PLUGINS_DIRECTORY_PATH)"),
}


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


# --mps.client-granularity, finest first: per client process; summed per server and
# pod; summed per server (docs/cardinality.md: series per node for each).
GRANULARITIES = ("client", "pod", "server")


@dataclass
class StatusOptions:
    bundle: Optional[str] = None  # read a capture bundle instead of this node
    at: Optional[float] = None  # seconds into the bundle; None: its end (with --watch: its start)
    watch: Optional[float] = None  # refresh every this many seconds; None: print once
    output: str = "text"  # text or json


@dataclass
class Config:
    listen_address: str = DEFAULT_LISTEN
    # --web.systemd-socket: the socket systemd bound and passed (socket activation),
    # served instead of binding listen_address.
    listen_socket: Optional[socket.socket] = None
    telemetry_path: str = "/metrics"
    web_config_file: Optional[str] = None
    web_config: Optional["WebConfig"] = None  # the file, read and checked once by parse_args
    max_requests: int = 40  # --web.max-requests (node_exporter's default): scrapes at once; 0 = no cap
    # --web.disable-exporter-metrics (exporter-toolkit's): no process_* series of the exporter itself
    disable_exporter_metrics: bool = False
    scrape_max_seconds: float = 5.0  # a scrape's wait for its sources; 0 = no limit
    # Of Prometheus' scrape timeout, kept for rendering, encoding and the network (as
    # blackbox_exporter's --timeout-offset).
    scrape_timeout_offset: float = 0.5
    # --collector.refresh-interval: seconds between background reads of the slow sources
    # (Source.background); 0 = read them in every scrape. --collector.pause-after: those
    # reads stop after this many seconds without a scrape.
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL
    pause_after: float = DEFAULT_PAUSE_AFTER
    # --collector.control-wait: seconds a scrape waits for a read of a `served_while_reading`
    # source (control) before it serves that source's last reading; 0 = wait as for any source.
    control_wait: float = DEFAULT_CONTROL_WAIT
    textfile: Optional[str] = None  # dump: write here atomically instead of to stdout
    # --mps.client-granularity: "client", a series set per client process (pid label);
    # "pod", client memory, limits and counts summed per server and pod (no pid);
    # "server", client memory and limits summed per server (no pid, no pod).
    client_granularity: str = "client"
    # Where a client that leaves counts as at the edge of memory (exits.py): its last reading
    # within --mps.oom-margin-ratio of its pinned limit in force (0.05: the client that stood
    # at 95 % of 2 GiB and died asking 1 GiB more, H100, issue 40), or its GPU's used memory
    # at least --mps.device-full-ratio of the total (0.97: a GPU four clients had filled to
    # 97.5 % refused a fifth 6 GiB). A collection a second sees at most a second's growth
    # before the end: a client that grows faster can leave from further off and is not counted.
    oom_margin_ratio: float = 0.05
    device_full_ratio: float = 0.97
    # --mps.exit-status: serve asks the kernel how clients ended (exitstatus.py).
    exit_status: bool = True
    # Collector name -> True, False or "auto" where a flag or replay set it; a
    # collector not named here has its source's default (sources/registry.py).
    collectors: Dict[str, Union[bool, str]] = field(default_factory=dict)
    daemons: List[DaemonConfig] = field(default_factory=list)  # the static list
    discover: List[DiscoveryRoot] = field(default_factory=list)  # --mps.discover, --mps.discover-glob
    discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL  # seconds between scans of the roots
    # --mps.discover-processes: also watch every nvidia-cuda-mps-control process in procfs
    discover_processes: bool = True
    control_binary: str = "nvidia-cuda-mps-control"
    command_timeout: float = 2.0
    # Server facts (thread percentage, pinned limits) and daemon defaults change
    # only through set_* commands; re-read them after one (control.log) or this often.
    facts_refresh_seconds: float = 60.0
    procfs: str = "/proc"
    runtime_roots: Sequence[str] = DEFAULT_RUNTIME_ROOTS  # --path.runtime-root
    # --kubelet.*: the kubelet's /pods, for pod names where the runtime's files are not
    # visible; "" url = never asked, "" CA = the service account's CA, else the system's.
    kubelet_url: str = ""
    kubelet_token_file: str = SERVICE_ACCOUNT + "/token"
    kubelet_ca_file: str = ""
    # Whether the log pipelines ask procfs if queued clients still exist (logs/liveness.py);
    # replay turns it off: a bundle's PIDs are another machine's.
    queued_client_liveness: bool = True
    dcgm_bindings: Sequence[str] = DEFAULT_DCGM_BINDINGS
    state_file: Optional[str] = None
    log_timezone: str = "local"
    log_start: str = "beginning"  # --mps.log-start: "end" skips the history of a log the state file lacks
    # Settings of sources' own flags that no field above holds (sources/base.Flag).
    settings: Dict[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    log_format: str = "logfmt"
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    replay: ReplayOptions = field(default_factory=ReplayOptions)
    status: StatusOptions = field(default_factory=StatusOptions)


def load_daemons_file(path: str) -> Tuple[List[DaemonConfig], List[DiscoveryRoot]]:
    """The config file's static daemons and discovery roots:

        daemons: [{name, pipe_directory, log_directory}]
        discover: [{layout: device-plugin|dra, root: PATH (default: the layout's)}, {glob: PATTERN}]
    """
    import yaml  # here, not at the top: `capture` must run where PyYAML is not installed

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_error_line(e)}") from e
    if not isinstance(doc, dict) or set(doc) - {"daemons", "discover"}:
        raise ConfigError(f"config file {path}: expected a mapping with 'daemons' and/or 'discover'")
    entries, roots = doc.get("daemons") or [], _discover_entries(path, doc.get("discover") or [])
    if not isinstance(entries, list) or not entries and not roots:
        raise ConfigError(f"config file {path}: expected a non-empty list under 'daemons' (or a 'discover' list)")
    daemons, seen = [], set()
    for i, entry in enumerate(entries):
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
    return daemons, roots


def _discover_entries(path: str, entries: Any) -> List[DiscoveryRoot]:
    if not isinstance(entries, list):
        raise ConfigError(f"config file {path}: 'discover' must be a list")
    roots = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and set(entry) == {"glob"} and isinstance(entry["glob"], str) and entry["glob"]:
            roots.append(DiscoveryRoot(GLOB, entry["glob"]))
            continue
        layout = entry.get("layout") if isinstance(entry, dict) else None
        if layout not in LAYOUTS or set(entry) - {"layout", "root"} or not isinstance(entry.get("root", ""), str):
            raise ConfigError(f"config file {path}: discover[{i}] must be {{layout: {' or '.join(LAYOUTS)}, "
                              f"root: PATH}} or {{glob: PATTERN}}")
        roots.append(DiscoveryRoot(layout, entry.get("root") or LAYOUTS[layout].default_root))
    return roots
