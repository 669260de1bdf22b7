"""copytruncate's last window: while logrotate copies a log, the reader looks at it in a
tight loop (FileFollower.look, LogPipeline._spin), so that a line written after the copy
ended and before the truncate is in hand before the truncate takes it (issue 26).

No timings here: whether it is fast enough is bench/rotation_bench.py's question."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import List

from mps_exporter.logs import pipeline as pipeline_module
from mps_exporter.logs import wake
from mps_exporter.logs.follower import FileFollower
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.wake import DirectoryWatch


def row(n: int, tag: str = "line") -> str:
    return f"[2026-11-27 04:19:{n % 60:02d}.{n % 1000:03d} Control   546] {tag} {n}\n"


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


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


# ------------------------------------------------------------------ FileFollower.look

def test_a_line_looked_at_before_the_truncate_is_handed_out_once(tmp_path):
    log = tmp_path / "control.log"
    append(log, row(1) + row(2))
    f = FileFollower(str(log))
    assert drain(f) == [row(1).strip(), row(2).strip()]
    shutil.copy(log, tmp_path / "control.log.1")  # logrotate's copy ends here ...
    assert f.look() is False  # nothing new: no bytes kept, nothing for poll() to do
    append(log, row(3))  # ... MPS writes during the copy's fsync ...
    assert f.look() is True  # ... and the line is in hand before ...
    truncate(log)  # ... the truncate, after which no file holds it
    append(log, row(4, "after"))
    assert drain(f) == [row(3).strip(), row(4, "after").strip()]  # in order, once each
    assert f.truncations == 1 and f.rotation_gaps == 0
    append(log, row(5, "after"))
    assert drain(f) == [row(5, "after").strip()]  # nothing read twice later either


def test_without_the_look_that_line_is_in_no_file(tmp_path):
    """The same rotation with no look: the line is lost. (What the test above guards.)"""
    log = tmp_path / "control.log"
    append(log, row(1))
    f = FileFollower(str(log))
    drain(f)
    shutil.copy(log, tmp_path / "control.log.1")
    append(log, row(3))
    truncate(log)
    append(log, row(4, "after"))
    assert drain(f) == [row(4, "after").strip()]


def test_look_sees_the_truncate_and_keeps_the_saved_position_before_unhanded_bytes(tmp_path):
    log = tmp_path / "control.log"
    append(log, row(1))
    f = FileFollower(str(log))
    drain(f)
    saved = f.position()
    append(log, row(2) + "partial")
    assert f.look() is True
    assert f.position() == saved  # bytes in hand are not handed out: a restart reads them again
    assert f.look() is True  # poll() has work: it is not read again
    assert f.poll()[0] == [row(2).strip()]
    truncate(log)
    assert f.look() is True  # shorter than the read offset: poll() has work
    assert f.poll()[0] == []
    assert f.truncations == 1
    assert FileFollower(str(tmp_path / "nothing.log")).look() is False  # no file open


# ---------------------------------------------------------------- DirectoryWatch.copying

def test_a_created_copy_is_under_way_until_its_truncate_is_seen(tmp_path):
    log = tmp_path / "control.log"
    append(log, row(1))
    append(tmp_path / "control.log.3", "x\n")  # rotated before the watch began
    watch = DirectoryWatch(str(tmp_path), ["control.log", "server.log"])
    try:
        watch.wait(0)
        (tmp_path / "control.log.2.gz").write_bytes(b"\x1f\x8b")  # compressing an older copy: no copy
        append(tmp_path / "control.log.3", "x\n")  # a program writing to its renamed log: no copy
        append(log, row(2))
        (tmp_path / "control.log").touch()
        watch.wait(0)
        assert watch.copying() == []
        shutil.copy(log, tmp_path / "control.log.1")
        watch.wait(0)
        assert watch.copying() == ["control.log"]
        watch.copied("control.log")
        assert watch.copying() == []
        append(tmp_path / "control.log.1", "x\n")  # the same copy written after its truncate: no new copy
        watch.wait(0)
        assert watch.copying() == []
    finally:
        watch.close()


def test_a_copy_under_way_ends_by_itself_after_copy_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(wake, "COPY_SECONDS", 0.0)  # `copy` without truncate: no end is ever seen
    watch = DirectoryWatch(str(tmp_path), ["control.log"])
    try:
        watch.wait(0)
        (tmp_path / "control.log.1").write_text("")
        watch.wait(0)
        assert watch.copying() == []
    finally:
        watch.close()


# ------------------------------------------------------------------- LogPipeline._spin

def test_the_spin_reads_a_write_made_between_the_copy_and_a_truncate_by_another_thread(tmp_path):
    log = tmp_path / "control.log"
    append(log, row(1))
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    watch = DirectoryWatch(str(tmp_path), ["control.log", "server.log"])
    follower = pipe._followers["control"]
    try:
        pipe.read_once()
        watch.wait(0)
        shutil.copy(log, tmp_path / "control.log.1")  # the copy begins: the watch sees it created
        watch.wait(0)
        in_hand = threading.Event()

        def logrotate_and_mps() -> None:
            append(log, row(2))  # after the copy, before the truncate
            in_hand.wait(30)  # the truncate comes once the spin has the line (or gave up)
            truncate(log)
            append(log, row(3, "after"))

        other = threading.Thread(target=logrotate_and_mps)
        other.start()
        while not follower._early:  # slices of SPIN_SLICE_SECONDS until the write is seen
            assert pipe._spin(watch) is True  # the copy stays under way meanwhile
        in_hand.set()
        other.join()
        pipe.read_once()
        assert pipe.snapshot().lines["control"] == 3  # 1, then 2 from the spin, then 3: none twice
        assert follower.truncations == 1 and follower.rotation_gaps == 0
    finally:
        watch.close()
        pipe.stop()


def test_the_spin_ends_by_itself_and_at_once_on_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_module, "SPIN_SLICE_SECONDS", 0.001)
    monkeypatch.setattr(wake, "COPY_SECONDS", 0.05)
    log = tmp_path / "control.log"
    append(log, row(1))
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    watch = DirectoryWatch(str(tmp_path), ["control.log", "server.log"])
    try:
        pipe.read_once()
        watch.wait(0)
        (tmp_path / "control.log.1").write_text("")  # a copy whose truncate never comes
        watch.wait(0)
        slices = 0
        while pipe._spin(watch):  # nothing comes, nothing is truncated: the cap ends it
            slices += 1
            assert slices < 100_000
        assert slices >= 1 and watch.copying() == []
        assert pipe._spin(watch) is False  # and a plain wait follows
        (tmp_path / "control.log.2").write_text("")
        watch.wait(0)
        pipe._stop.set()
        assert pipe._spin(watch) is True  # one look, then out: stop() is not held up
        assert watch.copying() == ["control.log"]
    finally:
        watch.close()
        pipe.stop()
