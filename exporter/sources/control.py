"""The MPS control daemon: read-only commands through `nvidia-cuda-mps-control`.

Each command is one process (`echo CMD | nvidia-cuda-mps-control`) that costs
about 2 ms and writes about five lines into control.log (`ps`: one more per
client), so a scrape sends only what can have changed (`DaemonReader`): at a
steady state, `get_server_list` alone.

The exporter never changes MPS: `ControlClient` sends only the verbs in
`READ_ONLY_COMMANDS`, with numeric arguments, one command per process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import selectors
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar, cast

from ..codec import expect, recorded
from ..config import Config, DaemonConfig
from ..discovery import DaemonSet, daemon_environ, find_control_daemon, identity, is_multiuser
from ..limits import VisibleDevice, visible_devices
from ..model import DaemonReading, Derived, GpuReading, PsEntry, ServerFacts, Snapshot
from ..units import parse_size
from .base import (Backends, Flag, PartialFailure, ReadContext, Reader, Source, not_empty, not_negative, positive,
                   record_value, replay_value)

log = logging.getLogger(__name__)
T = TypeVar("T")

# verb -> number of numeric arguments it takes. Nothing else is ever sent.
READ_ONLY_COMMANDS: Dict[str, int] = {
    "get_server_list": 0,
    "ps": 0,
    "get_server_status": 1,  # <server pid>
    "get_client_list": 1,  # <server pid>
    "get_active_thread_percentage": 1,  # <server pid>
    "get_device_pinned_mem_limit": 2,  # <server pid> <device: ordinal or GPU UUID>
    "get_default_active_thread_percentage": 0,
    "get_default_device_pinned_mem_limit": 1,  # <device: ordinal or GPU UUID>
    "get_default_client_priority": 0,
    "get_device_client_list": 1,  # <server pid>: the devices its clients enumerated
}

# What the exporter can do without: a daemon that answers `Unknown command` to one of these
# costs the fields it answers, never the daemon's servers and clients. Recorded per driver
# family in tests/data/drivers: R470 knows neither `ps` (its clients then come from
# get_client_list and get_device_client_list) nor get_server_status, pinned memory limits,
# client priorities; R535 lacks get_server_status. get_server_list alone is not optional:
# its answer says the daemon is up.
OPTIONAL_COMMANDS: FrozenSet[str] = frozenset(READ_ONLY_COMMANDS) - {"get_server_list"}

MAX_PARALLEL_DAEMONS = 16  # daemons read at once in one scrape

_NUMBER = re.compile(r"^[0-9]{1,10}$")
# A device named by its GPU UUID, as NVIDIA's DRA driver sets limits (issue 38): the only
# argument besides a number that is ever sent.
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
NO_DAEMON = "Cannot find MPS control daemon process"


class ControlError(Exception):
    """The daemon could not be asked or gave an answer we cannot read."""


class CommandNotAllowed(ControlError):
    """A command outside the read-only allowlist was about to be sent."""


class DaemonNotRunning(ControlError):
    pass


class UnknownCommand(ControlError):
    """The daemon does not know the verb (`Unknown command "<verb>"`): an older driver."""


UNKNOWN_COMMAND = "Unknown command"


class ServerNotFound(ControlError):
    """The server named in the command is gone (it exited between two commands)."""


# ------------------------------------------------------------------ parsers
def _lines(text: str) -> List[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def check_reply(text: str) -> str:
    """Raise on the daemon's error replies; return the text otherwise."""
    lines = _lines(text)
    if lines and lines[0] == NO_DAEMON:
        raise DaemonNotRunning(NO_DAEMON)
    if lines and re.match(r"^Server \d+ not found$", lines[0]):
        raise ServerNotFound(lines[0])
    if lines and lines[0].startswith(UNKNOWN_COMMAND):
        raise UnknownCommand(lines[0])
    return text


# More servers or clients than this in one answer is no answer (48 clients per device;
# one server per user and device): refused whole rather than planned for.
MAX_LISTED = 4096


def parse_pid_list(text: str) -> List[int]:
    """`get_server_list` / `get_client_list`: one PID per line, none when empty."""
    pids = []
    lines = _lines(check_reply(text))
    if len(lines) > MAX_LISTED:
        raise ControlError(f"{len(lines)} PIDs in one answer (more than {MAX_LISTED}): not believed")
    for line in lines:
        if not _NUMBER.match(line):
            raise ControlError(f"unexpected line in PID list: {line[:80]!r}")
        pids.append(int(line))
    return pids


