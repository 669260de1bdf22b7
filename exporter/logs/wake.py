"""Wake the log reader when its files change (inotify), not only every POLL_SECONDS.

Why: copytruncate. logrotate copies the log to its end, fsyncs the copy, then truncates
the log: the lines MPS writes after the copy ends exist only in the live file until the
truncate (0.5-14 ms on the machines measured). A reader polling every 250 ms misses
them; one woken by the write reads them first (docs/logs.md, "Rotation").

`DirectoryWatch(directory, names).wait(timeout)` is the pause between two looks at the
files. It returns after `timeout` seconds, when `wake()` is called from another thread,
or at once when a rotation begins: a name starting with one of `names` (control.log.1,
control.log-20261125 ...) is created, moved or deleted, or a log is (logrotate creates
its copy before it copies, syncs and truncates; a rename moves the log). From then
until ROTATION_SECONDS after the last such sign, every write to a log ends the wait as
well (IN_MODIFY), so the lines written during the copy are read before the truncate.
Outside rotations writes do not wake the reader: each wake-up costs a round of system
calls (~300 us of CPU on a busy 2-core VM, cold caches), and 500 lines/s would cost
13 ms/s read one by one, 7 ms/s coalesced to 20 rounds/s, against 3 ms/s at 4 polls/s
(bench/results/rotation-2026-11-25.md). So the watch asks for IN_MODIFY only while
rotating: one inotify instance per log directory, its mask changed in place.

Where inotify cannot be had (not Linux, the per-user instance or watch limit reached,
the directory missing or unreadable), `wait` just sleeps its timeout: polling as
before; `watching` says which. Each watch is an inotify instance, and instances are
scarce: 128 per user by default (fs.inotify.max_user_instances), shared with systemd,
udev, container runtimes... of the same user. So one process uses at most
MAX_INSTANCES; the daemons past that poll (with one warning). An exporter following
200 DRA claims' daemons would otherwise take them all. The watch is set again on the next wait when the
directory comes back. Only libc through ctypes: no dependency for three system calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import threading
import time
from typing import Any, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)
SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED  # the directory went: watch again later
NAMES_MASK = IN_CREATE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
ROTATING_MASK = NAMES_MASK | IN_MODIFY  # and every write (or truncate: copytruncate's last step)
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
READ_BYTES = 64 * 1024  # events read per call; more wait for the next read
MAX_INSTANCES = 16  # inotify instances one process holds at most (the per-user default limit is 128)
ROTATION_SECONDS = 5.0  # after a rotated name last changed, every write ends the wait (a copy's fsync can be slow)


_instances_lock = threading.Lock()
_instances = 0  # inotify instances this process holds now
_cap_warned = False


def _take_instance() -> bool:
    """One of the process's MAX_INSTANCES, or False (warned once)."""
    global _instances, _cap_warned
    with _instances_lock:
        if _instances < MAX_INSTANCES:
            _instances += 1
            return True
        warn, _cap_warned = not _cap_warned, True
    if warn:
        log.warning("more than %d log directories: the others are read every poll interval, not on each write "
                    "during rotations (copytruncate may then lose lines written just before a rotation)",
                    MAX_INSTANCES)
    return False


def _give_instance() -> None:
    global _instances
    with _instances_lock:
        _instances -= 1


def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    calls = ("inotify_init1", "inotify_add_watch", "inotify_rm_watch")
    return libc if all(hasattr(libc, call) for call in calls) else None


