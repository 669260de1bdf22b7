"""FileFollower with real files in a temporary directory: every fault the issue lists."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List

import pytest

from mps_exporter.logs.follower import DRAIN_SECONDS, NOT_REGULAR_FILE, FileFollower


def lines(n: int, tag: str = "a") -> List[str]:
    return [f"[2026-11-21 04:19:{i % 60:02d}.{i % 1000:03d} Control   546] {tag} line {i}" for i in range(n)]


def write(path: Path, text: str, mode: str = "a") -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.write(text)


def text(lines: List[str]) -> str:
    """The lines as a file holds them, each with its newline."""
    return "".join(line + "\n" for line in lines)


def truncate(path: Path) -> None:
    with open(path, "r+") as fh:
        fh.truncate(0)


def drain(f: FileFollower) -> List[str]:
    out: List[str] = []
    while True:
        got, _ = f.poll()
        if not got:
            return out
        out += got


def test_file_that_does_not_exist_yet(tmp_path):
    path = tmp_path / "logs" / "control.log"
    f = FileFollower(str(path))
    assert f.poll() == ([], 0)
    path.parent.mkdir()
    assert f.poll() == ([], 0)
    write(path, text(lines(3)))
    assert drain(f) == lines(3)


def test_partial_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "control.log"
    write(path, "first\nsec")
    f = FileFollower(str(path))
    assert drain(f) == ["first"]
    write(path, "ond")
    assert drain(f) == []
    write(path, "\nthird\n")
    assert drain(f) == ["second", "third"]


def test_rename_rotation_finishes_the_old_file_first(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(lines(5, "old")))
    now = [0.0]
    f = FileFollower(str(path), clock=lambda: now[0])
    assert drain(f) == lines(5, "old")
    os.rename(path, tmp_path / "control.log.1")
    write(tmp_path / "control.log.1", "old tail\nold unterminated")  # written after the rename
    write(path, text(lines(3, "new")))
    assert drain(f) == ["old tail"] + lines(3, "new")  # the unterminated line waits for its newline
    write(path, "more\n")
    assert drain(f) == ["more"]
    now[0] += DRAIN_SECONDS  # its writer is gone: the old file's last bytes are its last line
    assert drain(f) == ["old unterminated"]
    assert f.rotations == 1


def test_copytruncate_starts_again_from_the_beginning(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(lines(50)))
    f = FileFollower(str(path))
    assert len(drain(f)) == 50
    shutil.copy(path, tmp_path / "control.log.1")
    truncate(path)
    write(path, "after truncate\n")
    assert drain(f) == ["after truncate"]
    assert f.truncations == 1


def test_copytruncate_then_regrown_past_the_old_offset(tmp_path):
    # Between two polls the file is truncated and grows beyond where we were:
    # its size does not shrink, its first bytes change.
    path = tmp_path / "control.log"
    write(path, text(lines(2, "x")))
    f = FileFollower(str(path))
    assert drain(f) == lines(2, "x")
    write(path, text(lines(10, "y")), mode="w")
    assert drain(f) == lines(10, "y")


def test_writer_keeping_its_offset_leaves_a_nul_hole(tmp_path):
    # copytruncate while MPS writes without O_APPEND: the next write lands at its old
    # offset, the file starts with a hole of NUL bytes. The line after it must survive.
    path = tmp_path / "control.log"
    write(path, text(lines(2000)))
    f = FileFollower(str(path), max_line_bytes=4096)
    assert len(drain(f)) == 2000
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.seek(size)
        fh.write(b"[2026-11-21 04:20:00.000 Control   546] after the hole\n")
    got, truncated = f.poll()
    assert got == ["[2026-11-21 04:20:00.000 Control   546] after the hole"] and truncated == 0


def test_directory_deleted_and_created_again(tmp_path):
    directory = tmp_path / "mps-log"
    directory.mkdir()
    path = directory / "server.log"
    write(path, "one\ntwo\n")
    f = FileFollower(str(path))
    assert drain(f) == ["one", "two"]
    shutil.rmtree(directory)
    assert f.poll() == ([], 0)
    assert f.poll() == ([], 0)
    directory.mkdir()
    write(path, "three\n")
    assert drain(f) == ["three"]
    write(path, "four\n")
    assert drain(f) == ["four"]


def test_non_utf8_and_nul_bytes(tmp_path):
    path = tmp_path / "control.log"
    path.write_bytes(b"caf\xe9 \xff\xfe\nN\x00U\x00L\n\x00\x00\x00\n")
    f = FileFollower(str(path))
    assert drain(f) == ["caf\ufffd \ufffd\ufffd", "NUL", ""]


def test_absurdly_long_line_is_capped_and_counted(tmp_path):
    path = tmp_path / "control.log"
    f = FileFollower(str(path), max_line_bytes=1000)
    write(path, "x" * 5_000_000)  # no newline yet: memory holds at most the cap
    assert f.poll() == ([], 0)
    assert len(f._partial) <= 1000
    write(path, "y" * 10 + "\nshort\n" + "z" * 3000 + "\n")
    got, truncated = f.poll()
    assert got == ["x" * 1000, "short", "z" * 1000] and truncated == 2


def test_position_and_resume_neither_skip_nor_repeat(tmp_path):
    path = tmp_path / "control.log"
    write(path, "\n".join(lines(10)) + "\nhalf a li")
    f = FileFollower(str(path))
    first = drain(f)
    saved = f.position()
    f.close()
    write(path, "ne\n" + text(lines(4, "b")))
    g = FileFollower(str(path))
    g.resume(saved)
    assert first + drain(g) == lines(10) + ["half a line"] + lines(4, "b")


def test_resume_after_rotation_while_down_reads_the_rotated_tail(tmp_path):
    path = tmp_path / "control.log"
    write(path, "a\nb\n")
    f = FileFollower(str(path))
    assert drain(f) == ["a", "b"]
    saved = f.position()
    f.close()
    write(path, "c\n")  # written while the exporter was down, then rotated away
    os.rename(path, tmp_path / "control.log.1")
    write(path, "d\n")
    g = FileFollower(str(path))
    g.resume(saved)
    assert drain(g) == ["c", "d"]


def test_resume_with_a_different_file_reads_it_whole(tmp_path):
    path = tmp_path / "control.log"
    write(path, "a\nb\n")
    f = FileFollower(str(path))
    drain(f)
    saved = f.position()
    f.close()
    path.unlink()
    write(path, "new 1\nnew 2\nnew 3\n")
    g = FileFollower(str(path))
    g.resume(saved)
    assert drain(g) == ["new 1", "new 2", "new 3"]
    h = FileFollower(str(path))
    with pytest.raises(KeyError):  # not a position: the pipeline counts it and starts from the logs
        h.resume({"garbage": True})
    assert drain(h) == ["new 1", "new 2", "new 3"]


def test_a_directory_in_place_of_the_file_is_reported_not_read(tmp_path):
    (tmp_path / "control.log").mkdir()
    f = FileFollower(str(tmp_path / "control.log"))
    assert f.poll() == ([], 0) and f.error is not None and f.error.reason == NOT_REGULAR_FILE
    (tmp_path / "control.log").rmdir()
    write(tmp_path / "control.log", "now a file\n")
    assert drain(f) == ["now a file"] and f.error is None


def test_position_survives_while_the_file_is_missing(tmp_path):
    path = tmp_path / "control.log"
    write(path, "a\nb\n")
    f = FileFollower(str(path))
    drain(f)
    saved = f.position()
    f.close()
    path.unlink()
    g = FileFollower(str(path))
    g.resume(saved)
    assert g.poll() == ([], 0)
    assert g.position() == saved  # saved again unchanged (JSON-safe) until the file is back


# ------------------------------------------------------------ rotation without loss (issue 26)

def copytruncate(path: Path, copy_name: str) -> None:
    """What logrotate's copytruncate does: copy, then truncate in place."""
    shutil.copy(path, path.parent / copy_name)
    truncate(path)


