"""The proc connector reader (exporter/exitstatus.py): parsing packed messages, failing
softly, and (as root, where the kernel has it) a real exit."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
from typing import List, Optional

import pytest

from mps_exporter.exitstatus import (ACK_DATA, CLEAN, CN_IDX_PROC, CN_MSG, CN_VAL_PROC, EXIT_DATA, FAILED, NLMSGHDR,
                                     PROC_CN_MCAST_LISTEN, PROC_EVENT_EXIT, PROC_EVENT_HEAD, PROC_EVENT_NONE, Ack, Exit,
                                     MAX_WATCHED, SO_ATTACH_FILTER, ExitStatus, ExitWatcher, attach_exits_only,
                                     listen_message, parse)

PROC_EVENT_FORK = 0x00000001


def message(what: int, data: bytes, idx: int = CN_IDX_PROC) -> bytes:
    event = PROC_EVENT_HEAD.pack(what, 3, 123456789) + data
    cn = CN_MSG.pack(idx, CN_VAL_PROC, 0, 0, len(event), 0) + event
    raw = NLMSGHDR.pack(NLMSGHDR.size + len(cn), 3, 0, 0, 0) + cn
    return raw + b"\0" * (-len(raw) % 4)


def exit_message(pid: int, wait_status: int, tgid: Optional[int] = None) -> bytes:
    # parent_pid and parent_tgid follow on newer kernels: trailing bytes the parser ignores
    return message(PROC_EVENT_EXIT, EXIT_DATA.pack(pid, pid if tgid is None else tgid, wait_status, 17) + b"\0" * 8)


def test_an_exit_status_and_a_signal_are_read_from_the_wait_status():
    exits, acks = parse(exit_message(4242, 1 << 8) + exit_message(4243, 9) + exit_message(4244, 0))
    assert acks == []
    assert exits == [Exit(4242, 4242, ExitStatus(1, 0)), Exit(4243, 4243, ExitStatus(0, 9)),
                     Exit(4244, 4244, ExitStatus(0, 0))]
    assert [e.status.outcome for e in exits] == [FAILED, FAILED, CLEAN]
    assert exits[0].status.describe() == "exit status 1" and exits[1].status.describe() == "signal 9"


def _through_filter(watched, sent):
    """What of `sent` this kernel lets through `exits_filter(watched)` on a datagram pair."""
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with receiver, sender:
        assert attach_exits_only(receiver, watched)
        for raw in sent:
            sender.send(raw)
        receiver.setblocking(False)
        received = []
        while True:
            try:
                received.append(receiver.recv(4096))
            except BlockingIOError:
                return received


def test_the_kernel_filter_passes_process_exits_and_acks_only():
    """The socket filter, run by this kernel on an AF_UNIX datagram pair (the same classic
    BPF the netlink socket gets): what the exit-status thread is woken for."""
    sent = {
        "process exit": exit_message(4242, 1 << 8),
        "clean process exit": exit_message(4245, 0),
        "thread exit": exit_message(4243, 0, tgid=4242),
        "fork": message(PROC_EVENT_FORK, struct.pack("=IIII", 1, 1, 2, 2)),
        "ack": message(PROC_EVENT_NONE, ACK_DATA.pack(0)),
        "short": exit_message(4244, 0)[:40],
    }
    received = _through_filter(None, sent.values())
    assert received == [sent["process exit"], sent["clean process exit"], sent["ack"]]
    exits, acks = parse(b"".join(received))
    assert exits == [Exit(4242, 4242, ExitStatus(1, 0)), Exit(4245, 4245, ExitStatus(0, 0))] and acks == [Ack(0)]


def test_with_watched_pids_the_kernel_keeps_their_clean_exits_and_every_failed_one():
    sent = {
        "watched, clean": exit_message(4242, 0),
        "watched, failed": exit_message(4243, 1 << 8),
        "other, clean": exit_message(5000, 0),
        "other, failed": exit_message(5001, 2 << 8),
        "other, killed": exit_message(5002, 9),
        "watched thread": exit_message(4244, 0, tgid=4242),
        "fork": message(PROC_EVENT_FORK, struct.pack("=IIII", 1, 1, 2, 2)),
        "ack": message(PROC_EVENT_NONE, ACK_DATA.pack(0)),
    }
    kept = _through_filter({4242, 4243, 4244, 7}, sent.values())
    assert [name for name, raw in sent.items() if raw in kept] == [
        "watched, clean", "watched, failed", "other, failed", "other, killed", "ack"]
    # Nothing watched: only failed exits and the acknowledgement.
    assert _through_filter(set(), sent.values()) == [sent["watched, failed"], sent["other, failed"],
                                                    sent["other, killed"], sent["ack"]]
    # As many PIDs as the kernel's program can hold: the last of them still tested.
    many = set(range(100, 100 + MAX_WATCHED - 1)) | {4242}
    assert _through_filter(many, [sent["watched, clean"], sent["other, clean"]]) == [sent["watched, clean"]]


def test_the_watcher_hands_the_kernel_the_tracked_pids_and_every_exit_beyond_its_program():
    fake = FakeNetlink()
    fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))
    watcher = ExitWatcher(factory=lambda: fake, ack_wait=1.0)  # type: ignore[arg-type,return-value]
    assert watcher.start() and watcher.filtered and watcher.watched is None
    watcher.watch({11, 12})
    assert watcher.watched == {11, 12} and len(fake.filters) == 2
    watcher.watch({12, 11})  # the same set: the filter stays
    assert len(fake.filters) == 2
    watcher.watch(set(range(MAX_WATCHED + 1)))  # more than the program holds: every exit again
    assert watcher.watched is None and fake.filters[-1] == fake.filters[0]
    watcher.close()


def test_a_core_dump_flag_does_not_hide_the_signal():
    assert ExitStatus.from_wait_status(0x80 | 6) == ExitStatus(0, 6)  # SIGABRT with core


def test_other_events_connectors_and_broken_messages_are_skipped():
    fork = message(PROC_EVENT_FORK, struct.pack("=IIII", 1, 1, 2, 2))
    other_connector = message(PROC_EVENT_EXIT, EXIT_DATA.pack(5, 5, 256, 17), idx=7)
    short = exit_message(6, 256)[:-16]  # cut inside the exit data, its header still claiming the whole
    exits, _ = parse(fork + other_connector + exit_message(7, 256) + short)
    assert exits == [Exit(7, 7, ExitStatus(1, 0))]
    assert parse(b"")[0] == [] and parse(b"\xff" * 7)[0] == []
    # A length shorter than a header stops the walk instead of looping.
    assert parse(NLMSGHDR.pack(4, 3, 0, 0, 0) + exit_message(8, 0))[0] == []


def test_a_thread_exit_is_kept_apart_from_its_process():
    exits, _ = parse(exit_message(101, 0, tgid=100) + exit_message(100, 256))
    assert [(e.pid, e.process) for e in exits] == [(101, False), (100, True)]


def test_the_acknowledgement_carries_the_kernel_error():
    assert parse(message(PROC_EVENT_NONE, ACK_DATA.pack(1)))[1] == [Ack(1)]
    assert parse(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))[1] == [Ack(0)]


def test_the_listen_message_is_what_the_kernel_expects():
    raw = listen_message()
    length, kind, _, _, _ = NLMSGHDR.unpack_from(raw)
    assert length == len(raw) == NLMSGHDR.size + CN_MSG.size + 4 and kind == 3
    assert CN_MSG.unpack_from(raw, NLMSGHDR.size)[:2] == (CN_IDX_PROC, CN_VAL_PROC)
    assert struct.unpack_from("=I", raw, NLMSGHDR.size + CN_MSG.size) == (PROC_CN_MCAST_LISTEN,)


class FakeNetlink:
    """One end of a datagram socket pair dressed as the netlink socket: what the test
    writes to `peer` the watcher receives."""

    def __init__(self) -> None:
        self._mine, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sent: List[bytes] = []
        self.filters: List[object] = []

    def fileno(self) -> int:
        return self._mine.fileno()

    def setsockopt(self, level: int, option: int, value: object) -> None:
        if option == SO_ATTACH_FILTER:  # the program the kernel would run, copied as the kernel does
            assert isinstance(value, bytes)
            length, address = struct.unpack("@HP", value)
            self.filters.append(ctypes.string_at(address, length * 8))

    def bind(self, address: object) -> None:
        pass

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data)

    def recv(self, n: int) -> bytes:
        return self._mine.recv(n)

    def close(self) -> None:
        self._mine.close()
        self.peer.close()


def test_the_watcher_keeps_process_exits_and_bounds_them():
    fake = FakeNetlink()
    fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))
    watcher = ExitWatcher(capacity=2, factory=lambda: fake, ack_wait=1.0)  # type: ignore[arg-type,return-value]
    assert watcher.start() and watcher.available
    assert fake.sent == [listen_message()]
    watcher._record(parse(exit_message(11, 256) + exit_message(12, 0, tgid=13) + exit_message(13, 0)
                          + exit_message(14, 9))[0])
    assert watcher.status(11) is None  # the oldest, beyond capacity 2
    assert watcher.status(12) is None  # a thread
    assert watcher.status(13) == ExitStatus(0, 0) and watcher.status(14) == ExitStatus(0, 9)
    watcher.close()
    assert not watcher.available


def test_the_watcher_vouches_only_for_watched_pids_with_no_exit_or_lost_event_since_their_mark():
    # What lets the proc source skip the stat() of a known client (sources/proc.py).
    fake = FakeNetlink()
    fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))
    watcher = ExitWatcher(factory=lambda: fake, ack_wait=1.0)  # type: ignore[arg-type,return-value]
    assert watcher.start()
    before = watcher.mark()
    assert watcher.unexited_since({11: before}) == set()  # every exit reaches it, but none is kept by PID
    watcher.watch({11, 12, 13})
    assert watcher.unexited_since({11: before}) == set()  # its clean exits reach it only since the filter
    mark = watcher.mark()
    assert watcher.unexited_since({11: mark, 12: mark, 13: mark, 99: mark}) == {11, 12, 13}  # 99: not watched
    watcher._record(parse(exit_message(12, 0))[0])
    assert watcher.unexited_since({11: mark, 12: mark, 13: mark}) == {11, 13}
    later = watcher.mark()
    assert watcher.unexited_since({12: later}) == {12}  # looked at again after its exit
    watcher.watch({11, 13, 14})  # 12 no longer watched, 14 from now
    assert watcher.unexited_since({11: mark, 12: later, 13: mark, 14: later}) == {11, 13}
    watcher._overflowed()  # the kernel dropped events: nothing from before vouched for
    assert watcher.unexited_since({11: mark, 13: later}) == set()
    assert watcher.unexited_since({11: watcher.mark()}) == {11}
    watcher.close()


def test_the_watcher_is_quiet_since_a_mark_until_a_watched_exit_a_lost_event_or_a_new_watch():
    # What lets the proc source skip the clients it vouched for at once (sources/proc.py).
    fake = FakeNetlink()
    fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))
    watcher = ExitWatcher(factory=lambda: fake, ack_wait=1.0)  # type: ignore[arg-type,return-value]
    assert watcher.start()
    assert not watcher.quiet_since(watcher.mark())  # it watches nobody yet: it vouches for nobody
    watcher.watch({11, 12})
    mark = watcher.mark()
    assert watcher.quiet_since(mark)
    watcher.watch({11, 12})  # the same PIDs: nothing changed
    assert watcher.quiet_since(mark)
    watcher._record(parse(exit_message(99, 0))[0])  # an exit of a PID it does not watch
    assert watcher.quiet_since(mark)
    watcher._record(parse(exit_message(12, 0))[0])
    assert not watcher.quiet_since(mark) and watcher.quiet_since(watcher.mark())
    mark = watcher.mark()
    watcher.watch({11, 13})
    assert not watcher.quiet_since(mark) and watcher.quiet_since(watcher.mark())
    mark = watcher.mark()
    watcher._overflowed()
    assert not watcher.quiet_since(mark) and watcher.quiet_since(watcher.mark())
    watcher.close()
    assert not watcher.quiet_since(watcher.mark())  # no longer listening
    assert watcher.unexited_since({11: watcher.mark()}) == set()  # closed: it hears nothing


def test_the_watcher_reads_exits_in_its_thread():
    fake = FakeNetlink()
    fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(0)))
    watcher = ExitWatcher(factory=lambda: fake)  # type: ignore[arg-type,return-value]
    assert watcher.start()
    fake.peer.send(exit_message(77, 3 << 8))
    for _ in range(200):
        if watcher.status(77) is not None:
            break
        import time
        time.sleep(0.01)
    assert watcher.status(77) == ExitStatus(3, 0)
    watcher.close()


@pytest.mark.parametrize("setup, why", [
    ("no socket", "no netlink connector socket"),
    ("refused", "refused the subscription"),
    ("silent", "no answer from the proc connector"),
])
def test_the_watcher_fails_softly(setup, why):
    fake = FakeNetlink()

    def factory() -> FakeNetlink:
        if setup == "no socket":
            raise PermissionError(1, "Operation not permitted")
        return fake

    if setup == "refused":
        fake.peer.send(message(PROC_EVENT_NONE, ACK_DATA.pack(1)))  # EPERM
    watcher = ExitWatcher(factory=factory, ack_wait=0.1)  # type: ignore[arg-type]
    assert watcher.start() is False
    assert not watcher.available and why in watcher.why_not
    assert watcher.status(1) is None
    watcher.close()


def _connector_works() -> bool:
    if not hasattr(socket, "AF_NETLINK") or os.geteuid() != 0:
        return False
    w = ExitWatcher(ack_wait=0.5)
    ok = w.start()
    w.close()
    return ok


@pytest.mark.skipif(not _connector_works(), reason="needs root and the kernel's proc connector")
def test_a_real_exit_and_a_real_kill_as_root():
    watcher = ExitWatcher()
    assert watcher.start()
    try:
        failed = subprocess.Popen(["sh", "-c", "exit 3"])
        failed.wait()
        killed = subprocess.Popen(["sleep", "30"])
        killed.kill()
        killed.wait()
        import time
        for _ in range(100):
            if watcher.status(killed.pid) is not None:
                break
            time.sleep(0.01)
        assert watcher.status(failed.pid) == ExitStatus(3, 0)
        assert watcher.status(killed.pid) == ExitStatus(0, 9)
    finally:
        watcher.close()
