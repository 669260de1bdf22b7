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

Beside the layouts (`--mps.discover-processes`, on by default), every
`nvidia-cuda-mps-control -d|-f` process in /proc is a daemon wherever it was started
(systemd on Amazon ECS, Slurm prologs, GKE, a pod): its pipe and log directories are its
CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY (MPS's defaults where unset), paths in
its own root, reached through /proc/PID/root. One found by layout or named in the flags
too (the same pipe directory by device and inode) keeps that name; else it is named by
its pipe directory where the host (PID 1's root) sees that directory at the same path,
and `<pid>:<path>` where only the daemon's root has it (a container's own /tmp).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import threading
import time
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

from .config import (DEFAULT_LOG_DIRECTORY, DEFAULT_PIPE_DIRECTORY, DRA, GLOB, LAYOUTS, PROCESS, DaemonConfig,
                     DiscoveryRoot)
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


# A process's comm is its program's name cut to 15 characters: the control daemon's and its
# servers' (nvidia-cuda-mps-server) alike. Only these have their cmdline read.
CONTROL_COMM = b"nvidia-cuda-mps"


def _comm(proc_dir: str) -> bytes:
    """A process's comm; b"" where it is gone. os.open, not open(): this runs for every process."""
    try:
        fd = os.open(proc_dir + "/comm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, 64).rstrip(b"\n")
    except OSError:
        return b""
    finally:
        os.close(fd)


# A comm read alike at two scans is read again only this often (CommReader), or at once
# where a new process is named nvidia-cuda-mps.
COMM_RECHECK_SECONDS = 300.0


class CommReader:
    """Each process's comm for scan_processes, read again only where it may have changed.
    A process's comm changes only when it exec()s: one read alike at two scans in a row is
    settled, and read again only in a full pass. So a process caught between its fork and
    its exec (systemd starting a daemon with -f) is read again at the next scan. One that
    exec()s the daemon long after it started is found in a full pass: at the scan where a
    new process is named nvidia-cuda-mps (the server its first client starts; a command's
    short-lived `nvidia-cuda-mps-control` caught by a scan costs a pass too), else within
    `recheck` seconds. A node's scan read ~400 comm files every 5 s: a third of the control
    thread's CPU (issue 44); then the full pass every 60 s was a fifth of the exporter's at
    15 s scrapes (6 ms a pass of 385 comms on the synthetic node)."""

    def __init__(self, recheck: float = COMM_RECHECK_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.recheck = recheck
        self._clock = clock
        self._next_full = float("-inf")
        # By PID as /proc lists it: its comm; those not settled; those named CONTROL_COMM.
        # Kept as sets, a scan of a listing that changed costs set operations in C and a read
        # of the new and unsettled PIDs, not a pass over every process in Python (a node's
        # 700 processes: 0.42 ms a scan, issue 44).
        self._comms: Dict[str, bytes] = {}
        self._unsettled: Set[str] = set()
        self._control: Set[str] = set()
        self._names: List[str] = []  # the last listing
        self._listed: FrozenSet[str] = frozenset()  # its names
        self._answer: List[int] = []  # its daemons' PIDs, in order

    def read(self, proc_root: str, pids: Iterable[str]) -> bool:
        """Read the comm of each of `pids` (as /proc lists them; b"" where gone): settled
        where it is what was read last time. Whether one is named CONTROL_COMM that was not."""
        started = False
        for pid in pids:
            comm = _comm(f"{proc_root}/{pid}")
            settled = self._comms.get(pid) == comm
            started = started or comm == CONTROL_COMM and not settled
            self._comms[pid] = comm
            (self._unsettled.discard if settled else self._unsettled.add)(pid)
            (self._control.add if comm == CONTROL_COMM else self._control.discard)(pid)
        return started

    def control_pids(self, proc_root: str) -> Optional[List[int]]:
        """The PIDs in `proc_root` whose comm is CONTROL_COMM, in order; None where it cannot
        be listed. Where the listing is the last one, every comm in it settled and no full
        pass is due, the last answer again: nothing read, nothing parsed (a steady node's
        400 processes cost three passes over them per scan otherwise). Else the comms of
        the new processes and the unsettled ones are read, and in a full pass every one."""
        try:
            names = os.listdir(proc_root)
        except OSError:
            return None
        now = self._clock()
        full = now >= self._next_full
        if names == self._names and not self._unsettled and not full:
            return self._answer
        listed = frozenset(names)
        for pid in self._listed - listed:  # gone
            self._comms.pop(pid, None)
            self._unsettled.discard(pid)
            self._control.discard(pid)
        todo = [pid for pid in (listed if full else listed - self._listed) if pid.isdigit()]
        if not full:
            todo += self._unsettled  # none gone, none new: those read once, or changed since
        if self.read(proc_root, todo) and not full:  # a daemon that exec()ed in place may have started it
            full = True
            done = set(todo)
            self.read(proc_root, [pid for pid in self._comms if pid not in done])
        if full:
            self._next_full = now + self.recheck
        self._names, self._listed = names, listed
        self._answer = sorted(int(pid) for pid in self._control)
        return self._answer


def identity(path: str) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of what `path` names now; None where it is not there."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _inside(root: str, path: str) -> str:
    """`path` of a process's own file system, through its /proc/PID/root."""
    return root + "/" + path.lstrip("/")


def scan_processes(proc_root: str, limit: int = MAX_DISCOVERED,
                   comms: Optional[CommReader] = None) -> List[DaemonConfig]:
    """Every control daemon process in `proc_root` now, one per pipe directory, sorted by
    name (layout PROCESS). Lists `proc_root` once; reads the `comm` of each process (through
    `comms`, where given, but those it holds settled: none where the listing is the last
    one) and the cmdline and environ of the few named nvidia-cuda-mps."""
    pids = (comms or CommReader()).control_pids(proc_root)
    if pids is None:
        return []
    host = os.path.join(proc_root, "1", "root")  # the host's root where we share its PID namespace
    found: Dict[Tuple[int, int], DaemonConfig] = {}
    for pid in pids:
        proc_dir = f"{proc_root}/{pid}"
        argv = _control_argv(proc_dir)
        if argv is None:
            continue
        env = _environ_all(proc_dir, ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"))
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
        log_dir = env.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY
        root = os.path.join(proc_dir, "root")
        ident = identity(_inside(root, pipe))
        if ident is None or ident in found:  # gone, not ours to see, or its -d parent and child
            continue
        if len(found) >= limit:
            log.warning("discovery: more than %d control daemon processes; ignoring pid %d", limit, pid)
            break
        ours = identity(pipe) == ident  # the same directory at the same path here: use that
        name = pipe if ours or identity(_inside(host, pipe)) == ident else f"{pid}:{pipe}"
        log_here = ours and identity(log_dir) == identity(_inside(root, log_dir))
        found[ident] = DaemonConfig(name, pipe if ours else _inside(root, pipe),
                                    log_dir if log_here else _inside(root, log_dir), layout=PROCESS)
    return sorted(found.values(), key=lambda d: d.name)


class DaemonSet:
    """The daemons to watch now: `static` (flags, config file) and, every `interval`
    seconds at most, those found under `roots` and (`processes`) the control daemon
    processes in `proc_root`. Thread-safe; `current()` is cheap between scans."""

    def __init__(self, static: Sequence[DaemonConfig], roots: Sequence[DiscoveryRoot] = (),
                 interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 processes: bool = False, proc_root: str = "/proc") -> None:
        self.static = list(static)
        self.roots = list(roots)
        self.processes = processes
        self.proc_root = proc_root
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._next_scan = float("-inf")
        self._current: Tuple[DaemonConfig, ...] = tuple(self.static)
        self._comms = CommReader(clock=clock)

    def current(self) -> List[DaemonConfig]:
        if (self.roots or self.processes) and self._clock() >= self._next_scan:
            self.rescan()
        return list(self._current)

    def between_scans(self) -> Optional[List[DaemonConfig]]:
        """`current()` where no scan is due now; None where it would scan."""
        if (self.roots or self.processes) and self._clock() >= self._next_scan:
            return None
        return list(self._current)

    def _processes(self, static: List[DaemonConfig],
                   found: Sequence[DaemonConfig]) -> Tuple[List[DaemonConfig], List[DaemonConfig]]:
        """(`static`, the daemon processes that no flag, file or layout names already: by the
        pipe directory's device and inode, the earlier name wins). A static daemon whose pipe
        directory the exporter cannot see (a container without that mount) but a daemon
        process has at that path on the host is that daemon, reached through its root."""
        processes = scan_processes(self.proc_root, comms=self._comms)
        by_name = {d.name: d for d in processes}
        adopted = []
        for i, d in enumerate(static):
            p = by_name.get(os.path.normpath(d.pipe_directory)) if identity(d.pipe_directory) is None else None
            if p is not None and p.name not in adopted:
                log_dir = d.log_directory if os.path.isdir(d.log_directory) else p.log_directory
                static[i] = dataclasses.replace(d, pipe_directory=p.pipe_directory, log_directory=log_dir)
                adopted.append(p.name)
        known = static + list(found)
        names = {d.name for d in known}
        seen = {identity(d.pipe_directory) for d in known} - {None}
        room = max(0, MAX_DISCOVERED - len(found))
        new = [d for d in processes if d.name not in names and d.name not in adopted
               and identity(d.pipe_directory) not in seen]
        if len(new) > room:
            log.warning("discovery: more than %d daemons; ignoring %d found by process", MAX_DISCOVERED,
                        len(new) - room)
        return static, new[:room]

    def rescan(self) -> List[DaemonConfig]:
        """Scan the roots now (whatever the interval)."""
        with self._lock:
            self._next_scan = self._clock() + self.interval
            static_names = {d.name for d in self.static}
            static_pipes = {os.path.realpath(d.pipe_directory) for d in self.static}
            found = [d for d in scan(self.roots) if d.name not in static_names
                     and os.path.realpath(d.pipe_directory) not in static_pipes]
            static = list(self.static)
            if self.processes:
                static, processes = self._processes(static, found)
                found += processes
            now = tuple(static + found)
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


def _environ_all(proc_dir: str, keys: Sequence[str]) -> Dict[str, str]:
    """Those of `keys` the process was started with (one read of its environ)."""
    try:
        with open(os.path.join(proc_dir, "environ"), "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    wanted = {k.encode() + b"=": k for k in keys}
    out: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, eq, _ = item.partition(b"=")
        name = wanted.get(key + eq)
        if name is not None and name not in out:
            out[name] = item[len(key) + 1:].decode("utf-8", "replace")
    return out


def daemon_environ(proc_root: str, pid: int, key: str) -> Optional[str]:
    """One variable of a process's environment as it was started; None where unset or
    unreadable."""
    return _environ(os.path.join(proc_root, str(pid)), key)


MULTIUSER_FLAGS = frozenset({"-M", "--multiuser-server"})  # the ECS GPU AMI's unit spells it long


def is_multiuser(argv: Sequence[str]) -> bool:
    """`-M` or `--multiuser-server`: one server for every user; clients of different users
    never queue for each other."""
    return any(a in MULTIUSER_FLAGS for a in argv[1:])
