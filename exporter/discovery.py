"""Which MPS control daemons to watch: the static list, plus those found under glob roots.

On Kubernetes NVIDIA's software starts the daemons, each in a directory of its own
(read from their code; docs/deploy.md):
- the device plugin (cmd/mps-control-daemon/mps/root.go): one daemon per shared
  resource, `<root>/<resource name>/{pipe,log}`, root `/run/nvidia/mps`; the resource
  name keeps its slash (`nvidia.com/gpu`), so a daemon is `<root>/*/*`;
- the DRA driver (cmd/gpu-kubelet-plugin/sharing.go): one daemon per resource claim,
  `<plugins dir>/gpu.nvidia.com/mps/<claim UID>-<5 hex>/{pipe,shm,log}`, created when the
  claim is prepared and removed, directory and all, when it is released.

A daemon is a directory that a pattern matches whose `pipe/control` exists; its log
directory is the sibling `log`. Its name is the path below the pattern's fixed prefix
(`nvidia.com/gpu`, `<claim UID>-<hash>`). `DaemonSet.current()` re-scans at most every
`interval` seconds; what it returns replaces the last list (sources keep their per-daemon
state by name and drop a name that left).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .config import DRA, GLOB, LAYOUTS, DaemonConfig, DiscoveryRoot
from .contract import MAX_DISCOVERED

log = logging.getLogger(__name__)

CONTROL_PIPE = "control"  # what MPS creates in a pipe directory while its daemon runs
# The DRA driver names a daemon's directory <claim UID>-<5 hex of sha256 of the device UUIDs>.
_DRA_DIRECTORY = re.compile(r"^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})-[0-9a-f]{5}$")


def root_pattern(root: DiscoveryRoot) -> str:
    """The glob of daemon directories for one root."""
    if root.layout == GLOB:
        return root.path.rstrip("/") or "/"
    return os.path.join(root.path, LAYOUTS[root.layout].below_root)


def fixed_prefix(pattern: str) -> str:
    """The directory part of `pattern` before its first glob character: names are relative to it."""
    first = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    return pattern[:pattern.rfind("/", 0, first) + 1]


def claim_uid(layout: str, name: str) -> str:
    """The resource claim of a DRA daemon (its directory's UUID part), else empty."""
    m = _DRA_DIRECTORY.match(name) if layout == DRA else None
    return m.group(1) if m else ""


def scan(roots: Sequence[DiscoveryRoot], exists: Callable[[str], bool] = os.path.exists,
         expand: Callable[[str], List[str]] = glob.glob) -> List[DaemonConfig]:
    """The daemon directories under `roots` now, sorted by name (the first root wins a name)."""
    found: Dict[str, DaemonConfig] = {}
    for root in roots:
        pattern = root_pattern(root)
        prefix = fixed_prefix(pattern)
        for directory in sorted(expand(pattern)):
            pipe = os.path.join(directory, "pipe")
            name = directory[len(prefix):].strip("/") or directory
            if name in found or not exists(os.path.join(pipe, CONTROL_PIPE)):
                continue
            if len(found) >= MAX_DISCOVERED:
                log.warning("discovery: more than %d daemon directories; ignoring %s", MAX_DISCOVERED, directory)
                break
            found[name] = DaemonConfig(name, pipe, os.path.join(directory, "log"), layout=root.layout,
                                       claim_uid=claim_uid(root.layout, name))
    return [found[n] for n in sorted(found)]


class DaemonSet:
    """The daemons to watch now: `static` (flags, config file) and, every `interval`
    seconds at most, those found under `roots`. Thread-safe; `current()` is cheap between scans."""

    def __init__(self, static: Sequence[DaemonConfig], roots: Sequence[DiscoveryRoot] = (),
                 interval: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.static = list(static)
        self.roots = list(roots)
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._next_scan = float("-inf")
        self._current: Tuple[DaemonConfig, ...] = tuple(self.static)

    def current(self) -> List[DaemonConfig]:
        if self.roots and self._clock() >= self._next_scan:
            self.rescan()
        return list(self._current)

    def between_scans(self) -> Optional[List[DaemonConfig]]:
        """`current()` where no scan is due now; None where it would scan."""
        if self.roots and self._clock() >= self._next_scan:
            return None
        return list(self._current)

    def rescan(self) -> List[DaemonConfig]:
        """Scan the roots now (whatever the interval)."""
        with self._lock:
            self._next_scan = self._clock() + self.interval
            static_names = {d.name for d in self.static}
            static_pipes = {os.path.realpath(d.pipe_directory) for d in self.static}
            found = [d for d in scan(self.roots) if d.name not in static_names
                     and os.path.realpath(d.pipe_directory) not in static_pipes]
            now = tuple(self.static + found)
            if [d.name for d in now] != [d.name for d in self._current]:
                before = {d.name for d in self._current}
                added = [d.name for d in now if d.name not in before]
                gone = before - {d.name for d in now}
                log.info("daemons: %d watched (added %s, gone %s)", len(now), added[:8], sorted(gone)[:8])
            self._current = now
            return list(now)


def find_control_daemon(pipe_directory: str, proc_root: str,
                        hint: Optional[int] = None) -> Optional[Tuple[int, List[str]]]:
    """(pid, argv) of the `nvidia-cuda-mps-control` process that serves `pipe_directory`, as
    seen in `proc_root`; None where none can be told (another PID namespace, no permission).

    The daemon's pipe directory is its CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)
    inside its own root: in a container or chroot (the DRA driver's daemon pod) that path
    differs from ours, so the directories are compared by device and inode through
    /proc/PID/root. `hint`: a PID to try first (the daemon's pid file)."""
    try:
        target = os.stat(pipe_directory)
    except OSError:
        return None
    try:
        pids = [int(p) for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return None
    if hint is not None and hint in pids:
        pids.remove(hint)
        pids.insert(0, hint)
    for pid in pids:
        argv = _control_argv(os.path.join(proc_root, str(pid)))
        if argv is None:
            continue
        pipe = _environ(os.path.join(proc_root, str(pid)), "CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
        try:
            st = os.stat(os.path.join(proc_root, str(pid), "root") + "/" + pipe.lstrip("/"))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return pid, argv
    return None


def _control_argv(proc_dir: str) -> Optional[List[str]]:
    """A control daemon's argv (`nvidia-cuda-mps-control -d|-f ...`), else None."""
    try:
        with open(os.path.join(proc_dir, "cmdline"), "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    if not argv or os.path.basename(argv[0]) != "nvidia-cuda-mps-control":
        return None
    return argv if {"-d", "-f"} & set(argv[1:]) else None


def _environ(proc_dir: str, key: str) -> Optional[str]:
    try:
        with open(os.path.join(proc_dir, "environ"), "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return None
    prefix = key.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode("utf-8", "replace")
    return None


def daemon_environ(proc_root: str, pid: int, key: str) -> Optional[str]:
    """One variable of a process's environment as it was started; None where unset or
    unreadable."""
    return _environ(os.path.join(proc_root, str(pid)), key)


def is_multiuser(argv: Sequence[str]) -> bool:
    """`-M`: one server for every user; clients of different users never queue for each other."""
    return "-M" in argv[1:]