_DEVICE_HEADING = re.compile(r"^\[([0-9]{1,4})\] ")
_DEVICE_CLIENT = re.compile(r"^([0-9]{1,10})\.[0-9]{1,10}$")


def parse_device_client_list(text: str) -> Dict[int, int]:
    """`get_device_client_list <server>`: client PID -> the daemon's ordinal of its device.

    Per device a heading `[0] 00:00.0, NVIDIA H200` (the ordinal the daemon counts in its
    CUDA_VISIBLE_DEVICES, a bus id, the name), then one `PID.N` line per client that
    enumerated it (driver 580, tests/data/captures/h200-driver580-a/control/ctl_busy.txt;
    N was 1 for each client there, its meaning is not documented). Nothing: no clients.
    A client on several devices keeps its first."""
    found: Dict[int, int] = {}
    ordinal: Optional[int] = None
    lines = _lines(check_reply(text))
    if len(lines) > MAX_LISTED:
        raise ControlError(f"{len(lines)} lines in one device client list (more than {MAX_LISTED}): not believed")
    for line in lines:
        heading, client = _DEVICE_HEADING.match(line), _DEVICE_CLIENT.match(line)
        if heading:
            ordinal = int(heading.group(1))
        elif client and ordinal is not None:
            found.setdefault(int(client.group(1)), ordinal)
        else:
            raise ControlError(f"unexpected line in device client list: {line[:80]!r}")
    return found


PS_HEADER = ("PID", "ID", "SERVER", "DEVICE", "NAMESPACE", "COMMAND")
PS_NO_SERVER = "Server not found"


MAX_COMMAND_CHARS = 4096  # of one client's command, continuation lines included (labels keep 128)


def _ps_row(line: str) -> Optional[PsEntry]:
    """One `ps` row, or None where the line is not one."""
    cols = line.split(None, 5)
    if len(cols) < 5 or not all(_NUMBER.match(c) for c in (cols[0], cols[1], cols[2])):
        return None
    return PsEntry(pid=int(cols[0]), client_id=int(cols[1]), server_pid=int(cols[2]), device=cols[3],
                   namespace=cols[4], command=cols[5] if len(cols) > 5 else "")


def parse_ps(text: str) -> List[PsEntry]:
    """`ps`: a header, then PID ID SERVER DEVICE NAMESPACE COMMAND per client.

    With no server running, driver 580 answers the bare line "Server not found"
    (seen live on an H200, tests/gpu/reports): no clients, not an error.

    COMMAND is the client's to choose, newlines included: a line that is not a row
    continues the command of the row above it (joined with its newline). One before any
    row is dropped. Only "\n" ends a row (not the other separators of str.splitlines).
    A continuation that reads as a whole row cannot be told from one."""
    lines = _lines(check_reply(text))
    if not lines or lines == [PS_NO_SERVER]:
        return []
    if tuple(lines[0].split()) != PS_HEADER:
        raise ControlError(f"unexpected ps header: {lines[0][:80]!r}")
    entries: List[PsEntry] = []
    rows = [line for line in (line.strip() for line in text.split("\n")) if line]
    for line in rows[1:]:  # after the header
        entry = _ps_row(line)
        if entry is not None:
            if len(entries) == MAX_LISTED:
                raise ControlError(f"more than {MAX_LISTED} clients in one ps answer: not believed")
            entries.append(entry)
        elif entries:
            last = entries[-1]
            command = f"{last.command}\n{line}" if len(last.command) + 1 + len(line) <= MAX_COMMAND_CHARS \
                else last.command
            entries[-1] = dataclasses.replace(last, command=command)
        else:
            log.debug("ps: a line before the first row, dropped: %r", line[:80])
    return entries


SERVER_STATES = ("ACTIVE", "INITIALIZING", "FAULT")


def parse_server_status(text: str) -> str:
    lines = _lines(check_reply(text))
    if len(lines) != 1 or lines[0] not in SERVER_STATES:
        raise ControlError(f"unexpected server status: {text.strip()[:80]!r}")
    return lines[0]


def parse_percentage(text: str) -> float:
    lines = _lines(check_reply(text))
    try:
        value = float(lines[0]) if len(lines) == 1 else None
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 100:
        raise ControlError(f"unexpected thread percentage: {text.strip()[:80]!r}")
    return value


def parse_pinned_limit(text: str) -> Optional[int]:
    """Bytes, or None where no limit is set.

    With no limit set, driver 580 prints nothing (the capture's ctl_idle.txt) and
    writes "No default pinned memory limit set for the device!" to control.log
    only; other versions may print that sentence, so it means None too.
    """
    lines = _lines(check_reply(text))
    if not lines or len(lines) == 1 and lines[0].startswith("No ") and "limit" in lines[0]:
        return None
    size = parse_size(lines[0]) if len(lines) == 1 else None
    if size is None:
        raise ControlError(f"unexpected pinned memory limit: {text.strip()[:80]!r}")
    return size or None  # MPS treats a limit of 0 as "no limit"


