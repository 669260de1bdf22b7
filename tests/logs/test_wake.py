"""DirectoryWatch: the log reader's pause, ended by a rotation and, during one, by writes."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import time

from mps_exporter.logs import wake
from mps_exporter.logs.wake import DirectoryWatch


def later(action, seconds: float = 0.1) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    t.start()
    return t


def append(path, text: str = "line\n") -> None:
    with open(path, "a") as f:
        f.write(text)


def test_a_rotation_ends_the_wait_and_then_every_write_does(tmp_path):
    log = tmp_path / "control.log"
    append(log)
    watch = DirectoryWatch(str(tmp_path), ["control.log", "server.log"])
    try:
        assert watch.wait(0.05) is False and watch.watching and not watch.rotating
        later(lambda: shutil.copy(log, tmp_path / "control.log.1")).join()  # logrotate's copy, created first
        assert watch.wait(30) is True and watch.rotating  # a timeout would say False
        while watch.wait(0.05):  # the events of the copy's creation and write
            pass
        append(log)  # written after the copy: must be read before the truncate
        assert watch.wait(0) is True
        assert watch.wait(0) is False  # seen once
        with open(log, "r+") as f:
            f.truncate(0)
        assert watch.wait(0) is True
        append(tmp_path / "server.log")  # the other log too
        assert watch.wait(0) is True
    finally:
        watch.close()


def test_writes_and_other_files_do_not_end_the_wait_outside_a_rotation(tmp_path):
    log = tmp_path / "control.log"
    append(log)
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        watch.wait(0)  # the watches are set on the first wait
        append(log)
        (tmp_path / "notes.txt").write_text("x")
        os.rename(tmp_path / "notes.txt", tmp_path / "notes.old")
        assert watch.wait(0.1) is False
        assert watch.wakeups == 0
    finally:
        watch.close()


def test_wake_ends_a_wait_from_another_thread(tmp_path):
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        t0 = time.monotonic()
        later(watch.wake)
        assert watch.wait(60) is False
        assert time.monotonic() - t0 < 30  # not the 60 s timeout
    finally:
        watch.close()


def test_a_directory_that_comes_later_or_comes_back_is_watched_again(tmp_path):
    directory = tmp_path / "mps-log"
    watch = DirectoryWatch(str(directory), ["control.log"])
    try:
        assert watch.wait(0.01) is False and not watch.watching  # nothing to watch yet: a plain pause
        directory.mkdir()
        watch.wait(0.01)
        assert watch.watching
        shutil.rmtree(directory)  # NVIDIA's device plugin deletes it when the daemon stops
        watch.wait(1)
        watch.wait(0.01)
        assert not watch.watching
        directory.mkdir()
        watch.wait(0.01)
        assert watch.watching
        later(lambda: (directory / "control.log.1").write_text("x"))
        assert watch.wait(30) is True and watch.rotating
        while watch.wait(0.05):  # the events of the copy's creation and write
            pass
        append(directory / "control.log")  # writes are watched in the new directory too
        assert watch.wait(0) is True
        os.rename(directory, tmp_path / "moved")  # a moved directory is not followed
        watch.wait(1)
        assert not watch.watching
    finally:
        watch.close()


def test_without_inotify_it_is_a_plain_pause(tmp_path, monkeypatch):
    monkeypatch.setattr(wake, "_libc", lambda: None)
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        (tmp_path / "control.log.1").write_text("x")
        assert watch.wait(0.05) is False and not watch.watching
    finally:
        watch.close()


REAL_LIBC = wake._libc()


class NoMoreWatches:
    """libc whose inotify_add_watch fails as at the per-user watch limit."""

    def __init__(self) -> None:
        self.real = REAL_LIBC

    def inotify_init1(self, flags: int) -> int:
        return int(self.real.inotify_init1(flags))

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    def inotify_rm_watch(self, fd: int, wd: int) -> int:
        return int(self.real.inotify_rm_watch(fd, wd))


def test_the_watch_limit_falls_back_to_polling_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(wake, "_libc", NoMoreWatches)
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        for _ in range(3):
            assert watch.wait(0.01) is False
        assert not watch.watching
        warnings = [r for r in caplog.records if "reading the logs every poll interval" in r.getMessage()]
        assert len(warnings) == 1 and os.strerror(errno.ENOSPC) in warnings[0].getMessage()
    finally:
        watch.close()


def test_writes_right_after_the_first_sign_of_a_rotation_are_not_missed(tmp_path):
    """The round that the first sign starts reads the file; a line written after that
    read and before the next wait must still end that wait (the watch asks for writes
    from the sign on, not from the next wait on)."""
    log = tmp_path / "control.log"
    append(log)
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        watch.wait(0)
        (tmp_path / "control.log.1").write_text("")  # created empty: no write event of its own
        assert watch.wait(0) is True  # ... the round reads the log here ...
        append(log)  # ... and MPS writes one more line before the next wait
        assert watch.wait(0) is True
    finally:
        watch.close()


def test_a_process_holds_at_most_max_instances_and_gives_them_back(tmp_path, monkeypatch, caplog):
    """200 DRA claims' daemons must not take every inotify instance of the user (128 by
    default, shared with systemd and the container runtime): past MAX_INSTANCES, poll."""
    held = wake._instances  # by other watches of this process, if any
    monkeypatch.setattr(wake, "MAX_INSTANCES", held + 2)
    monkeypatch.setattr(wake, "_cap_warned", False)
    watches = [DirectoryWatch(str(tmp_path), ["control.log"]) for _ in range(4)]
    try:
        for w in watches:
            w.wait(0)
        assert [w.watching for w in watches] == [True, True, False, False]
        assert caplog.text.count("more than") == 1
        watches[0].close()
        again = DirectoryWatch(str(tmp_path), ["control.log"])
        watches.append(again)
        again.wait(0)
        assert again.watching  # the instance given back went to the next watch made
        assert not watches[2].watching  # a capped one stays polling
    finally:
        for w in watches:
            w.close()
    assert wake._instances == held  # all given back, none twice


def test_asked_for_writes_a_plain_write_ends_the_wait(tmp_path):
    log = tmp_path / "control.log"
    append(log)
    watch = DirectoryWatch(str(tmp_path), ["control.log", "server.log"])
    try:
        assert watch.wait(0.05) is False and not watch.rotating
        later(lambda: append(log)).join()
        assert watch.wait(0.2) is False  # outside a rotation a write does not wake a plain wait
        later(lambda: append(log))
        started = time.monotonic()
        assert watch.wait(30, writes=True) is True and time.monotonic() - started < 10
        assert not watch.rotating  # a write is no rotation
    finally:
        watch.close()
