"""The four ways rename rotation lost, doubled or cut lines (issue 42, point 4), each
replayed with the follower alone, step by step: birth times and the drain's clock are
injected, so no test depends on how fast the machine or its file system clock is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from mps_exporter.logs import birth as birth_module
from mps_exporter.logs import follower as follower_module
from mps_exporter.logs.follower import DRAIN_SECONDS, FileFollower


class Births:
    """Birth times by inode, given by the test as it creates files (statx's stx_btime)."""

    def __init__(self) -> None:
        self.by_inode: Dict[int, int] = {}
        self.clock = 10**18

    def born(self, path: Path) -> None:
        self.clock += 1_000_000
        self.by_inode[os.stat(path).st_ino] = self.clock

    def of_path(self, path: str) -> Optional[int]:
        try:
            return self.by_inode.get(os.lstat(path).st_ino)
        except OSError:
            return None

    def of_fd(self, fd: int) -> Optional[int]:
        return self.by_inode.get(os.fstat(fd).st_ino)


@pytest.fixture
def births(monkeypatch) -> Births:
    b = Births()
    monkeypatch.setattr(birth_module, "path_birth_ns", b.of_path)
    monkeypatch.setattr(birth_module, "fd_birth_ns", b.of_fd)
    return b


def create(path: Path, births: Births, mtime_ns: int) -> None:
    """logrotate's `create`: a new empty log."""
    path.touch(exist_ok=False)
    births.born(path)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def append(path: Path, text: str, mtime_ns: int) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def shift(directory: Path) -> None:
    """logrotate's renames: control.log.N -> .N+1 from the oldest, control.log -> .1."""
    numbers = sorted((int(p.name.rsplit(".", 1)[1]) for p in directory.glob("control.log.*")), reverse=True)
    for n in numbers:
        os.rename(directory / f"control.log.{n}", directory / f"control.log.{n + 1}")
    os.rename(directory / "control.log", directory / "control.log.1")


def drain(f: FileFollower) -> List[str]:
    out: List[str] = []
    while True:
        got, _ = f.poll()
        out += got
        if not got and not f.more:
            return out


def test_a_new_log_still_empty_and_older_by_mtime_is_read_when_written_later(tmp_path, births):
    """The new log is created at t=10; the writer's last lines go to the old file at t=20
    (it has not reopened yet), then it reopens the new log, which logrotate renames before
    the writer writes there and before the follower looks. The new log, `.1` now, is empty
    and older by mtime than the old file: the follower skipped it for good, and the lines
    written to it later were lost (CI's 215 of 5,023)."""
    log = tmp_path / "control.log"
    create(log, births, 1)
    append(log, "a0\n", 5)
    f = FileFollower(str(log))
    assert drain(f) == ["a0"]
    old = os.open(log, os.O_WRONLY | os.O_APPEND)
    shift(tmp_path)  # rotation 1
    create(log, births, 10)
    new = os.open(log, os.O_WRONLY | os.O_APPEND)  # the writer reopens ...
    os.write(old, b"a1\n")  # ... after its last line to the old file (the order of a SIGHUP handler)
    os.utime(tmp_path / "control.log.1", ns=(20, 20))
    os.close(old)
    shift(tmp_path)  # rotation 2: the new log is `.1`, still empty, mtime 10 < 20
    create(log, births, 30)
    assert drain(f) == ["a1"]
    os.write(new, b"b0\n")  # the writer writes to the file it opened, renamed meanwhile
    os.close(new)
    append(log, "c0\n", 40)  # and after the next SIGHUP, to the newest log
    assert drain(f) == ["b0", "c0"]


def test_a_new_file_with_a_finished_files_inode_number_is_read(tmp_path, births):
    """ext4 gives a deleted file's inode number to the next file created: a new log with
    the number of a rotated file the follower read to its end (and remembers as finished)
    was taken for that file and skipped. The birth time tells them apart."""
    log = tmp_path / "control.log"
    create(log, births, 1)
    append(log, "a0\n", 2)
    now = [0.0]
    f = FileFollower(str(log), clock=lambda: now[0])
    assert drain(f) == ["a0"]
    shift(tmp_path)
    create(log, births, 3)
    append(log, "b0\n", 4)
    assert drain(f) == ["b0"]
    now[0] += DRAIN_SECONDS
    assert drain(f) == []  # the first file is closed: its inode number may be given again
    os.unlink(tmp_path / "control.log.1")  # `rotate N` deletes it
    shift(tmp_path)
    create(log, births, 5)  # a new log ... rotated before the follower saw it
    shift(tmp_path)
    create(log, births, 6)
    append(tmp_path / "control.log.1", "c0\n", 7)
    append(log, "d0\n", 8)
    reused = os.stat(tmp_path / "control.log.1")
    finished = f._finished[0]
    # What ext4 does (here it often has already): the deleted first file's inode number is the one `.1` got.
    f._finished[0] = (reused.st_dev, reused.st_ino, *finished[2:])
    assert drain(f) == ["c0", "d0"]


def test_a_torn_listing_does_not_make_an_old_file_look_like_a_copy(tmp_path, births, monkeypatch):
    """The rotated files are listed while logrotate shifts `.N` to `.N+1`: a file listed
    under neither name is missing from the note taken while the new log was empty. When
    the log then holds bytes, that file looked new and unlike the log: a copytruncate's
    copy, and the follower left the live log to read an old file from its start."""
    log = tmp_path / "control.log"
    create(log, births, 1)
    append(log, "a0\na1\n", 2)
    f = FileFollower(str(log))
    assert drain(f) == ["a0", "a1"]
    shift(tmp_path)
    create(log, births, 3)
    real = follower_module.FileFollower._sibling_identities
    missed = os.stat(tmp_path / "control.log.1")
    torn = [True]

    def note(self):  # the note's listing misses control.log.1 (renamed to .2 under it)
        found = real(self)
        if torn[0]:
            torn[0] = False
            return [i for i in found if i != (missed.st_dev, missed.st_ino)]
        return found

    monkeypatch.setattr(follower_module.FileFollower, "_sibling_identities", note)
    assert drain(f) == []  # the new log, empty: the rotated files beside it are noted
    assert not torn[0]
    append(log, "b0\n", 4)
    assert drain(f) == ["b0"]
    assert f.truncations == 0


def test_a_listing_that_misses_the_next_file_does_not_skip_it(tmp_path, births, monkeypatch):
    """Two rotations before the follower looks: the file between the one it finished and
    the live log is found by a listing, which logrotate's renames can tear. One listing
    that misses it must not make the follower go on to the live log without it."""
    log = tmp_path / "control.log"
    create(log, births, 1)
    append(log, "a0\n", 2)
    f = FileFollower(str(log))
    assert drain(f) == ["a0"]
    shift(tmp_path)
    create(log, births, 3)
    append(log, "b0\n", 4)
    shift(tmp_path)
    create(log, births, 5)
    append(log, "c0\n", 6)
    real_scandir = os.scandir
    calls = [0]

    def scandir(path):  # the first listing of the directory misses control.log.1
        calls[0] += 1
        entries = list(real_scandir(path))
        return _Entries([e for e in entries if calls[0] > 1 or e.name != "control.log.1"])

    monkeypatch.setattr(follower_module.os, "scandir", scandir)
    assert drain(f) == ["b0", "c0"]
    assert calls[0] > 1


class _Entries(list):  # type: ignore[type-arg]
    def __enter__(self) -> "_Entries":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_leaving_a_renamed_file_never_hands_out_half_a_line(tmp_path, births):
    """A writer that writes a line in two write() calls (stdio flushing a full buffer) has
    written the first half when logrotate renames the log; the follower leaves the file at
    that point. The half was handed out as a line, and the rest, written to the old file
    before the writer reopened, as a second line."""
    log = tmp_path / "control.log"
    create(log, births, 1)
    now = [0.0]
    f = FileFollower(str(log), clock=lambda: now[0])
    writer = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.write(writer, b"[2026-11-28 07:00:00.000 Control  1419] NEW UI 0\n[2026-11-28 07:00:00.000 Cont")
    assert drain(f) == ["[2026-11-28 07:00:00.000 Control  1419] NEW UI 0"]
    shift(tmp_path)
    create(log, births, 2)
    assert drain(f) == []  # the half line waits in the old file for the rest
    now[0] += DRAIN_SECONDS / 2
    os.write(writer, b"rol  1419] NEW UI 1\n")  # the rest, then SIGHUP: the writer reopens
    os.close(writer)
    append(log, "[2026-11-28 07:00:00.000 Control  1419] NEW UI 2\n", 3)
    assert drain(f) == ["[2026-11-28 07:00:00.000 Control  1419] NEW UI 1",
                        "[2026-11-28 07:00:00.000 Control  1419] NEW UI 2"]
    now[0] += DRAIN_SECONDS
    assert drain(f) == []  # nothing left over in the old file