def parse_priority(text: str) -> Optional[int]:
    """`get_default_client_priority`: one integer; None from a daemon that lacks the command."""
    lines = _lines(text)
    if lines and lines[0].startswith("Unknown command"):
        return None
    lines = _lines(check_reply(text))
    if len(lines) != 1 or not re.fullmatch(r"-?[0-9]{1,3}", lines[0]):
        raise ControlError(f"unexpected client priority: {text.strip()[:80]!r}")
    return int(lines[0])


def parse_version(text: str) -> str:
    """`nvidia-cuda-mps-control -v`: "... Binary version: 13000"."""
    m = re.search(r"[Bb]inary version:\s*(\S+)", text)
    return m.group(1) if m else ""


# ------------------------------------------------------------------ client
Runner = Callable[[Sequence[str], str, Dict[str, str], float], Tuple[int, str]]


# An answer longer than this is no answer: `ps` of 48 clients on 16 GPUs is ~80 KB.
MAX_ANSWER_BYTES = 1 << 20


def subprocess_runner(argv: Sequence[str], stdin_text: str, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
    """Run one control process and read its answer, bounded in time and in size.

    The answer ends at EOF or when the process has exited and what it wrote is read
    (all of it is in the pipe by then): a detached grandchild holding its stdout open
    costs nothing, not even a failed read. The deadline holds whatever the children
    do. Past the deadline or past MAX_ANSWER_BYTES its process group is killed and
    the read fails."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(stdin_text.encode())  # one short line: the pipe buffer takes it
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        out = _read_answer(proc, proc.stdout.fileno(), deadline)
        if out is None:
            _kill(proc)
            raise ControlError(f"{argv[0]} did not answer within {timeout:g}s (killed)")
        if len(out) > MAX_ANSWER_BYTES:
            _kill(proc)
            raise ControlError(f"{argv[0]} answered more than {MAX_ANSWER_BYTES} bytes (killed): not an MPS answer")
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # it closed its output but goes on running
            _kill(proc)
            raise ControlError(f"{argv[0]} did not exit within {timeout:g}s (killed)") from None
    finally:
        if proc.stdout is not None:
            proc.stdout.close()  # a grandchild still writing gets EPIPE, not our memory
    return proc.returncode, out.decode("utf-8", "replace")


def _read_answer(proc: "subprocess.Popen[bytes]", fd: int, deadline: float) -> Optional[bytes]:
    """Its output until EOF, the process's exit or one byte past the cap; None at the
    deadline."""
    os.set_blocking(fd, False)
    chunks: List[bytes] = []
    size = 0
    try:  # readable once the process exits (Linux 5.3+); without it, looked at every 50 ms
        pidfd: Optional[int] = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ)
            while size <= MAX_ANSWER_BYTES:
                now = time.monotonic()
                exited = proc.poll() is not None  # then all it wrote is in the pipe: read it, stop
                if not exited and now >= deadline:
                    return None
                if not exited and not any(key.fd == fd for key, _ in sel.select(min(deadline, now + 0.05) - now)):
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    if exited:
                        break
                    continue
                if not data:
                    break
                chunks.append(data)
                size += len(data)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return b"".join(chunks)


def _kill(proc: "subprocess.Popen[bytes]") -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass
class ControlClient:
    pipe_directory: str
    binary: str = Config.control_binary
    timeout: float = Config.command_timeout
    runner: Runner = subprocess_runner
    _environment: Optional[Dict[str, str]] = field(default=None, init=False, repr=False, compare=False)

    def command_line(self, verb: str, *args: object) -> str:
        """The exact text sent, after the allowlist check."""
        if verb not in READ_ONLY_COMMANDS:
            raise CommandNotAllowed(f"{verb!r} is not a read-only MPS control command")
        text_args = [str(a) for a in args]
        if len(text_args) != READ_ONLY_COMMANDS[verb] or not all(
                _NUMBER.match(a) or "pinned_mem_limit" in verb and _GPU_UUID.match(a) for a in text_args):
            raise CommandNotAllowed(f"{verb} takes {READ_ONLY_COMMANDS[verb]} numeric argument(s), got {text_args!r}")
        return " ".join([verb, *text_args])

    def _env(self) -> Dict[str, str]:
        """The control process's environment: the exporter's (read once: it never changes
        its own), its CUDA_MPS_ settings but the daemon's pipe directory left out."""
        env = self._environment
        if env is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
            env["CUDA_MPS_PIPE_DIRECTORY"] = self.pipe_directory
            self._environment = env
        return dict(env)

    def run(self, verb: str, *args: object) -> str:
        line = self.command_line(verb, *args)
        try:
            rc, out = self.runner([self.binary], line + "\n", self._env(), self.timeout)
        except FileNotFoundError as e:
            raise ControlError(f"{self.binary} not found: {e.strerror}") from e
        first = _lines(out)[:1]
        if first == [NO_DAEMON]:  # its whole answer: a client's command may say the same
            raise DaemonNotRunning(NO_DAEMON)
        if first and first[0].startswith(UNKNOWN_COMMAND):  # whatever its exit code
            raise UnknownCommand(f"{line}: {first[0][:120]}")
        if rc != 0:
            raise ControlError(f"{line}: exit code {rc}: {out.strip()[:120]!r}")
        return out

    def version(self) -> str:
        """Binary version from `-v` (answered by the program itself, not the daemon)."""
        try:
            _, out = self.runner([self.binary, "-v"], "", self._env(), self.timeout)
        except (OSError, ControlError):
            return ""
        return parse_version(out)


# ------------------------------------------------------------------ source
@dataclass(frozen=True)
class ChangeSignals:
    """What tells the control source, without a command, that an answer may have changed.

    None where the signal is not there (the logs or NVML not read): with neither,
    every scrape sends `ps` and `get_server_status`, and cached limits expire after
    `facts_refresh_seconds`."""

    log_changes: Optional[int] = None  # LogSnapshot.control_changes: clients, servers, faults
    limits: Optional[Tuple[int, Optional[int]]] = None  # (LogSnapshot.limit_commands, daemon pid)
    nvml_clients: Optional[FrozenSet[Tuple[int, int]]] = None  # (GPU index, pid) of NVML's MPS processes
    # The log files hold lines the pipeline has not read yet (it polls every 0.25 s): one
    # may be a client's `NEW CLIENT`, so the logs cannot vouch that nothing changed.
    log_unread: bool = False


@dataclass
class _Cached:
    value: object
    read_at: float


@dataclass(frozen=True)
class DaemonProcess:
    """What the daemon's process says of it: `-M`, and the CUDA_VISIBLE_DEVICES it was
    started with (None: unset), through which it and its clients number their devices."""

    multiuser: bool
    visible_devices: Optional[str]


# From this binary version (R580's) on, a server's pinned limit answers alike asked by the
# daemon's ordinal and by GPU UUID, however it was set or inherited: on one H200, and on
# two under either CUDA_VISIBLE_DEVICES order (tests/gpu/reports:
# 2026-11-29-h200-pinned-limit-keys, 2026-11-29-h200x2-pinned-limit-keys). After an
# empty answer by ordinal the UUID is not asked. That was 8 of the 35 commands a minute that re-read a steady
# 8-GPU daemon's facts where its logs are not read, 40 lines a minute in its control.log
# (issue 44). Defaults stay keyed by how they were set, and are asked both ways.
SERVER_LIMITS_ALIKE_FROM = 13000

PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory: the daemon's PID in its own namespace


@dataclass
class _Listing:
    """The last `ps` and `get_server_status` answers and the signals they were read under."""

    key: Tuple[object, ...]
    clients: List[PsEntry]
    settled: bool  # this `ps` answered as the one before it did


# A DaemonReading's parts that a steady daemon answers alike at every read (a reading
# itself is new each time: its command counts move).
_KEPT_PARTS = ("servers", "clients", "default_pinned_limits")


@dataclass
class DaemonReader:
    """Reads one control daemon into a `DaemonReading`.

    MPS echoes every command and its answer into control.log, which it never
    rotates: at 15 s scrapes a `ps` of 384 clients alone adds 1.4 M lines a day. So a
    command is sent only when its answer can have changed: `get_server_list` every
    scrape (it says the daemon is up); `ps` when the server list, the logs' client and
    server events or NVML's MPS process lists moved since the last `ps`, or the log files
    hold lines the pipeline has not read yet, and once more
    after a `ps` that answered differently from the one before it (a client between
    two lines); `get_server_status` when the server list or the logs moved, or while a
    server is not ACTIVE; limits and defaults when a server first appears and after a
    `Cmd:set_*` line (docs/logs.md has the counts)."""

    daemon: DaemonConfig
    client: ControlClient
    facts_refresh_seconds: float = Config.facts_refresh_seconds
    clock: Callable[[], float] = time.monotonic
    proc_root: Optional[str] = None  # where to find the daemon's command line (None: never look)
    _cache: Dict[Tuple[object, ...], _Cached] = field(default_factory=dict)
    _version: Optional[str] = None
    _limits_mark: Optional[Tuple[int, Optional[int]]] = None  # ChangeSignals.limits at the last read
    _listing: Optional[_Listing] = None
    _statuses: Dict[int, str] = field(default_factory=dict)  # server pid -> status, while _status_key holds
    _status_key: Tuple[object, ...] = ()
    sent: Dict[str, int] = field(default_factory=dict)  # verb -> commands sent to the daemon
    # verb -> commands of OPTIONAL_COMMANDS the daemon did not know: its `Unknown command`
    # answers, and each one not sent since because of them
    unknown: Dict[str, int] = field(default_factory=dict)
    # The verbs it answered `Unknown command` to, learned once and not asked again until
    # the daemon restarts (its pid file changes) or stops.
    _unknown_verbs: Set[str] = field(default_factory=set)
    _pid_file_key: object = None
    # The daemon's process: its -M and its CUDA_VISIBLE_DEVICES, looked up again when its
    # pid file changes (a restart), or after facts_refresh_seconds where it could not be told.
    _process: Optional["DaemonProcess"] = None
    _process_key: object = None
    _process_at: float = float("-inf")
    # The last reading: its lists and limits are given again (the same objects) while equal,
    # so that a reading of a steady daemon compares equal to the last at a glance (issue 44).
    _last: Optional[DaemonReading] = field(default=None, repr=False, compare=False)
    # The clients of live servers: checked again only for another list or other servers
    _live_clients: Derived[List[PsEntry]] = field(default_factory=Derived, repr=False, compare=False)

    def _run(self, verb: str, *args: object) -> str:
        self.sent[verb] = self.sent.get(verb, 0) + 1
        return self.client.run(verb, *args)

    def _optional(self, parse: Callable[[str], T], verb: str, *args: object) -> Optional[T]:
        """An answer the reading can do without: None where the daemon does not know the
        verb (asked once; counted in `unknown` then and each time it is not asked since)."""
        if verb in self._unknown_verbs:
            self.unknown[verb] = self.unknown.get(verb, 0) + 1
            return None
        try:
            return parse(self._run(verb, *args))
        except UnknownCommand as e:
            log.info("daemon %s does not know %s (%s): not asked again until it restarts", self.daemon.name,
                     verb, e)
            self._unknown_verbs.add(verb)
            self.unknown[verb] = self.unknown.get(verb, 0) + 1
            return None

    def _pid_file(self) -> Tuple[str, object]:
        """The daemon's pid file: its text, and what changes when the daemon restarts."""
        path = os.path.join(self.daemon.pipe_directory, PID_FILE)
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read(32).strip()
                return text, (text, os.fstat(f.fileno()).st_mtime_ns)
        except OSError:
            return "", None

    def _note_restart(self, key: object) -> None:
        """A daemon restarted (its pid file changed) may be another driver's: what it did not
        know is asked again."""
        if key != self._pid_file_key:
            self._pid_file_key = key
            self._unknown_verbs.clear()

    def process(self, pid_file: Optional[Tuple[str, object]] = None) -> Optional["DaemonProcess"]:
        """The daemon's process as /proc shows it; None where it cannot be told."""
        if self.proc_root is None:
            return None
        text, key = pid_file if pid_file is not None else self._pid_file()
        now = self.clock()
        if key != self._process_key or self._process is None and now - self._process_at >= self.facts_refresh_seconds:
            self._process_key, self._process_at = key, now
            found = find_control_daemon(self.daemon.pipe_directory, self.proc_root,
                                        int(text) if text.isascii() and text.isdigit() else None)
            self._process = None if found is None else DaemonProcess(
                is_multiuser(found[1]), daemon_environ(self.proc_root, found[0], "CUDA_VISIBLE_DEVICES"))
        return self._process

    def _cached(self, key: Tuple[object, ...], read: Callable[[], T]) -> T:
        hit = self._cache.get(key)
        now = self.clock()
        # Where the logs are read, a `Cmd:set_*` line clears the cache: no need to expire it.
        expired = self._limits_mark is None and hit is not None and now - hit.read_at >= self.facts_refresh_seconds
        if hit is None or expired:
            hit = self._cache[key] = _Cached(read(), now)
        return cast(T, hit.value)  # what this key's read returned

    def _percentage(self, verb: str, *args: object) -> Callable[[], Optional[float]]:
        return lambda: self._optional(parse_percentage, verb, *args)

    def _pinned_by_uuid(self, verb: str, *args: object) -> Optional[int]:
        """A limit asked for by GPU UUID: a daemon that does not take a UUID there (drivers
        before UUID keys) has none set that way, and that costs no reading."""
        try:
            return self._optional(parse_pinned_limit, verb, *args)
        except (CommandNotAllowed, DaemonNotRunning, ServerNotFound):
            raise
        except ControlError as e:
            log.debug("daemon %s: %s %s: %s", self.daemon.name, verb, args, e)
            return None

    def _pinned_limits(self, key: Tuple[object, ...], verb: str, server: Tuple[int, ...],
                       devices: Sequence[VisibleDevice]) -> Dict[int, int]:
        """Pinned limits by the node's GPU index. MPS keys a default by the daemon's own
        device ordinal (counted in its CUDA_VISIBLE_DEVICES) or by GPU UUID, and answers
        each only asked the way it was set: after `set_default_device_pinned_mem_limit
        GPU-<uuid> 2G` (the DRA driver's form) `get_... 0` answered an empty line and
        `get_... GPU-<uuid>` answered 2G (2 x H100, issue 38). So the ordinal first, the
        UUID where it has none; for a server's limit only before SERVER_LIMITS_ALIKE_FROM."""
        def read() -> Dict[int, int]:
            by_uuid = not server or not self._server_limits_alike()
            limits: Dict[int, int] = {}
            for ordinal, device in enumerate(devices):
                if device.index is None:  # a MIG instance: no series of its own
                    continue
                limit = self._optional(parse_pinned_limit, verb, *server, ordinal)
                if limit is None and by_uuid and _GPU_UUID.match(device.uuid):
                    limit = self._pinned_by_uuid(verb, *server, device.uuid)
                if limit is not None:
                    limits[device.index] = limit
            return limits
        # Kept whole: a steady daemon's read neither walks its devices nor builds a new dict.
        return self._cached(key + (tuple(devices),), read)

    def _server_limits_alike(self) -> bool:
        """Whether the daemon answers a server's pinned limit alike by ordinal and by UUID."""
        version = self._version or ""
        return version.isdigit() and int(version) >= SERVER_LIMITS_ALIKE_FROM

    def _default_priority(self) -> Optional[int]:
        return self._optional(parse_priority, "get_default_client_priority")

    def _forget_servers_except(self, live: Set[int]) -> None:
        for key in [k for k in self._cache if k[0] == "server" and k[1] not in live]:
            del self._cache[key]

    def _note_limits(self, mark: Optional[Tuple[int, Optional[int]]]) -> None:
        """Every cached fact is a limit or default: a `set_*` command in control.log (or a
        new daemon) since the last read may have changed any of them."""
        if mark != self._limits_mark:
            self._cache.clear()
            self._limits_mark = mark

    def _forget(self) -> None:
        self._cache.clear()
        self._listing, self._statuses = None, {}
        self._unknown_verbs.clear()  # the next daemon here may be another driver's

    def _clients(self, key: Tuple[object, ...], watched: bool, servers: Sequence[int],
                 devices: Sequence[VisibleDevice]) -> List[PsEntry]:
        """`ps`, or its last answer while nothing says it changed; from a daemon without
        `ps` (R470 answers `Unknown command "ps"`), each server's `get_client_list`."""
        last = self._listing
        if watched and last is not None and last.key == key and last.settled:
            return last.clients
        listed = self._optional(parse_ps, "ps")
        clients = self._listed_clients(servers, devices) if listed is None else listed
        settled = last is not None and last.clients == clients
        if settled:
            assert last is not None
            clients = last.clients  # the very list: the reading then compares it by identity
        self._listing = _Listing(key, clients, settled)
        return clients

    def _listed_clients(self, servers: Sequence[int], devices: Sequence[VisibleDevice]) -> List[PsEntry]:
        """The clients of a daemon without `ps`: `get_client_list <server>` for each server's
        clients, `get_device_client_list <server>` for the device each enumerated (the
        daemon's ordinal, named by the UUID of that device where the node's GPUs are
        known). What only `ps` prints (client ID, PID namespace, command) is left unknown:
        the command comes from /proc where it is read, as for any client `ps` missed."""
        clients: List[PsEntry] = []
        for server in servers:
            try:
                pids = self._optional(parse_pid_list, "get_client_list", server)
                on = self._optional(parse_device_client_list, "get_device_client_list", server) if pids else {}
            except ServerNotFound:  # it exited between two commands: no clients
                continue
            for pid in pids or ():
                ordinal = (on or {}).get(pid)
                device = devices[ordinal].uuid if ordinal is not None and ordinal < len(devices) else ""
                clients.append(PsEntry(pid=pid, client_id=None, server_pid=server, device=device, namespace="",
                                       command=""))
        return clients

    def read(self, devices: Sequence[int], signals: Callable[[], ChangeSignals] = ChangeSignals,
             uuids: Optional[Mapping[int, str]] = None) -> DaemonReading:
        """`devices`: the node's GPU indexes, `uuids` their UUIDs where known. `signals`: what
        the logs and NVML say now (asked before the first command, whose own echo in
        control.log must not count as a line the logs have not read)."""
        seen = signals()
        reading = DaemonReading(name=self.daemon.name, up=False, pipe_directory=self.daemon.pipe_directory,
                                log_directory=self.daemon.log_directory, claim_uid=self.daemon.claim_uid,
                                pipe_identity=identity(self.daemon.pipe_directory))
        try:
            server_pids = parse_pid_list(self._run("get_server_list"))
        except DaemonNotRunning:
            self._forget()
            return self._counted(reading)
        except ControlError as e:
            reading.error = str(e)
            return self._counted(reading)
        reading.up = True
        pid_file = self._pid_file()
        self._note_restart(pid_file[1])
        if self._version is None:
            self._version = self.client.version()
        reading.version = self._version
        process = self.process(pid_file)
        reading.multiuser = None if process is None else process.multiuser
        reading.visible_devices = None if process is None else process.visible_devices
        own = visible_devices(reading.visible_devices, [(i, (uuids or {}).get(i, "")) for i in devices])
        try:
            servers = tuple(sorted(server_pids))
            reading.clients = self._clients((servers, seen.log_changes, seen.nvml_clients),
                                            (seen.log_changes is not None or seen.nvml_clients is not None)
                                            and not seen.log_unread, servers, own)
            self._note_limits(seen.limits)
            status_key = (servers, seen.log_changes)
            if seen.log_changes is None or seen.log_unread or status_key != self._status_key:
                self._statuses, self._status_key = {}, status_key
            reading.default_active_thread_percentage = self._cached(
                ("default_atp",), self._percentage("get_default_active_thread_percentage"))
            reading.default_client_priority = self._cached(("default_priority",), self._default_priority)
            reading.default_pinned_limits = self._pinned_limits(
                ("default_pinned",), "get_default_device_pinned_mem_limit", (), own)
            self._forget_servers_except(set(server_pids))
            for pid in server_pids:
                facts = self._read_server(pid, own)
                if facts is not None:
                    reading.servers.append(facts)
        except DaemonNotRunning:  # quit between two commands
            self._forget()
            reading.up = False
            reading.clients, reading.servers = [], []
        except ControlError as e:
            self._listing, self._statuses = None, {}  # asked again next time
            reading.error = str(e)
        live = frozenset(s.pid for s in reading.servers)
        listed = reading.clients
        # The very list where every client's server is live: join knows it by identity.
        reading.clients = self._live_clients.get([listed], live, lambda: listed if all(
            c.server_pid in live for c in listed) else [c for c in listed if c.server_pid in live])
        return self._counted(reading)

    def _counted(self, reading: DaemonReading) -> DaemonReading:
        reading.commands_sent = dict(self.sent)
        reading.commands_unknown = dict(self.unknown)
        last, self._last = self._last, reading
        if last is not None:
            for part in _KEPT_PARTS:
                if getattr(reading, part) == getattr(last, part):
                    setattr(reading, part, getattr(last, part))
        return reading

    def _status(self, pid: int) -> Optional[str]:
        """A server's status, asked again only while it is not ACTIVE or after a change;
        None from a daemon that does not know get_server_status."""
        status = self._statuses.get(pid)
        if status is None or status != "ACTIVE":
            status = self._optional(parse_server_status, "get_server_status", pid)
            if status is not None:
                self._statuses[pid] = status
        return status

    def _read_server(self, pid: int, devices: Sequence[VisibleDevice]) -> Optional[ServerFacts]:
        try:
            status = self._status(pid)
            atp = self._cached(("server", pid, "atp"), self._percentage("get_active_thread_percentage", pid))
            limits = self._pinned_limits(("server", pid, "pinned"), "get_device_pinned_mem_limit", (pid,), devices)
        except ServerNotFound:
            log.debug("server %d exited during the scrape", pid)
            self._statuses.pop(pid, None)
            return None
        return ServerFacts(pid=pid, status=status, active_thread_percentage=atp, pinned_limits=limits)


def _checked(readings: List[DaemonReading]) -> List[DaemonReading]:
    """A daemon that could not be read fails the collector; the others still count."""
    errors = [f"{r.name}: {r.error}" for r in readings if r.error]
    if errors:
        raise PartialFailure("; ".join(errors), readings)
    return readings


class ControlSourceSpec(Source[List[DaemonReading]]):
    """Every watched control daemon, one `DaemonReading` each (in a bundle: one entry each)."""

    name = "control"
    help = "the MPS control daemons: servers, clients (ps), limits and defaults"
    reading_type = DaemonReading
    served_while_reading = True  # while MPS admits a storm of clients, `ps` waits up to 0.5 s
    flags = (
        Flag("--mps.control-binary", "control_binary", "the nvidia-cuda-mps-control program (default %(default)s)",
             refuses=("",), check=not_empty),
        Flag("--mps.command-timeout", "command_timeout", "seconds one control command may take before it is killed "
             "(default %(default)s)", refuses=("abc", "0", "-1"), type=float, check=positive),
        Flag("--mps.facts-refresh", "facts_refresh_seconds", "where the logs are not read: seconds between re-reads "
             "of per-server limits and daemon defaults (with the logs, a Cmd:set_* line in control.log makes the "
             "next scrape re-read them, and nothing else does) (default %(default)s)", refuses=("abc", "-5"),
             type=float, check=not_negative),
    )

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[List[DaemonReading]]]:
        runner = {"runner": backends.control_runner} if backends.control_runner else {}
        daemons: DaemonSet = backends.daemon_set or DaemonSet(cfg.daemons)
        sources: Dict[str, DaemonReader] = {}  # by daemon name: those watched now
        # Daemons are read side by side: each command is a process of its own (~2 ms), and a
        # hung daemon costs its own reading, not the others' (the scrape deadline still binds).
        pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL_DAEMONS, thread_name_prefix="mps-control")

        def watched() -> List[DaemonReader]:
            now = daemons.current()
            for gone in set(sources) - {d.name for d in now}:
                del sources[gone]  # its cached facts go with it
            for d in now:
                if d.name not in sources or sources[d.name].daemon != d:
                    client = ControlClient(d.pipe_directory, cfg.control_binary, cfg.command_timeout, **runner)
                    sources[d.name] = DaemonReader(d, client, facts_refresh_seconds=cfg.facts_refresh_seconds,
                                                    proc_root=cfg.procfs)
            return [sources[d.name] for d in now]

        nvml_clients: Derived[FrozenSet[Tuple[int, int]]] = Derived()  # NVML's MPS lists' (GPU index, pid)

        def clients_on_gpus(gpus: Sequence[GpuReading]) -> FrozenSet[Tuple[int, int]]:
            return nvml_clients.get([g.mps_clients for g in gpus], tuple(g.index for g in gpus),
                                    lambda: frozenset((g.index, p.pid) for g in gpus for p in g.mps_clients))

        def signals(ctx: ReadContext, daemon: str) -> Callable[[], ChangeSignals]:
            def seen() -> ChangeSignals:
                snap = ctx.wait(("logs", "nvml"))  # the logs: no I/O, their last snapshots
                logs = snap.logs.get(daemon)
                nvml = None if snap.nvml is None else clients_on_gpus(snap.nvml.gpus)
                if logs is None:
                    return ChangeSignals(nvml_clients=nvml)
                return ChangeSignals(logs.control_changes, (logs.limit_commands, logs.daemon_pid), nvml,
                                     log_unread=logs.backlog_bytes > 0)
            return seen

        def read(ctx: ReadContext) -> List[DaemonReading]:
            devices, uuids = ctx.devices(), ctx.uuids()
            chosen = watched()
            if len(chosen) == 1:
                return _checked([chosen[0].read(devices, signals(ctx, chosen[0].daemon.name), uuids)])
            return _checked(list(pool.map(lambda s: s.read(devices, signals(ctx, s.daemon.name), uuids), chosen)))

        def close() -> None:
            pool.shutdown(wait=False)

        return Reader(read, close=close, source=sources)

    def store(self, snap: Snapshot, reading: List[DaemonReading]) -> None:
        snap.daemons = reading

    def record(self, reading: List[DaemonReading]) -> Any:
        return [record_value(r) for r in reading]

    def record_failure(self, message: str) -> Any:
        return [super().record_failure(message)]

    def load(self, entry: Any) -> Any:
        return [recorded(e, DaemonReading, self.name) for e in expect(entry, list, "control list")]

    def replay(self, loaded: Any) -> List[DaemonReading]:
        return _checked([replay_value(r) for r in loaded])


SOURCE = ControlSourceSpec()
