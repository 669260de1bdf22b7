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
(bench/results/rotation-2026-11-25.md). Two inotify instances keep writes out of the
pause: one for names, always listened to, one for writes, read only while rotating.

Where inotify cannot be had (not Linux, the per-user instance or watch limit reached,
the directory missing or unreadable), `wait` just sleeps its timeout: polling as
before; `watching` says which. The watches are set again on the next wait when the
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
WRITES_MASK = IN_MODIFY | IN_ONLYDIR  # a log written, or truncated (copytruncate's last step)
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
READ_BYTES = 64 * 1024  # events read per call; more wait for the next read
ROTATION_SECONDS = 5.0  # after a rotated name last changed, every write ends the wait (a copy's fsync can be slow)


def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    calls = ("inotify_init1", "inotify_add_watch", "inotify_rm_watch")
    return libc if all(hasattr(libc, call) for call in calls) else None


class _Instance:
    """One inotify instance watching the directory for `mask`."""

    def __init__(self, mask: int) -> None:
        self.mask = mask
        self.fd = -1
        self.wd = -1  # the directory's watch; -1: none (yet, or the directory went)


class DirectoryWatch:
    def __init__(self, directory: str, names: Sequence[str]) -> None:
        self.directory = directory
        self._names = tuple(n.encode() for n in names)
        self._libc = _libc()
        self._names_watch = _Instance(NAMES_MASK)
        self._writes_watch = _Instance(WRITES_MASK)
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        # poll, not select: descriptors past 1024 (the web server raises the file limit)
        self._all = select.poll()  # the wake-up pipe, names and writes
        self._names_only = select.poll()  # the wake-up pipe and names
        for poller in (self._all, self._names_only):
            poller.register(self._wake_r, select.POLLIN)
        self._warned: Optional[int] = None  # errno of the last failure logged (once per kind)
        self._rotating_until = 0.0  # time.monotonic() until which writes are answered at once
        self.wakeups = 0  # waits ended by a change of the files

    @property
    def watching(self) -> bool:
        return self._names_watch.wd >= 0 and self._writes_watch.wd >= 0

    @property
    def rotating(self) -> bool:
        """A rotation was seen under way lately: writes are answered at once."""
        return time.monotonic() < self._rotating_until

    def wait(self, timeout: float) -> bool:
        """Until a rotation begins or, during one, a log is written (True), `wake()` or
        `timeout` seconds (False)."""
        if not self.watching:
            self._add_watches()
        rotating = self.rotating
        woken, written, rotation = self._events(timeout, writes=rotating)
        if rotation:
            if not rotating:  # the writes seen so far are read by the round this starts
                self._read_events(self._writes_watch)
            self._rotating_until = time.monotonic() + ROTATION_SECONDS
        changed = rotation or written
        self.wakeups += changed
        return changed and not woken

    def wake(self) -> None:
        """End a wait now (from another thread: stopping)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: a wake-up is pending anyway
            pass

    def close(self) -> None:
        for instance in (self._names_watch, self._writes_watch):
            if instance.fd >= 0:
                os.close(instance.fd)
            instance.fd = instance.wd = -1
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ---------------------------------------------------------- internal
    def _add_watches(self) -> None:
        if self._libc is None:
            return
        for instance in (self._names_watch, self._writes_watch):
            if instance.fd < 0:
                fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
                if fd < 0:
                    self._failed(ctypes.get_errno(), "inotify_init1")
                    return
                instance.fd = fd
                self._all.register(fd, select.POLLIN)
                if instance is self._names_watch:
                    self._names_only.register(fd, select.POLLIN)
            if instance.wd < 0:
                wd = self._libc.inotify_add_watch(instance.fd, os.fsencode(self.directory), instance.mask)
                if wd < 0:
                    self._failed(ctypes.get_errno(), f"watching {self.directory}")
                    return
                instance.wd = wd
        self._warned = None

    def _forget_watches(self) -> None:
        """The directory was deleted or moved: both watches go (a moved one would go on
        reporting the old directory)."""
        for instance in (self._names_watch, self._writes_watch):
            if instance.wd >= 0 and self._libc is not None:
                self._libc.inotify_rm_watch(instance.fd, instance.wd)  # fails harmlessly if gone already
            instance.wd = -1

    def _failed(self, err: int, what: str) -> None:
        if err == errno.ENOENT or err == self._warned:  # a missing directory: the readers say so
            return
        self._warned = err
        log.warning("%s: %s; reading the logs every poll interval instead of on each write "
                    "(copytruncate may then lose lines written just before a rotation)", what, os.strerror(err))

    def _events(self, timeout: float, writes: bool) -> Tuple[bool, bool, bool]:
        """(woken, a log written, a rotation under way), after waiting up to `timeout`."""
        poller = self._all if writes else self._names_only
        ready = {fd for fd, _ in poller.poll(int(timeout * 1000 + 0.999))}  # rounded up: never a busy loop
        woken = written = rotation = False
        if self._wake_r in ready:
            woken = True
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except OSError:
                pass
        for instance in (self._names_watch, self._writes_watch):
            if instance.fd in ready:
                live, rotated = self._read_events(instance)
                written, rotation = written or live, rotation or rotated
        return woken, written, rotation

    def _read_events(self, instance: _Instance) -> Tuple[bool, bool]:
        """(a log written, a rotation under way) from the events waiting on `instance`.
        Any event on a rotated name is a rotation (logrotate creating or writing its
        copy); so is a log created, moved or deleted."""
        if instance.fd < 0:
            return False, False
        try:
            data = os.read(instance.fd, READ_BYTES)
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
            elif wd == instance.wd and mask & SELF_GONE:  # set again on the next wait, when it is back
                self._forget_watches()
                written = True
            elif name in self._names and mask & IN_MODIFY:
                written = True
            elif name.startswith(self._names):
                rotation = True
        return written, rotation