def test_copytruncate_reads_the_unread_part_from_the_copy_first(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(lines(10, "seen")))
    f = FileFollower(str(path))
    assert drain(f) == lines(10, "seen")
    write(path, text(lines(4, "unread")))  # written, then rotated before the next poll
    write(tmp_path / "control.log.3", text(lines(9, "an older rotation")))
    copytruncate(path, "control.log-20261125")  # a dated name: found by content, not by name
    write(path, text(lines(2, "new")))
    assert drain(f) == lines(4, "unread") + lines(2, "new")  # nothing lost, nothing twice
    write(path, "more\n")
    assert drain(f) == ["more"]
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_copy_with_other_content_is_not_taken_for_ours(tmp_path, caplog):
    path = tmp_path / "control.log"
    write(path, text(lines(10, "seen")))
    f = FileFollower(str(path))
    drain(f)
    write(path, text(lines(4, "unread")))
    same_start = text(lines(10, "seen")[:1] + lines(20, "forged"))  # same head, other bytes at our offset
    write(tmp_path / "control.log.1", same_start)
    truncate(path)  # and the real copy was compressed already: gone
    write(path, text(lines(2, "new")))
    assert drain(f) == lines(2, "new")
    assert f.rotation_gaps == 1
    assert "no rotated copy beside it holds the part not yet read" in caplog.text


