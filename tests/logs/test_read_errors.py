"""A log that cannot be read is loud: every file-system case, from the follower up to
the `mps-exporter` program (issue 16 point 1, issue 18 points 2 and 5).

Each case: the follower never blocks and never opens anything but a regular file,
the failure has a reason (`mps_log_read_errors_total{file, reason}`), the logs
collector fails with one warning naming the path, the other file is still read,
and everything recovers by itself when a readable file comes back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from prometheus_client.exposition import generate_latest

from mps_exporter.collector import MpsCollector, build_registry
from mps_exporter.families import FamilyBuilder
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.render import render_log_metrics
from mps_exporter.config import DaemonConfig
from mps_exporter.discovery import DaemonSet
from mps_exporter.sources.logs import DaemonPipelines, pipelines_reader
from mps_exporter.logs.follower import (
    MISSING_DIRECTORY, NOT_A_DIRECTORY, NOT_REGULAR_FILE, PERMISSION_DENIED, FileFollower,
)
from tests.support.prometheus import free_port, stop_process

EXE = [sys.executable, "-m", "mps_exporter.cli"]
# Root reads every file whatever its mode. To meet a permission error for real, root runs the
# exporter without the two capabilities that bypass file modes; it stays root, so it can still
# read the checkout and the venv wherever they are (a clone in a 0700 directory included).
WITHOUT_DAC_BYPASS = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                      "--bounding-set=-dac_override,-dac_read_search", "--"]
# No GPU, no control daemon here: only the logs collector is under test.
ONLY_LOGS = ["--no-collector.nvml", "--no-collector.dcgm", "--no-collector.control", "--no-collector.proc",
             "--mps.log-timezone", "UTC"]
LINE = "[2026-11-21 04:19:24.390 Control   546] NEW UI"
SERVER_LINE = "[2026-11-21 04:19:24.641 Server   713] Server has started"


def poll_in_thread(f: FileFollower, limit: float = 5.0) -> None:
    """poll() once; fails (instead of hanging the suite) if it blocks."""
    t = threading.Thread(target=f.poll, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "poll() blocked"


def read_errors(pipe: LogPipeline) -> dict:
    out = FamilyBuilder()
    render_log_metrics(out, "default", pipe.snapshot(), 0.0)
    return {(s.labels["file"], s.labels["reason"]): s.value
            for fam in out.families() if fam.name == "mps_log_read_errors" for s in fam.samples
            if s.name == "mps_log_read_errors_total"}


def logs_success(pipe: LogPipeline) -> float:
    """collector_success{collector="logs"} as a scrape shows it."""
    daemons = DaemonSet([DaemonConfig("default", "/nonexistent/pipe", pipe.log_directory)])
    reader = pipelines_reader(DaemonPipelines(daemons, lambda d: pipe))
    text = generate_latest(build_registry(MpsCollector({"logs": reader}))).decode()
    line = next(l for l in text.splitlines() if l.startswith('mps_exporter_collector_success{collector="logs"}'))
    return float(line.rsplit(" ", 1)[1])


# ------------------------------------------------------------ follower
@pytest.mark.parametrize("make", ["fifo", "directory", "device", "socket"])
def test_follower_never_opens_what_is_not_a_regular_file(tmp_path, make):
    path = tmp_path / "control.log"
    if make == "fifo":
        os.mkfifo(path)  # open() of a FIFO without a writer blocks
    elif make == "directory":
        path.mkdir()
    elif make == "device":
        os.symlink("/dev/zero", path)  # read() never ends
    else:
        import socket
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    f = FileFollower(str(path))
    poll_in_thread(f)
    assert f.error is not None and f.error.reason == NOT_REGULAR_FILE and str(path) in f.error.message
    assert f._fd is None
    poll_in_thread(f)
    assert f.errors == {NOT_REGULAR_FILE: 1}  # one failure, however many polls
    # a regular file put back is read from its beginning
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()
    path.write_text("back\n")
    assert f.poll()[0] == ["back"] and f.error is None


def test_regular_file_replaced_by_a_fifo_while_open(tmp_path):
    path = tmp_path / "control.log"
    path.write_text("a\nb\n")
    f = FileFollower(str(path))
    assert f.poll()[0] == ["a", "b"]
    with open(path, "a") as fh:
        fh.write("c\n")  # written before the swap: still read from the old file
    os.rename(path, tmp_path / "old")
    os.mkfifo(path)
    t0 = time.monotonic()
    lines, _ = f.poll()
    assert lines == ["c"] and time.monotonic() - t0 < 5
    assert f.error is not None and f.error.reason == NOT_REGULAR_FILE


def test_missing_directory_and_directory_that_is_a_file(tmp_path):
    f = FileFollower(str(tmp_path / "nonexistent" / "control.log"))
    f.poll()
    assert f.error is not None and f.error.reason == MISSING_DIRECTORY
    assert str(tmp_path / "nonexistent") in f.error.message
    (tmp_path / "nonexistent").mkdir()  # the device plugin creates it again: recovered
    f.poll()
    assert f.error is None and f.errors == {MISSING_DIRECTORY: 1}

    (tmp_path / "a-file").write_text("x")
    g = FileFollower(str(tmp_path / "a-file" / "control.log"))
    g.poll()
    assert g.error is not None and g.error.reason == NOT_A_DIRECTORY and "a-file" in g.error.message


def test_missing_file_in_an_existing_directory_is_not_an_error(tmp_path):
    f = FileFollower(str(tmp_path / "control.log"))
    f.poll()
    assert f.error is None and f.errors == {}


def test_permission_denied_simulated(tmp_path, monkeypatch):
    # The real thing, as another user, is test_dump_of_an_unreadable_directory below.
    path = tmp_path / "control.log"
    path.write_text("a\n")
    real_open = os.open

    def denied(p, flags, *args):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", denied)
    f = FileFollower(str(path))
    assert f.poll() == ([], 0)
    assert f.error is not None and f.error.reason == PERMISSION_DENIED and str(path) in f.error.message
    monkeypatch.setattr(os, "open", real_open)
    assert f.poll()[0] == ["a"] and f.error is None


def test_deleted_and_recreated_file(tmp_path):
    path = tmp_path / "control.log"
    path.write_text("one\n")
    f = FileFollower(str(path))
    assert f.poll()[0] == ["one"]
    path.unlink()
    assert f.poll() == ([], 0) and f.error is None  # the directory is there: MPS has not started again yet
    path.write_text("two\n")
    assert f.poll()[0] == ["two"]


def test_truncated_file_is_read_again(tmp_path):
    path = tmp_path / "control.log"
    path.write_text("one\ntwo\n")
    f = FileFollower(str(path))
    assert f.poll()[0] == ["one", "two"]
    path.write_text("three\n")
    assert f.poll()[0] == ["three"] and f.truncations == 1


def test_one_poll_reads_a_bounded_amount(tmp_path):
    # 40 MiB of NULs and no newline (a sparse file): no poll reads it all at once.
    path = tmp_path / "control.log"
    with open(path, "wb") as fh:
        fh.truncate(40 << 20)
    f = FileFollower(str(path))
    polls = 0
    while True:
        lines, _ = f.poll()
        polls += 1
        assert not lines
        if not f.more:
            break
    assert polls >= 3


# ------------------------------------------------------------ pipeline
def test_a_fifo_control_log_leaves_server_log_read_and_fails_the_collector(tmp_path):
    os.mkfifo(tmp_path / "control.log")
    (tmp_path / "server.log").write_text(SERVER_LINE + "\n")
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    pipe.start()
    try:
        deadline = time.monotonic() + 10
        while pipe.snapshot().lines["server"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = pipe.snapshot()
        assert snap.lines == {"control": 0, "server": 1}
        assert snap.problems == (f"{tmp_path / 'control.log'} is not a regular file",)
        assert read_errors(pipe)[("control", NOT_REGULAR_FILE)] == 1
        assert read_errors(pipe)[("server", NOT_REGULAR_FILE)] == 0
        assert logs_success(pipe) == 0
        # a regular file put back: read, and the collector is fine again
        (tmp_path / "control.log").unlink()
        (tmp_path / "control.log").write_text(LINE + "\n")
        while pipe.snapshot().lines["control"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pipe.snapshot().lines["control"] == 1 and pipe.snapshot().problems == ()
        assert logs_success(pipe) == 1
        assert read_errors(pipe)[("control", NOT_REGULAR_FILE)] == 1  # a counter: it stays
    finally:
        t0 = time.monotonic()
        pipe.stop()
        assert time.monotonic() - t0 < 5


def test_missing_directory_fails_until_it_appears(tmp_path):
    directory = tmp_path / "mps-log"
    pipe = LogPipeline("default", str(directory), timezone="UTC")
    snap = pipe.read_once()
    assert snap.problems == (f"log directory {directory} does not exist",)  # one message for both files
    assert logs_success(pipe) == 0
    directory.mkdir()
    (directory / "control.log").write_text(LINE + "\n")
    snap = pipe.read_once()
    assert snap.problems == () and snap.lines["control"] == 1 and logs_success(pipe) == 1


def test_a_line_whose_handling_raises_costs_only_that_line(tmp_path):
    from mps_exporter.logs.events import Command

    (tmp_path / "control.log").write_text("\n".join([
        # a command the parser takes (logs/echoes.py counts most others without it)
        LINE, "[2026-11-21 04:19:24.391 Control   546] Cmd:set_active_thread_percentage 654 50", LINE]) + "\n")

    def broken(ev: object) -> None:
        raise RuntimeError("a bug in a handler")

    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    pipe._state._handlers[Command] = broken
    snap = pipe.read_once()
    assert snap.lines["control"] == 3  # the line after the broken one is read and counted too
    assert read_errors(pipe)[("control", "internal_error")] == 1


# ------------------------------------------------------------ the program
def dump(directory: str, user: bool = False) -> subprocess.CompletedProcess:
    cmd = EXE + ["dump", "--mps.log-directory", directory] + ONLY_LOGS
    if user and os.geteuid() == 0:
        cmd = WITHOUT_DAC_BYPASS + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")


def assert_failed_once(res: subprocess.CompletedProcess, path: str) -> None:
    assert res.returncode == 0, res.stderr
    assert 'mps_exporter_collector_success{collector="logs"} 0.0' in res.stdout
    warnings = [l for l in res.stderr.splitlines() if "level=warn" in l]
    assert len(warnings) == 1 and path in warnings[0], res.stderr
    assert "Traceback" not in res.stderr


def test_dump_of_a_missing_directory():
    res = dump("/nonexistent")
    assert_failed_once(res, "/nonexistent")
    assert "does not exist" in res.stderr
    assert 'mps_log_read_errors_total{daemon="default",file="control",reason="missing_directory"} 1.0' in res.stdout


def test_dump_of_a_file_as_directory(tmp_path):
    (tmp_path / "file").write_text("not a directory\n")
    res = dump(str(tmp_path / "file"))
    assert_failed_once(res, str(tmp_path / "file"))
    assert "is not a directory" in res.stderr


@pytest.fixture
def work_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, with every mode put back afterwards so that it can be removed."""
    yield tmp_path
    for p in [tmp_path] + list(tmp_path.rglob("*")):
        if not p.is_symlink():
            p.chmod(0o755)


