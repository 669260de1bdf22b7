"""Rotation by `copy` and a collapse of the copied bytes from the front of the log
(deploy/systemd/mps-log-collapse): the follower reads every line once.

The collapse is done here by rewriting the file in place (same inode: its bytes move
to the front, then it is cut), which is what fallocate --collapse-range leaves; one
test runs the shipped script with the real fallocate where the file system has it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from mps_exporter.logs.follower import FileFollower
from tests.logs.test_follower import drain, lines, text, truncate, write

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "mps-log-collapse"


def block(path: Path) -> int:
    st = os.statvfs(path.parent)
    return st.f_frsize or st.f_bsize


def collapse(path: Path, copy: Path) -> int:
    """What the postrotate script does after logrotate's `copy`: remove the copy's
    length, rounded down to the block size, from the front of the log. Returns N."""
    c = copy.stat().st_size
    n = c - c % block(path)
    with open(path, "r+b") as fh:
        data = fh.read()
        assert data[:c] == copy.read_bytes()
        fh.seek(0)
        fh.write(data[n:])
        fh.truncate(len(data) - n)
    return n


def big(n: int, tag: str) -> List[str]:
    """n lines of about 80 bytes: 100 of them span two 4 KiB blocks."""
    return [line + " " + "x" * 30 for line in lines(n, tag)]


def test_a_collapse_after_the_reader_passed_the_copy_skips_the_duplicated_head(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(big(100, "copied")))
    f = FileFollower(str(path))
    assert drain(f) == big(100, "copied")
    shutil.copy(path, tmp_path / "control.log.1")  # logrotate `copy`
    write(path, text(big(3, "after the copy")))
    assert drain(f) == big(3, "after the copy")  # read before the collapse
    n = collapse(path, tmp_path / "control.log.1")
    assert 0 < n < (tmp_path / "control.log.1").stat().st_size  # not a block multiple
    write(path, text(big(2, "new")))
    assert drain(f) == big(2, "new")
    write(path, "more\n")
    assert drain(f) == ["more"]
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_collapse_before_the_reader_reached_the_copys_end(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(big(10, "seen")))
    f = FileFollower(str(path))
    assert drain(f) == big(10, "seen")
    write(path, text(big(90, "unread")) + "[2026-11-21 04:19:59.000 Control   546] a line cut by the cop")
    shutil.copy(path, tmp_path / "control.log.1")
    write(path, "y\n" + text(big(3, "after the copy")))
    collapse(path, tmp_path / "control.log.1")
    write(path, text(big(2, "new")))
    assert drain(f) == (big(90, "unread") + ["[2026-11-21 04:19:59.000 Control   546] a line cut by the copy"]
                        + big(3, "after the copy") + big(2, "new"))
    write(path, "more\n")
    assert drain(f) == ["more"]
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_collapse_of_a_log_never_read_before(tmp_path):
    path = tmp_path / "control.log"
    write(path, "")
    f = FileFollower(str(path))
    assert drain(f) == []
    write(path, text(big(100, "unread")))
    shutil.copy(path, tmp_path / "control.log.1")
    write(path, text(big(1, "after the copy")))
    collapse(path, tmp_path / "control.log.1")
    assert drain(f) == big(100, "unread") + big(1, "after the copy")
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_copy_of_whole_blocks_leaves_no_head_to_skip(tmp_path):
    path = tmp_path / "control.log"
    bs = block(path)
    one = "[2026-11-21 04:19:00.000 Control   546] " + "z" * (bs // 2 - 41) + "\n"
    assert len(one) * 2 == bs
    write(path, one * 2)
    f = FileFollower(str(path))
    assert drain(f) == [one[:-1]] * 2
    write(path, one * 2)  # unread
    shutil.copy(path, tmp_path / "control.log.1")  # 2 blocks exactly
    write(path, text(big(2, "after the copy")))
    assert collapse(path, tmp_path / "control.log.1") == 2 * bs
    assert drain(f) == [one[:-1]] * 2 + big(2, "after the copy")
    assert f.rotation_gaps == 0


@pytest.mark.parametrize("reader_behind", [False, True])
def test_a_real_copytruncate_whose_head_does_not_match_is_read_from_the_start(tmp_path, reader_behind):
    path = tmp_path / "control.log"
    write(path, text(big(100, "copied")))
    f = FileFollower(str(path))
    assert drain(f) == big(100, "copied")
    write(path, text(big(3, "unread" if reader_behind else "read")))
    if not reader_behind:
        assert drain(f) == big(3, "read")
    shutil.copy(path, tmp_path / "control.log.1")
    truncate(path)
    write(path, text(big(60, "new")))  # longer than what a collapse would have left
    expected = (big(3, "unread") if reader_behind else []) + big(60, "new")
    assert drain(f) == expected
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_head_shorter_than_the_copys_tail_is_not_taken_for_a_collapse(tmp_path):
    """Truncated, then the first bytes written are the same as the start of the copy's
    last C - N bytes, but fewer: a collapse would leave all of them. Read from 0."""
    path = tmp_path / "control.log"
    write(path, text(big(100, "copied")))
    f = FileFollower(str(path))
    assert drain(f) == big(100, "copied")
    write(path, text(big(1, "unread")))
    shutil.copy(path, tmp_path / "control.log.1")
    data = (tmp_path / "control.log.1").read_bytes()
    c = len(data)
    n = c - c % block(path)
    assert c - n > 20
    truncate(path)
    write(path, data[n:n + 10].decode())  # the first 10 of the copy's last c - n bytes
    assert drain(f) == big(1, "unread")
    write(path, "\n")
    assert drain(f) == [data[n:n + 10].decode()]  # read from 0, not skipped
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_writer_that_keeps_its_offset_leaves_a_hole_after_a_collapse(tmp_path):
    """MPS's open mode is not known: without O_APPEND its next write after a collapse
    lands at its old offset, leaving N NUL bytes. Nothing is read twice, no empty line."""
    path = tmp_path / "control.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # no O_APPEND
    try:
        os.write(fd, text(big(100, "copied")).encode())
        f = FileFollower(str(path))
        got = drain(f)
        os.write(fd, text(big(2, "unread")).encode())
        shutil.copy(path, tmp_path / "control.log.1")
        os.write(fd, text(big(1, "after the copy")).encode())
        n = collapse(path, tmp_path / "control.log.1")
        os.write(fd, text(big(2, "new")).encode())  # at its old offset: a hole of n NULs before it
        assert os.stat(path).st_size == os.lseek(fd, 0, os.SEEK_CUR)
        assert path.read_bytes().count(b"\0") == n
        got += drain(f)
        os.write(fd, b"more\n")
        got += drain(f)
    finally:
        os.close(fd)
    assert got == big(100, "copied") + big(2, "unread") + big(1, "after the copy") + big(2, "new") + ["more"]
    assert f.rotation_gaps == 0


def test_two_rotations_in_turn_read_every_line_once(tmp_path):
    path = tmp_path / "control.log"
    write(path, "")
    f = FileFollower(str(path))
    assert drain(f) == []
    got: List[str] = []
    expected: List[str] = []
    for r in range(4):
        batch = big(70, f"rotation {r}")
        write(path, text(batch[:50]))
        got += drain(f) if r % 2 else []
        write(path, text(batch[50:]))
        if (tmp_path / "control.log.1").exists():
            os.rename(tmp_path / "control.log.1", tmp_path / f"control.log.{r + 1}0")
        shutil.copy(path, tmp_path / "control.log.1")
        collapse(path, tmp_path / "control.log.1")
        expected += batch
        got += drain(f)
    assert got == expected
    assert f.rotation_gaps == 0


def test_the_shipped_script_with_the_real_fallocate(tmp_path):
    """The shipped postrotate script on tmp_path's file system: a collapse where it
    can, else its copytruncate fallback (said on stderr). Either way, every line once."""
    path = tmp_path / "control.log"
    write(path, text(big(100, "copied")))
    f = FileFollower(str(path))
    assert drain(f) == big(100, "copied")
    write(path, text(big(5, "unread")))
    copy = tmp_path / "control.log.1"
    shutil.copy(path, copy)
    with open(path, "a", encoding="utf-8") as writer:  # MPS's descriptor, O_APPEND
        writer.write(text(big(1, "after the copy")))
        writer.flush()
        result = subprocess.run(["sh", str(SCRIPT), str(path), str(copy)], capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 0, result.stderr
        writer.write(text(big(2, "new")))
    collapsed = "fallocate --collapse-range failed" not in result.stderr
    assert drain(f) == big(5, "unread") + big(1, "after the copy") + big(2, "new")
    assert f.rotation_gaps == 0
    if collapsed:
        assert path.stat().st_size < 4 * block(path)  # the copied blocks are gone from the log


def test_the_script_removes_nothing_when_the_copy_is_not_the_logs_head(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(big(100, "log")))
    copy = tmp_path / "control.log.1"
    write(copy, text(big(100, "other")))
    before = path.read_bytes()
    result = subprocess.run(["sh", str(SCRIPT), str(path), str(copy)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "nothing removed" in result.stderr
    assert path.read_bytes() == before
    result = subprocess.run(["sh", str(SCRIPT), str(path), str(tmp_path / "missing")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1 and path.read_bytes() == before


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_the_script_falls_back_to_copytruncate_on_tmpfs():
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path, copy = Path(d) / "control.log", Path(d) / "control.log.1"
        write(path, text(big(100, "copied")))
        shutil.copy(path, copy)
        write(path, "after the copy\n")
        result = subprocess.run(["sh", str(SCRIPT), str(path), str(copy)], capture_output=True, text=True,
                                timeout=30)
        if "fallocate --collapse-range failed" not in result.stderr:
            pytest.skip("this tmpfs collapses")
        assert result.returncode == 0
        assert path.stat().st_size == 0 and copy.read_text() == text(big(100, "copied")) + "after the copy\n"


def test_the_script_leaves_a_log_of_whole_copied_blocks_alone(tmp_path):
    """A collapse may not reach the end of the file: a copy of whole blocks with nothing
    written since is left for the next rotation (and the follower sees no rotation)."""
    path = tmp_path / "control.log"
    bs = block(path)
    write(path, ("y" * 99 + "\n") * (bs // 100) + "z" * (bs % 100 - 1) + "\n")
    assert path.stat().st_size == bs
    f = FileFollower(str(path))
    got = drain(f)
    copy = tmp_path / "control.log.1"
    shutil.copy(path, copy)
    result = subprocess.run(["sh", str(SCRIPT), str(path), str(copy)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stderr == ""
    assert path.read_bytes() == copy.read_bytes()
    write(path, "new\n")
    assert got + drain(f) == ["y" * 99] * (bs // 100) + ["z" * (bs % 100 - 1), "new"]
    assert f.truncations == 0
