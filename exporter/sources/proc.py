"""/proc facts about MPS servers and clients.

Per PID: real uid and user name, command name, start time, container id and pod
uid from the cgroup path (and the container's namespace, pod and container names
from the runtime's files or the kubelet: runtime_metadata.py; a Slurm job and step
from where slurmstepd put it), and from the
environment exactly four variables: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_CLIENT_PRIORITY and CUDA_VISIBLE_DEVICES
(the pinned limit's device keys count the client's visible devices). Limits a client
sets there are invisible to the control daemon (the capture shows
`get_active_thread_percentage` still saying 100.0), so this is the only place they
can be read. They are kept as written (limits.own_limits reads them as CUDA does); no
other variable is kept, exported or logged.

PIDs are host PIDs (NVML and the daemon's `ps` report them), so the exporter
must run in the host PID namespace (`hostPID: true` in Kubernetes). A process
that exits while it is being read is skipped.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import dataclasses
from dataclasses import dataclass, field
from typing import (AbstractSet, Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Protocol,
                    Sequence, Set, Tuple)

from ..config import Config
from ..model import Derived, ProcessFacts, Snapshot
from ..config import DEFAULT_RUNTIME_ROOTS
from ..runtime_metadata import NO_NAMES, SLURM, PodNameLookup, PodNames, kubelet_fetcher
from .base import Backends, Flag, ReadContext, Reader, Source, not_empty

log = logging.getLogger(__name__)

KEPT_ENV_VARS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_CLIENT_PRIORITY",
                 "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY")
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # MPS's, where CUDA_MPS_PIPE_DIRECTORY is unset
MAX_ENV_VALUE = 1024  # longer values are cut: nothing CUDA accepts is that long

# ------------------------------------------------------------------ parsers
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# The kubelet's pod cgroup: `pod<uid>` (cgroupfs driver), `kubepods[-<qos>]-pod<uid>.slice` (systemd).
_POD_SEGMENT = re.compile(rf"(?:[a-z][a-z-]*-)?pod({_UUID})(?:\.slice)?")
# The runtime's container cgroup: `<id>` (cgroupfs), `cri-containerd-<id>.scope`, `crio-<id>.scope`,
# `docker-<id>.scope` (systemd).
_CONTAINER_SEGMENT = re.compile(r"(?:[a-z][a-z-]*-)?([0-9a-f]{64})(?:\.scope)?")


def _cgroup_path_ids(path: str) -> Tuple[str, str]:
    """(container_id, pod_uid) of one cgroup path: the container id only where the
    runtime writes it, the segment right below the pod's (the first pod segment from
    the root: the kubelet's); outside a pod, the first container segment from the root.
    A process may make cgroups below its own (a privileged pod with a writable cgroupfs):
    they are never read, so a sub-cgroup named after another container cannot claim it."""
    segments = path.split("/")
    for i, segment in enumerate(segments):
        pod = _POD_SEGMENT.fullmatch(segment)
        if pod:
            below = _CONTAINER_SEGMENT.fullmatch(segments[i + 1]) if i + 1 < len(segments) else None
            return (below.group(1) if below else ""), pod.group(1).replace("_", "-")
    for segment in segments:
        container = _CONTAINER_SEGMENT.fullmatch(segment)
        if container:
            return container.group(1), ""
    return "", ""


def _container_cgroup(path: str) -> str:
    """The cgroup of the container `_cgroup_path_ids` names outside a pod: the path down to
    the first container segment ("" where none)."""
    segments = path.split("/")
    for i, segment in enumerate(segments):
        if _CONTAINER_SEGMENT.fullmatch(segment):
            return "/".join(segments[:i + 1])
    return ""


def container_cgroups(text: str) -> Dict[str, str]:
    """Hierarchy ("N:controllers") -> its container cgroup, of /proc/PID/cgroup: two
    processes are in one container where these are equal and name one."""
    found = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found[parts[0] + ":" + parts[1]] = _container_cgroup(parts[2].strip())
    return found


# Slurm's job cgroups, made by slurmstepd where only root writes (cgroup/v2:
# `/system.slice/[<node>_]slurmstepd.scope/<job>/step_<step>/...`; cgroup/v1, one tree per
# controller: `/slurm[_<node>]/uid_<uid>/<job>/step_<step>/...`). The job directory is
# `job_<id>`, or from Slurm 26.05 the job's SLUID (`s` and 13 base-32 digits) unless
# cgroup.conf says CgroupJobIdPaths=yes. Anything below the step (the job's own `user/`
# subtree) is never read; the same names anywhere else (a user's systemd manager can make
# `.../user@1000.service/app.slice/slurmstepd.scope/job_<victim>`) name no job.
_SLURM_V2_SCOPE = re.compile(r"(?:[A-Za-z0-9.-]+_)?slurmstepd\.scope")
_SLURM_V1_ROOT = re.compile(r"slurm(?:_[A-Za-z0-9.-]+)?")
_SLURM_UID = re.compile(r"uid_[0-9]+")
_SLURM_JOB = re.compile(r"job_([0-9]{1,10})|(s[0-9A-Z]{13})")
_SLURM_STEP = re.compile(r"step_([0-9]{1,10}|batch|extern|interactive)")


def _slurm_path_ids(path: str) -> Tuple[str, str]:
    """(job, step) of one cgroup path, "" where it is no Slurm job's. The leading `..` of a
    path outside the exporter's own cgroup namespace are dropped: the tree below them is
    the host's (run the exporter in the host's cgroup namespace, or one not inside
    system.slice)."""
    segments = [s for s in path.split("/") if s]
    while segments and segments[0] == "..":
        segments.pop(0)
    if len(segments) >= 3 and segments[0] == "system.slice" and _SLURM_V2_SCOPE.fullmatch(segments[1]):
        below = segments[2:]
    elif len(segments) >= 3 and _SLURM_V1_ROOT.fullmatch(segments[0]) and _SLURM_UID.fullmatch(segments[1]):
        below = segments[2:]
    else:
        return "", ""
    job = _SLURM_JOB.fullmatch(below[0])
    if not job:
        return "", ""
    step = _SLURM_STEP.fullmatch(below[1]) if len(below) > 1 else None
    return job.group(1) or job.group(2), step.group(1) if step else ""


def parse_slurm_cgroup(text: str) -> Tuple[str, str]:
    """(job, step) from /proc/PID/cgroup: the job id (or SLUID) and step (a number, batch,
    extern, interactive; "" in the job's own cgroup) where slurmstepd put the process,
    ("", "") elsewhere or where v1 hierarchies disagree."""
    found = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            ids = _slurm_path_ids(parts[2].strip())
            if ids != ("", ""):
                found.add(ids)
    return next(iter(found)) if len(found) == 1 else ("", "")


def parse_cgroup(text: str) -> Tuple[str, str]:
    """(container_id, pod_uid) from /proc/PID/cgroup, "" where absent.

    Handles cgroup v2 ("0::/path") and v1 ("N:controller:/path") with the path
    shapes of containerd and CRI-O under the systemd and cgroupfs drivers
    ("cri-containerd-<id>.scope", "crio-<id>.scope", ".../pod<uid>/<id>") and
    Docker ("docker-<id>.scope", "/docker/<id>"). Where v1 hierarchies name
    different containers or pods (a process moved in some of them), it names none.
    """
    found = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ids = _cgroup_path_ids(parts[2].strip())
        if ids != ("", ""):
            found.add(ids)
    return next(iter(found)) if len(found) == 1 else ("", "")


def parse_environ(data: bytes) -> Dict[str, str]:
    """Only the KEPT_ENV_VARS of a NUL-separated environment block."""
    wanted: Dict[str, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key.decode("ascii", "replace") in KEPT_ENV_VARS:
            wanted[key.decode("ascii")] = value[:MAX_ENV_VALUE].decode("utf-8", "replace")
    return wanted


def parse_status_uid(text: str) -> Optional[int]:
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


def parse_stat_start_ticks(text: str) -> Optional[int]:
    """Field 22 (starttime, clock ticks after boot); comm may hold spaces and ')'."""
    rest = text[text.rfind(")") + 2:].split()
    return int(rest[19]) if len(rest) > 19 and rest[19].isdigit() else None


def parse_boot_time(text: str) -> Optional[float]:
    m = re.search(r"^btime\s+(\d+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


# ------------------------------------------------------------------ source
def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)  # no passwd entry (e.g. a container's user): the number is the name


class ExitNews(Protocol):
    """exitstatus.ExitWatcher, as the source asks it which processes have not exited."""

    def mark(self) -> int: ...

    def unexited_since(self, marks: Mapping[int, int]) -> Set[int]: ...

    def quiet_since(self, mark: int) -> bool: ...


@dataclass(frozen=True)
class _Look:
    """The last look at a set of PIDs: the processes the kernel vouched for then (no stat(),
    no name to look up), and the rest, at `mark`."""

    pids: Iterable[int]
    keep: FrozenSet[int]
    mark: int
    vouched: Dict[int, ProcessFacts]
    rest: List[int]


@dataclass
class ProcClient:
    root: str = "/proc"
    user_name: Callable[[int], str] = _user_name
    clock_ticks: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))
    _boot_time: Optional[float] = None
    _users: Dict[int, str] = field(default_factory=dict)
    _environ_denied_logged: bool = False
    _refusal_logged: bool = False
    # pid -> (identity of /proc/PID, start ticks, facts). Everything read here is fixed
    # for a process's life (environ is the block it was started with), so a scrape only
    # tells a known process from a new one that reused its PID: procfs gives the new
    # process's /proc/PID another inode (number and ctime; seen with a PID reused through
    # ns_last_pid), so one stat() of the directory does, and where the inode changed for
    # another reason (dropped from the cache) the start time in /proc/PID/stat decides.
    # A stat() is a tenth of reading /proc/PID/stat (50 PIDs: 0.12 against 0.68 ms of CPU a read).
    _known: Dict[int, Tuple[Tuple[int, int], Optional[int], ProcessFacts]] = field(default_factory=dict)
    pod_names: PodNameLookup = field(default_factory=lambda: PodNameLookup(roots=()))
    renamed: int = 0  # facts given their container's names in place, so far
    # The kernel's process exits (serve's exit watcher, where it listens): a known process
    # it vouches has not exited since its last look is not looked at again (its PID cannot
    # have been reused), so a steady node's scrape costs no stat() per client (issue 44).
    exits: Optional[ExitNews] = None
    _looked: Dict[int, int] = field(default_factory=dict)  # pid -> exits.mark() at its last stat()
    _last_look: Optional["_Look"] = None

    def _read(self, pid: int, name: str) -> str:
        with open(os.path.join(self.root, str(pid), name), encoding="utf-8", errors="replace") as f:
            return f.read()

    def boot_time(self) -> Optional[float]:
        if self._boot_time is None:
            try:
                with open(os.path.join(self.root, "stat"), encoding="ascii", errors="replace") as f:
                    self._boot_time = parse_boot_time(f.read())
            except OSError:
                return None
        return self._boot_time

    def read(self, pids: Iterable[int], keep: AbstractSet[int] = frozenset()) -> Dict[int, ProcessFacts]:
        """Facts of these PIDs; the known processes not among them or in `keep` are forgotten."""
        facts = self._facts(pids, keep, read_new=True)
        assert facts is not None  # reading new processes, it never declines
        return facts

    def cached(self, pids: Iterable[int], keep: AbstractSet[int] = frozenset()) -> Optional[Dict[int, ProcessFacts]]:
        """`read(pids, keep)` where every PID is a known process whose names need no
        lookup: one stat() each, nothing read. None where one is new, reused or not yet
        named (nothing forgotten then)."""
        return self._facts(pids, keep, read_new=False)

    def _facts(self, pids: Iterable[int], keep: AbstractSet[int], read_new: bool) -> Optional[Dict[int, ProcessFacts]]:
        """`read_new`: a new or reused process is read, and a container's names looked up
        (the kubelet asked) where they are not known yet; else either makes this None."""
        given = pids
        exits, looked, last = self.exits, self._looked, self._last_look
        facts: Dict[int, ProcessFacts] = {}
        vouched: Dict[int, ProcessFacts] = {}
        if (last is not None and exits is not None and last.pids is given and last.keep == keep
                and exits.quiet_since(last.mark)):
            # These very PIDs again, and nothing the kernel says changed since: those it vouched
            # for then still are, and only the rest are looked at (a steady node's scrape: the servers).
            facts.update(last.vouched)
            vouched = last.vouched  # copied where it grows
            todo: Iterable[int] = last.rest
            known_before: Iterable[int] = last.rest  # all else was reconciled at the last look
        else:
            todo = given if isinstance(given, AbstractSet) else set(given)
            known_before = self._known
        unexited = exits.unexited_since({pid: looked[pid] for pid in todo if pid in looked}) if exits else set()
        mark = exits.mark() if exits else 0
        rest = []
        self._last_look = None
        for pid in todo:
            try:
                known = self._known.get(pid)
                if known is not None and pid in unexited:
                    identity = known[0]
                else:
                    st = os.stat(f"{self.root}/{pid}")
                    identity = (st.st_ino, st.st_ctime_ns)
                    if exits is not None:
                        looked[pid] = mark
                if known is None or known[0] != identity:
                    if not read_new:
                        return None
                    ticks = parse_stat_start_ticks(self._read(pid, "stat"))
                    same = known[2] if known is not None and known[1] == ticks else None
                    known = self._known[pid] = (identity, ticks, same or self.read_pid(pid, ticks))
            except (FileNotFoundError, ProcessLookupError):
                rest.append(pid)
                continue  # exited while we read it
            except OSError:
                if read_new:
                    raise
                return None  # read() says what went wrong
            found = known[2]
            # A container's names are asked every read (a cache hit) until found, since a
            # name the kubelet did not know yet at the process's first read may come later.
            if found.container_id and not found.owner:
                lookup = self.pod_names.names if read_new else self.pod_names.known
                names = lookup(found.container_id)
                if names is None or (names.init_pid and not read_new):
                    return None  # Docker's proof reads the init's cgroup: the source's thread does
                if names != NO_NAMES and not self._confirmed(pid, found, names):
                    self._refuse(pid, found, names)
                elif names != NO_NAMES:
                    named = (names.namespace, names.pod, names.container, found.pod_uid or names.pod_uid, names.owner)
                    if named != (found.namespace, found.pod, found.container, found.pod_uid, found.owner):
                        found.namespace, found.pod, found.container, found.pod_uid, found.owner = named
                        self.renamed += 1
                rest.append(pid)
            elif pid in unexited:
                if last is not None and vouched is last.vouched:
                    vouched = dict(vouched)
                vouched[pid] = found
            else:
                rest.append(pid)
            facts[pid] = found
        for pid in set(known_before) - facts.keys() - keep:
            self._known.pop(pid, None)
            looked.pop(pid, None)
        if exits is not None:
            self._last_look = _Look(given, frozenset(keep), mark, vouched, rest)
        return facts

    def _confirmed(self, pid: int, found: ProcessFacts, names: PodNames) -> bool:
        """Whether `names` are the process's: the runtime's pod is the cgroup's (Kubernetes),
        or the process's container cgroup is the one Docker's recorded init is in (Docker,
        ECS). A failed Docker proof looks the id up once more: a restarted container keeps
        its id with a new init."""
        if not names.confirms(found.pod_uid):
            return False
        if not names.init_pid:
            return True
        if self._in_container_of(pid, names.init_pid):
            return True
        self.pod_names.forget(found.container_id)
        again = self.pod_names.names(found.container_id)
        return bool(again.init_pid) and again.init_pid != names.init_pid and self._in_container_of(pid, again.init_pid)

    def _in_container_of(self, pid: int, init_pid: int) -> bool:
        try:
            own, init = (container_cgroups(self._read(p, "cgroup")) for p in (pid, init_pid))
        except (OSError, ValueError):
            return False
        return own == init and any(own.values())

    def _refuse(self, pid: int, found: ProcessFacts, names: PodNames) -> None:
        """The runtime puts the container the cgroup names in another pod than the cgroup
        does, or Docker runs it in another cgroup: not this process's container (a cgroup
        made to look like another's). It keeps its own pod uid (the kubelet's segment) and
        no container."""
        level = logging.DEBUG if self._refusal_logged else logging.WARNING
        self._refusal_logged = True
        where = (f"Docker runs in the cgroup of PID {names.init_pid}, not this one" if names.init_pid
                 else f"the runtime puts in pod {names.pod_uid or '(none)'}")
        log.log(level, "PID %d: its cgroup names container %s in pod %s, which %s (%s/%s/%s): not attributed",
                pid, found.container_id, found.pod_uid or "(none)", where, names.namespace, names.pod, names.container)
        found.container_id = ""

    def read_pid(self, pid: int, ticks: Optional[int]) -> ProcessFacts:
        facts = ProcessFacts(pid=pid)
        facts.uid = parse_status_uid(self._read(pid, "status"))
        if facts.uid is not None:
            if facts.uid not in self._users:
                self._users[facts.uid] = self.user_name(facts.uid)
            facts.user = self._users[facts.uid]
        facts.command = self._read(pid, "comm").strip()
        boot = self.boot_time()
        if ticks is not None and boot is not None:
            facts.start_time_seconds = boot + ticks / self.clock_ticks
        try:
            cgroup = self._read(pid, "cgroup")
        except PermissionError:
            cgroup = ""
        facts.container_id, facts.pod_uid = parse_cgroup(cgroup)
        if not (facts.container_id or facts.pod_uid):
            job, step = parse_slurm_cgroup(cgroup)
            if job:
                # `slurm` in the namespace column, so that dashboards select jobs as pods
                facts.owner, facts.namespace, facts.pod_uid, facts.pod, facts.container = SLURM, SLURM, job, job, step
        try:
            with open(os.path.join(self.root, str(pid), "environ"), "rb") as f:
                env = parse_environ(f.read())
        except PermissionError:
            if not self._environ_denied_logged:
                log.warning("cannot read /proc/PID/environ of other users' processes (needs CAP_SYS_PTRACE): "
                            "client-set MPS limits will be missing")
                self._environ_denied_logged = True
            env = {}
        else:
            facts.mps_pipe = self.pipe_identity(pid, env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)
        facts.environ = env
        return facts

    def pipe_identity(self, pid: int, pipe: str) -> Optional[Tuple[int, int]]:
        """The directory a process's `pipe` path names inside its own root (a container's
        /tmp/nvidia-mps is the host's daemon directory mounted there); None where it is not
        there or cannot be looked at."""
        try:
            st = os.stat(os.path.join(self.root, str(pid), "root") + "/" + pipe.lstrip("/"))
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return None
        return st.st_dev, st.st_ino


def http_url(value: str) -> str:
    if value and not value.startswith(("https://", "http://")):
        raise ValueError(f"{value!r}: give an http(s) URL")
    return value


def directory(value: str) -> str:
    """An existing directory: a procfs path that is not one would be read as a /proc
    without processes, the collector reporting success (issue 43)."""
    if not value:
        raise ValueError("must not be empty")
    if not os.path.isdir(value):
        raise ValueError(f"{value!r}: {'not a directory' if os.path.exists(value) else 'no such directory'}")
    return value


def file_or_empty(value: str) -> str:
    if value and not os.path.isfile(value):
        raise ValueError(f"{value!r}: no such file")
    return value


def mps_pids(snap: Snapshot) -> FrozenSet[int]:
    """The servers and clients the daemons and NVML name: the PIDs /proc is asked about;
    the very set of the last call while they stay (ProcClient then asks only about the
    processes the kernel did not vouch for)."""
    lists: List[Sequence[Any]] = [d.clients for d in snap.daemons]
    if snap.nvml:
        lists += [g.mps_clients for g in snap.nvml.gpus] + [g.compute_processes for g in snap.nvml.gpus]
    listed = _listed.get(lists, None, lambda: frozenset(p.pid for entries in lists for p in entries))
    servers = frozenset(s.pid for d in snap.daemons for s in d.servers)
    return _named.get((listed,), servers, lambda: servers | listed)


# The PIDs of the ps answers and NVML's lists, and with the servers: a scrape asks twice,
# and the lists mostly stay.
_listed: Derived[FrozenSet[int]] = Derived()
_named: Derived[FrozenSet[int]] = Derived()


class ProcSourceSpec(Source[Dict[int, ProcessFacts]]):
    name = "proc"
    help = "/proc facts of servers and clients: user, command, start, container, client-set limits"
    reading_type = Dict[int, ProcessFacts]
    flags = (
        Flag("--path.procfs", "procfs", "procfs mount point, /host/proc in a container (default %(default)s)",
             refuses=("", "/nonexistent/proc", "/dev/null"), check=directory),
        Flag("--path.runtime-root", "runtime_roots", "directory where the container runtime keeps each container's "
             "OCI bundle or Docker's state (<dir>/<container id>/), which names a client's namespace, pod and container "
             f"(repeatable; default: {', '.join(DEFAULT_RUNTIME_ROOTS)}: containerd's, CRI-O's and Docker's, whose "
             "config.v2.json names a Docker container or ECS task)",
             refuses=("",), repeatable=True,
             check=lambda paths: tuple(not_empty(p) for p in paths)),
        Flag("--kubelet.url", "kubelet_url", "the node's kubelet (e.g. https://$NODE_IP:10250): its /pods names the "
             "containers the runtime's files do not (needs the nodes/pods permission; default: not asked)",
             refuses=("ftp://node:10250", "node:10250"), check=http_url),
        Flag("--kubelet.token-file", "kubelet_token_file", "bearer token for the kubelet (default %(default)s)",
             refuses=("",), check=not_empty),
        Flag("--kubelet.ca-file", "kubelet_ca_file", "CA certificate of the kubelet's serving certificate "
             "(default: the service account's CA where mounted, else the system's)",
             refuses=("/nonexistent/ca.crt", "/"), check=file_or_empty),
    )

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[Dict[int, ProcessFacts]]]:
        kubelet = (kubelet_fetcher(cfg.kubelet_url, cfg.kubelet_token_file, cfg.kubelet_ca_file)
                   if cfg.kubelet_url else None)
        source = ProcClient(root=cfg.procfs, pod_names=PodNameLookup(roots=cfg.runtime_roots, kubelet=kubelet))
        last: List[Tuple[Optional[Dict[int, ProcessFacts]], int]] = [(None, 0)]  # reading, `source.renamed` then

        def gathered(ctx: ReadContext, facts_of: Callable[..., Optional[Dict[int, ProcessFacts]]]
                     ) -> Optional[Dict[int, ProcessFacts]]:
            # The PIDs known at once (NVML's latest reading, the daemon's last answer) first,
            # while this collection's control read may still run; then those its answer adds.
            # Serialised, a storm scrape waited for the control wait and then for /proc (issue 29).
            early = mps_pids(ctx.known(("nvml", "control")))
            facts = facts_of(early)
            if facts is None:
                return None
            pids = mps_pids(ctx.wait(("nvml", "control")))
            if pids - early:
                added = facts_of(pids - early, keep=early)
                if added is None:
                    return None
                facts.update(added)
            # Where no PID was added and none left while read, the facts are for these PIDs alone.
            found = facts if pids is early and len(facts) == len(pids) else {
                pid: facts[pid] for pid in pids if pid in facts}
            # The last reading again where equal and nothing was named in place since, so
            # that what is joined from it is known unchanged by identity (join, issue 44).
            last_found, renamed = last[0]
            if last_found is not None and found == last_found and renamed == source.renamed:
                return last_found
            last[0] = found, source.renamed
            return found

        def read(ctx: ReadContext) -> Dict[int, ProcessFacts]:
            facts = gathered(ctx, source.read)
            assert facts is not None  # read() never declines
            return facts

        def quick(ctx: ReadContext) -> Optional[Dict[int, ProcessFacts]]:
            # Known processes only (a client storm's scrapes before and after its arrival):
            # a new one goes to the source's thread at once, to be read while control runs.
            return gathered(ctx, source.cached)

        def hear_exits(exits: ExitNews) -> None:
            source.exits = exits

        return Reader(read, quick=quick, hear_exits=hear_exits, source=source)

    def store(self, snap: Snapshot, reading: Dict[int, ProcessFacts]) -> None:
        snap.processes = reading

    def shift(self, reading: Dict[int, ProcessFacts], seconds: float) -> Dict[int, ProcessFacts]:
        return {pid: facts if facts.start_time_seconds is None
                else dataclasses.replace(facts, start_time_seconds=facts.start_time_seconds + seconds)
                for pid, facts in reading.items()}


SOURCE = ProcSourceSpec()