def test_dump_of_an_unreadable_directory(work_dir):
    logs = work_dir / "mps-log"
    logs.mkdir()
    (logs / "control.log").write_text(LINE + "\n")
    logs.chmod(0o000)
    res = dump(str(logs), user=True)
    assert_failed_once(res, str(logs))
    assert f"log directory {logs}: permission denied" in res.stderr and "control.log" not in res.stderr
    assert 'reason="permission_denied"} 1.0' in res.stdout


def test_dump_of_an_unreadable_file_reads_the_other(work_dir):
    logs = work_dir / "mps-log"
    logs.mkdir()
    (logs / "control.log").write_text(LINE + "\n")
    (logs / "server.log").write_text(SERVER_LINE + "\n")
    (logs / "control.log").chmod(0o000)
    res = dump(str(logs), user=True)
    assert_failed_once(res, str(logs / "control.log"))
    assert 'mps_log_lines_total{daemon="default",file="server"} 1.0' in res.stdout
    assert 'mps_log_read_errors_total{daemon="default",file="control",reason="permission_denied"} 1.0' in res.stdout


def test_dump_of_a_readable_directory_is_quiet(work_dir):
    (work_dir / "control.log").write_text(LINE + "\n")
    res = dump(str(work_dir), user=True)
    assert 'mps_exporter_collector_success{collector="logs"} 1.0' in res.stdout
    assert "level=warn" not in res.stderr, res.stderr


