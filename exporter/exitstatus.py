"""How processes exited, from the kernel: the process-events connector over netlink.

MPS never says "out of memory": a client that fails an allocation at its limit exits
like any other, and the MPS logs show a normal exit line (H100, driver 580, issue 40).
The kernel knows how each process ended: the proc connector (NETLINK_CONNECTOR, group
CN_IDX_PROC) multicasts a PROC_EVENT_EXIT per task with its wait status. A thread here
listens and keeps the last MAX_EXITS process exits (thread-group leaders) by PID, so
that the exit tracker (exits.py) can say `failed` (non-zero status or a signal) or
`clean` (status 0) for a client it saw leave.

It fails softly: a kernel without the connector, a kernel before 6.6 without
CAP_NET_ADMIN (from 6.6 any user may listen: uid 65534 with no capabilities did on
6.18 here), or a container outside the host's PID and user namespaces (the kernel
ignores listeners there) leave `available` False, and every exit is `unknown`. The PIDs are the host's:
the exporter must run in the host's PID namespace (as it must for NVML's PIDs to
mean anything).

`exit_code` is the task's wait status (`(status << 8) | terminating signal`, as
waitpid's); the event's `exit_signal` is the signal the parent gets (SIGCHLD), not the
one that killed it.

Parsing is a pure function of the received bytes (`parse`), tested on struct-packed
messages; bench/exitstatus_bench.py measures how many exits a second it keeps up with.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, FrozenSet, List, Mapping, Optional, Set, Tuple

log = logging.getLogger(__name__)

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0x00000000
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3
NLMSG_ERROR = 2

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
CN_MSG = struct.Struct("=IIIIHH")  # cb_id.idx, cb_id.val, seq, ack, len, flags
PROC_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
EXIT_DATA = struct.Struct("=IIII")  # process_pid, process_tgid, exit_code, exit_signal
ACK_DATA = struct.Struct("=I")  # err

# Socket filter (classic BPF) run by the kernel on each event before it is queued: only
# process exits (the thread-group leader's) and acknowledgements reach the thread. The
# connector multicasts every fork, exec, id change and thread exit of the host: a storm of
# PyTorch clients on a 64-core node is thousands a second, each a wake-up and a parse here.
# Once the tracker names the clients it follows (`ExitWatcher.watch`), a clean exit reaches
# the thread only where it is one of theirs: the host's other processes end by the dozen a
# second (0.9 ms/s of CPU at 12 exits/s on the 2-core VM), and none of them is asked for.
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JEQ_X, BPF_TAX, BPF_RET_K = 0x20, 0x15, 0x1D, 0x07, 0x06
BPF_MAXINSNS = 4096  # the kernel's limit on a classic BPF program
EVENT_OFFSET = NLMSGHDR.size + CN_MSG.size  # proc_event.what
EXIT_PID_OFFSET = EVENT_OFFSET + PROC_EVENT_HEAD.size  # event_data.exit.process_pid, then _tgid
EXIT_CODE_OFFSET = EXIT_PID_OFFSET + 8  # event_data.exit.exit_code


def _network_order(value: int) -> int:
    """`value` as a BPF absolute load sees it: the kernel reads words in network order,
    the connector writes them in the host's."""
    return int(struct.unpack(">I", struct.pack("=I", value))[0])


KEEP, DROP = (BPF_RET_K, 0, 0, 0xFFFFFFFF), (BPF_RET_K, 0, 0, 0)  # the whole message; none of it
_HEAD = 13  # instructions before the watched PIDs' tests
# Clients whose clean exits the kernel can test for: two instructions each.
MAX_WATCHED = (BPF_MAXINSNS - _HEAD - 2) // 2  # after the head: a load, the tests, a drop