def test_several_renames_between_two_polls_are_all_read_in_order(tmp_path):
    path = tmp_path / "control.log"
    write(path, text(lines(3, "first")))
    f = FileFollower(str(path))
    assert drain(f) == lines(3, "first")
    write(path, text(lines(2, "first late")))
    os.rename(path, tmp_path / "control.log.1")
    write(path, text(lines(2, "second")))
    os.rename(tmp_path / "control.log.1", tmp_path / "control.log.2")
    os.rename(path, tmp_path / "control.log.1")
    write(path, text(lines(2, "third")))
    os.utime(tmp_path / "control.log.2", ns=(1, 10**18))  # written before the next one
    os.utime(tmp_path / "control.log.1", ns=(1, 10**18 + 1))
    assert drain(f) == lines(2, "first late") + lines(2, "second") + lines(2, "third")
    assert f.rotations == 2


def test_lines_written_to_a_renamed_file_after_it_was_left_are_read(tmp_path):
    path = tmp_path / "control.log"
    write(path, "one\n")
    f = FileFollower(str(path))
    assert drain(f) == ["one"]
    with open(path, "a") as late_writer:  # keeps writing to the old file until it reopens
        os.rename(path, tmp_path / "control.log.1")
        write(path, "new\n")
        assert drain(f) == ["new"]
        late_writer.write("late\n")
    assert drain(f) == ["late"]