class DirectoryWatch:
    def __init__(self, directory: str, names: Sequence[str]) -> None:
        self.directory = directory
        self._names = tuple(n.encode() for n in names)
        self._libc = _libc()
        self._inotify = -1  # the inotify instance; -1: none (polling)
        self._watch = -1  # the directory's watch; -1: none (yet, or the directory went)
        self._mask = 0  # what the watch asks for now: NAMES_MASK, or ROTATING_MASK
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._poller = select.poll()  # not select(): descriptors past 1024 (the web server raises the limit)
        self._poller.register(self._wake_r, select.POLLIN)
        self._warned: Optional[int] = None  # errno of the last failure logged (once per kind)
        self._capped = False  # the process holds MAX_INSTANCES already: this one polls
        self._rotating_until = 0.0  # time.monotonic() until which writes end the wait
        self.wakeups = 0  # waits ended by a change of the files

    @property
    def watching(self) -> bool:
        return self._watch >= 0

    @property
    def rotating(self) -> bool:
        """A rotation was seen under way lately: writes end the wait."""
        return time.monotonic() < self._rotating_until

    def wait(self, timeout: float, writes: bool = False) -> bool:
        """Until a rotation begins or, during one, a log is written (True), `wake()` or
        `timeout` seconds (False). `writes`: any write to a log ends the wait as well (a
        reader with nothing to do sleeps until there is something, not 4 times a second)."""
        self._watch_for(ROTATING_MASK if writes or self.rotating else NAMES_MASK)
        woken, written, rotation = self._events(timeout)
        if rotation:
            self._rotating_until = time.monotonic() + ROTATION_SECONDS
            self._watch_for(ROTATING_MASK)  # now, before the round this starts reads: no write falls between
        changed = rotation or written and (writes or self.rotating)  # a write queued as the rotation ended: no matter
        self.wakeups += changed
        return changed and not woken

    def wake(self) -> None:
        """End a wait now (from another thread: stopping)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: a wake-up is pending anyway
            pass

    def close(self) -> None:
        if self._inotify >= 0:
            _give_instance()
        for fd in (self._inotify, self._wake_r, self._wake_w):
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self._inotify = self._watch = self._wake_r = self._wake_w = -1

    # ---------------------------------------------------------- internal
    def _watch_for(self, mask: int) -> None:
        """Watch the directory for `mask` (setting the watch again changes its mask)."""
        if self._libc is None or self._watch >= 0 and mask == self._mask:
            return
        if self._inotify < 0:
            if self._capped or not _take_instance():
                self._capped = True  # for good: an instance freed later goes to a watch made later
                return
            fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                _give_instance()
                self._failed(ctypes.get_errno(), "inotify_init1")
                return
            self._inotify = fd
            self._poller.register(fd, select.POLLIN)
        wd = self._libc.inotify_add_watch(self._inotify, os.fsencode(self.directory), mask)
        if wd < 0:
            self._failed(ctypes.get_errno(), f"watching {self.directory}")
            self._watch = -1
            return
        self._watch, self._mask, self._warned = wd, mask, None

    def _forget_watch(self) -> None:
        """The directory was deleted or moved: the watch goes (a moved one would go on
        reporting the old directory); it is set again when the directory is back."""
        if self._watch >= 0 and self._libc is not None:
            self._libc.inotify_rm_watch(self._inotify, self._watch)  # fails harmlessly if gone already
        self._watch = -1

    def _failed(self, err: int, what: str) -> None:
        if err == errno.ENOENT or err == self._warned:  # a missing directory: the readers say so
            return
        self._warned = err
        log.warning("%s: %s; reading the logs every poll interval instead of on each write "
                    "(copytruncate may then lose lines written just before a rotation)", what, os.strerror(err))

    def _events(self, timeout: float) -> Tuple[bool, bool, bool]:
        """(woken, a log written, a rotation under way), after waiting up to `timeout`."""
        ready = {fd for fd, _ in self._poller.poll(int(timeout * 1000 + 0.999))}  # rounded up: no busy loop
        woken = self._wake_r in ready
        if woken:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except OSError:
                pass
        written, rotation = self._read_events() if self._inotify in ready else (False, False)
        return woken, written, rotation

    def _read_events(self) -> Tuple[bool, bool]:
        """(a log written, a rotation under way) from the events waiting. Any event on a
        rotated name is a rotation (logrotate creating or writing its copy); so is a
        log created, moved or deleted."""
        try:
            data = os.read(self._inotify, READ_BYTES)
        except BlockingIOError:
            return False, False
        except OSError as e:
            self._failed(e.errno or 0, "reading inotify events")
            return False, False
        written = rotation = False
        offset = 0
        while offset + EVENT_HEADER.size <= len(data):
            wd, mask, _, length = EVENT_HEADER.unpack_from(data, offset)
            name = data[offset + EVENT_HEADER.size: offset + EVENT_HEADER.size + length].rstrip(b"\0")
            offset += EVENT_HEADER.size + length
            if mask & IN_Q_OVERFLOW:  # events were dropped: anything may have happened
                rotation = True
            elif wd == self._watch and mask & SELF_GONE:
                self._forget_watch()
                rotation = True  # whatever comes back is looked at at once
            elif name in self._names and mask & IN_MODIFY:
                written = True
            elif name.startswith(self._names):
                rotation = True
        return written, rotation