def exits_filter(watched: Optional[AbstractSet[int]] = None) -> bytes:
    """The socket filter's instructions (struct sock_filter: code, jt, jf, k): process exits
    (a thread's are dropped) and acknowledgements; with `watched`, of the clean exits only
    those of these PIDs (a failed exit is kept whoever it is: a client that failed before
    the tracker named it is still told apart)."""
    insn = struct.Struct("=HBBI")
    program = [
        (BPF_LD_W_ABS, 0, 0, EVENT_OFFSET),                  # 0: A = what
        (BPF_JEQ_K, 3, 0, _network_order(PROC_EVENT_EXIT)),  # 1: an exit: to 5
        (BPF_JEQ_K, 0, 1, _network_order(PROC_EVENT_NONE)),  # 2: the subscription's acknowledgement: keep
        KEEP,                                                # 3
        DROP,                                                # 4: any other event (a short message too)
        (BPF_LD_W_ABS, 0, 0, EXIT_PID_OFFSET + 4),           # 5: A = process_tgid
        (BPF_TAX, 0, 0, 0),                                  # 6: X = A
        (BPF_LD_W_ABS, 0, 0, EXIT_PID_OFFSET),               # 7: A = process_pid
        (BPF_JEQ_X, 1, 0, 0),                                # 8: the leader's exit: to 10
        DROP,                                                # 9: a thread's
    ]
    if watched is None:
        program.append(KEEP)
        return b"".join(insn.pack(*i) for i in program)
    program += [
        (BPF_LD_W_ABS, 0, 0, EXIT_CODE_OFFSET),              # 10: A = exit_code
        (BPF_JEQ_K, 1, 0, 0),                                # 11: clean: to the PIDs
        KEEP,                                                # 12: failed: keep
    ]
    assert len(program) == _HEAD
    program.append((BPF_LD_W_ABS, 0, 0, EXIT_PID_OFFSET))   # A = process_pid
    for pid in sorted(watched)[:MAX_WATCHED]:
        program += [(BPF_JEQ_K, 0, 1, _network_order(pid)), KEEP]
    program.append(DROP)
    return b"".join(insn.pack(*i) for i in program)