def open_files() -> List[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_close_also_closes_the_rotated_files_still_drained(tmp_path):
    path = tmp_path / "control.log"
    write(path, "one\n")
    f = FileFollower(str(path))
    assert drain(f) == ["one"]
    os.rename(path, tmp_path / "control.log.1")
    write(path, "new\n")
    assert drain(f) == ["new"]
    rotated = str(tmp_path / "control.log.1")
    assert rotated in open_files()  # read on for late lines
    f.close()
    assert rotated not in open_files() and str(path) not in open_files()


def test_many_renames_between_two_polls_are_caught_up_at_once(tmp_path):
    path = tmp_path / "control.log"
    write(path, "start\n")
    f = FileFollower(str(path))
    assert drain(f) == ["start"]
    base = os.stat(path).st_mtime_ns
    for i in range(1, 21):  # 20 rotations (logrotate's numbering) before the follower looks again
        for n in range(i - 1, 0, -1):
            os.rename(tmp_path / f"control.log.{n}", tmp_path / f"control.log.{n + 1}")
        os.rename(path, tmp_path / "control.log.1")
        write(path, "", mode="w")
        write(path, f"file {i}\n")
        os.utime(path, ns=(1, base + i * 1000))  # coarse clocks: make the order of writing plain
    first, _ = f.poll()
    assert len(first) >= 10 and f.more  # not one rotated file per poll (the follower fell behind)
    assert first + drain(f) == [f"file {i}" for i in range(1, 21)]


def test_a_rename_caught_between_logrotates_rename_and_create_loses_nothing(tmp_path, monkeypatch):
    """logrotate renames the log, then creates the new one: a follower that looks in
    between finds no file under the name. The file rotated meanwhile must still be read."""
    from mps_exporter.logs import follower as follower_module

    path = tmp_path / "control.log"
    write(path, "first\n")
    f = FileFollower(str(path))
    assert drain(f) == ["first"]
    os.rename(path, tmp_path / "control.log.1")
    write(path, "second\n")  # the writer reopened the new file and wrote to it
    real_open_regular = follower_module.open_regular

    def next_rotation_in_progress(name: str):  # the follower saw `second`'s file, then opens the name:
        if name == str(path) and not os.path.exists(tmp_path / "control.log.2"):
            os.rename(tmp_path / "control.log.1", tmp_path / "control.log.2")
            os.rename(path, tmp_path / "control.log.1")  # ... renamed already, not created yet
        return real_open_regular(name)

    monkeypatch.setattr(follower_module, "open_regular", next_rotation_in_progress)
    got = drain(f)
    write(path, "third\n")  # logrotate creates the file, the writer reopens it
    assert got + drain(f) == ["second", "third"]
    assert f.rotations == 2


def test_a_copy_that_ends_before_the_read_offset_was_read_already(tmp_path):
    """Lines written after logrotate's copy were read before its truncate (the reader is
    woken during rotations): the copy is shorter than the offset. Not lost, not twice."""
    path = tmp_path / "control.log"
    write(path, text(lines(10, "seen")))
    f = FileFollower(str(path))
    assert drain(f) == lines(10, "seen")
    write(path, text(lines(3, "copied")))
    shutil.copy(path, tmp_path / "control.log.1")  # logrotate's copy ...
    write(path, text(lines(2, "after the copy")))
    assert drain(f) == lines(3, "copied") + lines(2, "after the copy")  # ... read before its truncate
    truncate(path)
    write(path, text(lines(2, "new")))
    assert drain(f) == lines(2, "new")
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_a_shorter_copy_with_other_bytes_at_its_end_is_not_ours(tmp_path, caplog):
    path = tmp_path / "control.log"
    write(path, text(lines(10, "seen")))
    f = FileFollower(str(path))
    drain(f)
    forged = text(lines(10, "seen")[:1] + lines(3, "forged"))  # our first line, then others
    write(tmp_path / "control.log.1", forged)
    truncate(path)
    write(path, "new\n")
    assert drain(f) == ["new"]
    assert f.rotation_gaps == 1  # it cannot be told that nothing was lost


def test_a_truncate_racing_a_read_loses_nothing(tmp_path, monkeypatch):
    """logrotate copies and truncates between the follower's look at the file and its read."""
    from mps_exporter.logs import follower as follower_module

    path = tmp_path / "control.log"
    write(path, text(lines(10, "seen")))
    f = FileFollower(str(path))
    assert drain(f) == lines(10, "seen")
    write(path, text(lines(3, "unread")))
    real_pread = os.pread
    rotated = []

    def rotation_first(fd: int, n: int, offset: int) -> bytes:
        if not rotated and offset > 0:  # the read of what is new, not the look at the first bytes
            rotated.append(offset)
            copytruncate(path, "control.log.1")
            write(path, "new\n")  # shorter than the offset: the read finds nothing
        return real_pread(fd, n, offset)

    monkeypatch.setattr(follower_module.os, "pread", rotation_first)
    got = drain(f)
    monkeypatch.undo()
    assert rotated and got + drain(f) == lines(3, "unread") + ["new"]
    assert f.truncations == 1 and f.rotation_gaps == 0


# ------------------------------------------------- rotated before the first byte was read

def test_a_log_copied_and_truncated_before_its_first_read_is_read_from_the_copy(tmp_path):
    """The follower opened the log empty (offset 0, no head to compare): a copytruncate
    before it read a byte must still send it to the copy, not skip the copied lines."""
    path = tmp_path / "control.log"
    write(path, "")
    write(tmp_path / "control.log.2", text(lines(3, "an older rotation")))  # there before: not ours
    f = FileFollower(str(path))
    assert drain(f) == []
    write(path, text(lines(2, "copied")))
    copytruncate(path, "control.log.1")
    write(path, text(lines(1, "new")))
    assert drain(f) == lines(2, "copied") + lines(1, "new")
    write(path, "more\n")
    assert drain(f) == ["more"]
    assert f.truncations == 1 and f.rotation_gaps == 0


def test_after_a_copytruncate_an_empty_log_truncated_again_before_its_first_read(tmp_path):
    """The same blind spot after every copytruncate: the follower starts the emptied log
    again at offset 0; a second rotation before it read a byte must not be silent."""
    path = tmp_path / "control.log"
    write(path, text(lines(3, "first")))
    f = FileFollower(str(path))
    assert drain(f) == lines(3, "first")
    copytruncate(path, "control.log.1")
    assert drain(f) == []
    assert f.truncations == 1
    os.rename(tmp_path / "control.log.1", tmp_path / "control.log.2")  # logrotate shifts the first copy
    write(path, text(lines(2, "second")))
    copytruncate(path, "control.log.1")
    write(path, text(lines(1, "third")))
    assert drain(f) == lines(2, "second") + lines(1, "third")
    assert f.truncations == 2 and f.rotation_gaps == 0


def test_a_copy_that_is_not_truncated_is_not_read_twice(tmp_path):
    """logrotate `copy` without truncating (or a backup made by hand) while the follower
    had read nothing: the log still starts with the copy's bytes, so it is read once."""
    path = tmp_path / "control.log"
    write(path, "")
    f = FileFollower(str(path))
    assert drain(f) == []
    write(path, text(lines(2, "kept")))
    shutil.copy(path, tmp_path / "control.log.1")
    assert drain(f) == lines(2, "kept")
    assert f.truncations == 0 and f.rotation_gaps == 0


def test_a_log_seen_longer_then_shorter_before_its_first_read_counts_a_gap(tmp_path, monkeypatch):
    """The follower saw the log hold bytes but read none (the read failed), then it was
    truncated with no copy: the unread bytes are lost, and counted."""
    from mps_exporter.logs import follower as follower_module

    path = tmp_path / "control.log"
    write(path, "")
    f = FileFollower(str(path))
    assert drain(f) == []
    write(path, text(lines(2, "unread")))
    real_pread = os.pread

    def failing(fd: int, n: int, offset: int) -> bytes:
        if n > follower_module.HEAD_BYTES:  # the read of the lines, not the look at the head
            raise OSError(5, "Input/output error")
        return real_pread(fd, n, offset)

    monkeypatch.setattr(follower_module.os, "pread", failing)
    assert f.poll() == ([], 0) and f.error is not None
    monkeypatch.undo()
    truncate(path)  # no copy beside it
    write(path, "new\n")
    assert drain(f) == ["new"]
    assert f.truncations == 1 and f.rotation_gaps == 1


# ------------------------------------------------------------ poll_text
@pytest.mark.parametrize("cap", [2048, 4096, 4097, 10_000])
def test_poll_text_holds_the_lines_poll_gives(tmp_path, cap):
    """poll_text: poll()'s lines and cut count, as one text; lines at the cap, one past it and
    far past it (in the middle of a read, where a read's lines are handed over whole)."""
    import random

    rng = random.Random(cap)
    body: List[str] = []
    for i in range(3000):
        r = rng.random()
        length = (cap - 1, cap, cap + 1, cap + 2, 3 * cap, 2 * cap + 1)[i % 6] if r < 0.03 else rng.randint(0, 120)
        body.append(("é" if r < 0.5 else "x") * length)
    written = text(body)
    want, got = FileFollower(str(tmp_path / "a.log"), cap), FileFollower(str(tmp_path / "a.log"), cap)
    out, texts = [], []
    for part in (written[: len(written) // 3], written[len(written) // 3: len(written) // 2], written[len(written) // 2:]):
        write(tmp_path / "a.log", part)  # reads end where the writes did: partial lines between them
        while True:
            lines, cut = want.poll()
            whole, cut_too = got.poll_text()
            n = whole.count("\n")
            if not lines and not whole:
                break
            out.append((lines, cut))
            texts.append((whole, n, cut_too))
    flat = [line for lines, _ in out for line in lines]
    joined = "".join(t for t, _, _ in texts)
    assert joined == "".join(line + "\n" for line in flat)
    assert sum(n for _, n, _ in texts) == len(flat) == len(body)
    assert sum(c for _, _, c in texts) == sum(c for _, c in out) > 0
    assert len(texts) >= 3


def test_a_read_within_the_cap_is_found_so_without_splitting():
    from mps_exporter.logs.follower import _within_cap

    rng = __import__("random").Random(7)
    for _ in range(400):
        cap = rng.choice((2046, 2047, 2048, 3000))
        lengths = (0, 5, cap // 2 - 2, cap - 1, cap, cap + 1, 2 * cap) if rng.random() < 0.5 else (0, 5, 90, cap // 2 - 2)
        lines = ["x" * rng.choice(lengths) for _ in range(rng.randint(1, 30))]
        body = "\n".join(lines)
        if max(map(len, lines)) > cap:  # never missed: such a text is split and cut
            assert not _within_cap(body, cap)
        elif max(map(len, lines)) < cap // 2:  # lines shorter than a block: never split for nothing
            assert _within_cap(body, cap)
    assert _within_cap("x" * 100 + ("\n" + "y" * 1000) * 50, 2048)
    assert not _within_cap("x" * 100 + "\n" + "y" * 2049, 2048)
    assert not _within_cap("short\nlines", 100)  # a cap too small to look at in blocks