def wait_for_metrics(port: int, proc: subprocess.Popen, want: str, limit: float = 30) -> str:
    import urllib.request

    deadline = time.monotonic() + limit
    body = ""
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the exporter exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            if want in body:
                return body
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{want!r} not in the exposition within {limit} s:\n{body}")


@pytest.mark.parametrize("make", ["fifo", "device", "directory", "unreadable"])
@pytest.mark.slow
def test_serve_with_a_bad_control_log_reads_server_log_and_ends_on_sigterm(work_dir, make):
    logs = work_dir / "mps-log"
    logs.mkdir()
    as_other_user: list = []
    if make == "fifo":
        os.mkfifo(logs / "control.log")
    elif make == "device":
        os.symlink("/dev/zero", logs / "control.log")
    elif make == "directory":
        (logs / "control.log").mkdir()
    else:
        (logs / "control.log").write_text(LINE + "\n")
        (logs / "control.log").chmod(0o000)
        if os.geteuid() == 0:
            as_other_user = WITHOUT_DAC_BYPASS
    (logs / "server.log").write_text(SERVER_LINE + "\n")
    (logs / "server.log").chmod(0o666)
    reason = "permission_denied" if make == "unreadable" else "not_regular_file"
    port = free_port()
    proc = subprocess.Popen(as_other_user + EXE + ["--web.listen-address", f"127.0.0.1:{port}",
                                                   "--mps.log-directory", str(logs)] + ONLY_LOGS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
    try:
        body = wait_for_metrics(port, proc, 'mps_log_lines_total{daemon="default",file="server"} 1.0')
        assert 'mps_exporter_collector_success{collector="logs"} 0.0' in body
        assert f'file="control",reason="{reason}"}} 1.0' in body
        with open(logs / "server.log", "a") as f:  # still followed
            f.write(SERVER_LINE + "\n")
        wait_for_metrics(port, proc, 'mps_log_lines_total{daemon="default",file="server"} 2.0')
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        took = time.monotonic() - t0
    finally:
        stop_process(proc)
    out = proc.stdout.read() if proc.stdout else ""
    assert took < 5, f"SIGTERM took {took:.1f} s"
    assert proc.returncode == 0, out
    assert out.count("level=warn") == 1 and str(logs / "control.log") in out, out


# ------------------------------------------------------------ symbolic links (issue 42 point 7)
SECRET = "root:$6$not-for-the-metrics:19000:0:99999:7:::\n" * 5


def test_a_symbolic_link_under_the_name_is_refused_not_followed(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    path = tmp_path / "control.log"
    os.symlink(secret, path)
    f = FileFollower(str(path))
    for _ in range(3):
        assert f.poll() == ([], 0)
    assert f.error is not None and f.error.reason == NOT_REGULAR_FILE
    assert f.error.message == f"{path} is a symbolic link: not followed (log files are read as root)"
    assert f.errors == {NOT_REGULAR_FILE: 1} and f._fd is None
    assert f.unread_bytes() == 0  # not even the target's size as a backlog
    path.unlink()
    path.write_text(LINE + "\n")  # a regular file again: read, the error gone
    assert f.poll()[0] == [LINE] and f.error is None


def test_a_log_replaced_by_a_symbolic_link_is_read_to_its_end_and_no_further(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    path = tmp_path / "control.log"
    path.write_text("a\n")
    f = FileFollower(str(path))
    assert f.poll()[0] == ["a"]
    with open(path, "a") as fh:
        fh.write("b\n")
    os.rename(path, tmp_path / "control.log.1")
    os.symlink(secret, path)
    assert f.poll()[0] == ["b"]  # the old file to its end, then nothing of the target
    assert f.poll()[0] == [] and f.error is not None and "symbolic link" in f.error.message


def test_a_symbolic_link_among_the_rotated_files_is_not_read(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    path = tmp_path / "control.log"
    path.write_text("a\n")
    f = FileFollower(str(path))
    assert f.poll()[0] == ["a"]
    os.rename(path, tmp_path / "control.log.2")
    os.symlink(secret, tmp_path / "control.log.1")  # "a rotated file written after it"
    path.write_text("c\n")
    lines = []
    for _ in range(3):
        lines += f.poll()[0]
    assert lines == ["c"]


def test_a_name_that_becomes_a_symbolic_link_after_the_look_is_not_opened(tmp_path, monkeypatch):
    # lstat saw a regular file; by the open() it is a link: O_NOFOLLOW refuses it (ELOOP).
    from mps_exporter.logs import follower

    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    path = tmp_path / "control.log"
    regular = os.lstat(secret)
    os.symlink(secret, path)
    real_lstat = os.lstat
    monkeypatch.setattr(follower.os, "lstat", lambda p: regular if str(p) == str(path) else real_lstat(p))
    with pytest.raises(follower.NotRegularFile, match="symbolic link"):
        follower.open_regular(str(path))


def test_a_symbolic_link_control_log_is_a_read_error_and_publishes_no_line_count(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    os.symlink(secret, tmp_path / "control.log")
    (tmp_path / "server.log").write_text(SERVER_LINE + "\n")
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    snap = pipe.read_once()
    assert snap.lines == {"control": 0, "server": 1}
    assert snap.problems == (f"{tmp_path / 'control.log'} is a symbolic link: not followed "
                             "(log files are read as root)",)
    assert read_errors(pipe)[("control", NOT_REGULAR_FILE)] == 1
    assert logs_success(pipe) == 0
    assert pipe.unread_bytes() == 0


def test_capture_taps_do_not_follow_a_symbolic_link_either(tmp_path):
    from mps_exporter.capture import LogTap

    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    os.symlink(secret, tmp_path / "control.log")
    tap = LogTap(str(tmp_path / "control.log"))
    assert tap.poll() == []
    assert tap.error is not None and tap.error.reason == NOT_REGULAR_FILE and "symbolic link" in tap.error.message