def attach_exits_only(sock: socket.socket, watched: Optional[AbstractSet[int]] = None) -> bool:
    """Attach `exits_filter(watched)` to `sock` (replacing the one it had); False where the
    kernel refuses (events are then all received and `parse` skips what is not an exit)."""
    import ctypes
    code = exits_filter(watched)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("@HP", len(code) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    except OSError as e:
        log.debug("process events unfiltered (every event reaches the exit-status thread): %s", e)
        return False
    return True


# Exits kept (PID -> status). The tracker asks within a collection or two of the exit:
# at the storm rate measured here (bench/exitstatus_bench.py) this holds minutes of exits.
MAX_EXITS = 65536
RECEIVE_BUFFER = 8 << 20  # bytes; a storm of exits fills a default 208 KiB buffer in ~2,000 events
# How long `start` waits for the kernel's acknowledgement of the subscription.
ACK_WAIT_SECONDS = 1.0

FAILED, CLEAN, UNKNOWN = "failed", "clean", "unknown"
OUTCOMES = (FAILED, CLEAN, UNKNOWN)


def _poller(sock: socket.socket) -> "select.poll":
    """poll(), not select(): select() refuses a descriptor past 1023, and a busy exporter
    (or a test suite) may hold that many."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


@dataclass(frozen=True)
class ExitStatus:
    """One process's end: `code` its exit status (0..255) where it exited, `signal` the
    signal that killed it (0: none)."""

    code: int
    signal: int

    @classmethod
    def from_wait_status(cls, status: int) -> "ExitStatus":
        return cls((status >> 8) & 0xFF, status & 0x7F)

    @property
    def outcome(self) -> str:
        return CLEAN if self.code == 0 and self.signal == 0 else FAILED

    def describe(self) -> str:
        return f"signal {self.signal}" if self.signal else f"exit status {self.code}"


@dataclass(frozen=True)
class Exit:
    pid: int  # the task's PID (a thread's ID for a thread)
    tgid: int  # its process
    status: ExitStatus

    @property
    def process(self) -> bool:
        """The thread-group leader's exit: the process's (the last event of a process)."""
        return self.pid == self.tgid


@dataclass(frozen=True)
class Ack:
    err: int  # 0: the subscription was taken


def listen_message(op: int = PROC_CN_MCAST_LISTEN, seq: int = 0) -> bytes:
    """The message that subscribes (or unsubscribes) a socket to process events."""
    payload = struct.pack("=I", op)
    cn = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, seq, 0, len(payload), 0) + payload
    return NLMSGHDR.pack(NLMSGHDR.size + len(cn), NLMSG_DONE, 0, seq, 0) + cn


def parse(data: bytes) -> Tuple[List[Exit], List[Ack]]:
    """The exits and acknowledgements in one datagram (several netlink messages, each
    aligned to 4 bytes); anything else (forks, execs, other connectors, short or
    malformed messages) is skipped."""
    exits: List[Exit] = []
    acks: List[Ack] = []
    offset = 0
    while offset + NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = NLMSGHDR.unpack_from(data, offset)
        if length < NLMSGHDR.size or offset + length > len(data):
            break
        body = offset + NLMSGHDR.size
        end = offset + length
        offset += (length + 3) & ~3
        if kind in (NLMSG_ERROR,) or end - body < CN_MSG.size:
            continue
        idx, val, _, _, payload_len, _ = CN_MSG.unpack_from(data, body)
        event = body + CN_MSG.size
        if (idx, val) != (CN_IDX_PROC, CN_VAL_PROC) or event + min(payload_len, PROC_EVENT_HEAD.size) > end:
            continue
        if event + PROC_EVENT_HEAD.size > end:
            continue
        what, _, _ = PROC_EVENT_HEAD.unpack_from(data, event)
        detail = event + PROC_EVENT_HEAD.size
        if what == PROC_EVENT_EXIT and detail + EXIT_DATA.size <= end:
            pid, tgid, code, _signal = EXIT_DATA.unpack_from(data, detail)
            exits.append(Exit(pid, tgid, ExitStatus.from_wait_status(code)))
        elif what == PROC_EVENT_NONE and detail + ACK_DATA.size <= end:
            acks.append(Ack(ACK_DATA.unpack_from(data, detail)[0]))
    return exits, acks


SocketFactory = Callable[[], socket.socket]


def _netlink_socket() -> socket.socket:
    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)


class ExitWatcher:
    """A thread that keeps the last `capacity` process exits by PID.

    `start()` subscribes and returns whether the kernel took it; where it did not (no
    netlink connector, not permitted) `available` stays False and `status` answers None
    for every PID. `lost` counts the times the kernel dropped events (ENOBUFS: the
    socket's buffer overflowed): an exit lost then is `unknown`."""

    def __init__(self, capacity: int = MAX_EXITS, factory: SocketFactory = _netlink_socket,
                 ack_wait: float = ACK_WAIT_SECONDS, filter_events: bool = True) -> None:
        self.capacity = capacity
        self._filter_events = filter_events  # False: the benchmark's reference
        self._factory = factory
        self._ack_wait = ack_wait
        self._exits: "OrderedDict[int, ExitStatus]" = OrderedDict()
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._wake: Optional[Tuple[socket.socket, socket.socket]] = None  # close() wakes the thread's poll
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.available = False
        self.why_not = "not started"
        self.lost = 0  # overflows of the receive buffer
        self.seen = 0  # process exits seen
        self.filtered = False  # the kernel drops every other event (attach_exits_only)
        self.watched: Optional[FrozenSet[int]] = None  # the PIDs whose clean exits it keeps; None: all
        self.thread_id: Optional[int] = None  # the OS thread's ID (its CPU in /proc)
        # What `unexited_since` reads, on one clock that moves at each exit, overflow and
        # filter change: when each watched PID's exits began to reach it, each watched
        # PID's last exit, the last overflow; and the last of any of these (quiet_since).
        self._clock = 0
        self._covered: Dict[int, int] = {}
        self._exited: Dict[int, int] = {}
        self._lost_at = 0
        self._changed_at = 0

    def start(self) -> bool:
        try:
            sock = self._factory()
        except (OSError, AttributeError) as e:  # no AF_NETLINK (not Linux), no connector
            return self._unavailable(f"no netlink connector socket: {e}")
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, RECEIVE_BUFFER)  # SO_RCVBUFFORCE (root)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            sock.bind((0, CN_IDX_PROC))
            self.filtered = self._filter_events and attach_exits_only(sock)
            sock.send(listen_message())
            if not self._acknowledged(sock):
                sock.close()
                return False
        except OSError as e:
            sock.close()
            return self._unavailable(f"cannot subscribe to process events: {e}")
        self._sock = sock
        self.available, self.why_not = True, ""
        self._wake = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="mps-exit-status", daemon=True)
        self._thread.start()
        self.thread_id = self._thread.native_id
        return True

    def _unavailable(self, why: str) -> bool:
        self.available, self.why_not = False, why
        log.info("exit status of MPS clients unknown (their exits count as outcome=\"unknown\"): %s", why)
        return False

    def _acknowledged(self, sock: socket.socket) -> bool:
        """The kernel acknowledges a subscription with err 0; it refuses one from outside
        the initial namespaces, or without CAP_NET_ADMIN, with an error (or, on older
        kernels, silence)."""
        waited = 0.0
        step = 0.05
        poller = _poller(sock)
        while waited < self._ack_wait:
            ready = poller.poll(step * 1000)
            waited += step
            if not ready:
                continue
            exits, acks = parse(sock.recv(65536))
            self._record(exits)
            for ack in acks:
                if ack.err:
                    return self._unavailable(f"the kernel refused the subscription: {os.strerror(ack.err)}")
                return True
            if exits:  # events flow: the subscription was taken (a kernel that sends no ack)
                return True
        return self._unavailable(f"no answer from the proc connector within {self._ack_wait:g} s "
                                 "(outside the host's PID namespace?)")

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = _poller(sock)
        # Woken by events or by close(), never by a timeout: an idle node costs no wake-ups
        # (a 500 ms poll was 120 a minute, 6.7 ms of CPU; issue 44).
        assert self._wake is not None
        poller.register(self._wake[0], select.POLLIN)
        while not self._stop.is_set():
            try:
                ready = poller.poll()
                if not any(fd == sock.fileno() for fd, _ in ready):
                    continue
                data = sock.recv(1 << 20)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self._overflowed()
                    continue
                if self._stop.is_set():
                    return
                log.warning("exit status of MPS clients unknown from now on: reading process events failed: %s", e)
                self.available, self.why_not = False, str(e)
                return
            self._record(parse(data)[0])

    def _overflowed(self) -> None:
        """The kernel dropped events: any exit may have been among them."""
        with self._lock:
            self.lost += 1
            self._clock += 1
            self._lost_at = self._changed_at = self._clock

    def _record(self, exits: List[Exit]) -> None:
        if not exits:
            return
        with self._lock:
            for e in exits:
                if not e.process:
                    continue
                self.seen += 1
                self._clock += 1
                if e.pid in self._covered:
                    self._exited[e.pid] = self._changed_at = self._clock
                self._exits.pop(e.pid, None)
                self._exits[e.pid] = e.status
                if len(self._exits) > self.capacity:
                    self._exits.popitem(last=False)

    def watch(self, pids: AbstractSet[int]) -> None:
        """Of the clean exits, have the kernel keep only those of `pids` (the clients the
        tracker follows; failed exits are all kept); more than MAX_WATCHED: every exit."""
        wanted = frozenset(pids) if len(pids) <= MAX_WATCHED else None
        with self._lock:
            sock = self._sock
            if not self.filtered or sock is None or wanted == self.watched:
                return
            if attach_exits_only(sock, wanted):
                self._clock += 1  # each PID's exits reach it from here
                self._changed_at = self._clock
                self._covered = {pid: self._covered.get(pid, self._clock) for pid in wanted or ()}
                self._exited = {pid: at for pid, at in self._exited.items() if pid in self._covered}
                self.watched = wanted

    def mark(self) -> int:
        """Now, for `unexited_since`: taken before a process is looked at."""
        with self._lock:
            return self._clock

    def unexited_since(self, marks: Mapping[int, int]) -> Set[int]:
        """Of the PIDs in `marks` (pid -> a `mark()`), those that have not exited since:
        watched since before their mark, with no exit of theirs and no lost event since.
        A PID this cannot vouch for is left out (its /proc entry is then looked at). An
        exit still queued in the socket is not known yet; the PID of a process that
        exited a moment ago still names it or nothing until it is reaped and reused."""
        with self._lock:
            if not self.available or self.watched is None or self._thread is None or not self._thread.is_alive():
                return set()
            covered, exited, lost_at = self._covered, self._exited, self._lost_at
            return {pid for pid, mark in marks.items()
                    if lost_at <= mark and covered.get(pid, mark + 1) <= mark and exited.get(pid, 0) <= mark}

    def quiet_since(self, mark: int) -> bool:
        """Whether `unexited_since` answers for every PID as it did at `mark`: no exit of a
        watched PID, no lost event and no change of the watched PIDs since, and it still
        listens (a steady node's scrape then looks at none of its clients, issue 44)."""
        with self._lock:
            return (self._changed_at <= mark and self.available and self.watched is not None
                    and self._thread is not None and self._thread.is_alive())

    def status(self, pid: int) -> Optional[ExitStatus]:
        """How `pid` exited, where its exit was seen (the latest exit of that PID)."""
        with self._lock:
            return self._exits.get(pid)

    def close(self) -> None:
        self._stop.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                self._wake[1].send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            try:
                self._sock.send(listen_message(PROC_CN_MCAST_IGNORE))
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._wake is not None and (self._thread is None or not self._thread.is_alive()):
            for end in self._wake:
                end.close()
            self._wake = None
        self.available = False
