"""Log rotation under load: is every line read once, none lost, none twice?

A writer process appends numbered control.log lines at a steady rate through one
descriptor that it keeps (O_APPEND, as MPS never reopens its logs), while the real
`logrotate`, run from the same process, rotates the file every PERIOD seconds. This
process runs the exporter's own LogPipeline on the directory (its thread, its inotify
wake-ups, its POLL_SECONDS fallback), its control.log follower recording each line it
hands to the pipeline: what the exporter counts. At the end it prints, per mode: lines
written, read, read twice, and the lines lost, split in two: lost by the follower (in
some file at the end, never read) and lost by the rotation itself (in no file and never
read: written after logrotate's copy, with its fsync, and truncated before anyone read
them); then the lines read that no file holds any more (saved by reading on each
write), the rotations the follower could not recover from (`rotation_gaps`), the
reader thread's CPU, and how long after its write a line reached the pipeline (a line
written closer than that to copytruncate's truncate is lost): over all lines, over the
lines written while logrotate ran (the first rotation left out: it finds the reader
polling, no rotation seen yet), and over the lines saved (read, in no file now: written
in copytruncate's last window). Rotated files are kept (rotate 10000) so that the files
say what was there to read. `--scrape-probe` adds a thread that renders the log metrics
every 5 ms and reports how late it came back during rotations (what a reader holding
the GIL or a CPU would cost a scrape).

Modes: `copytruncate` uses the shipped deploy/systemd/nvidia-mps.logrotate (paths
changed); `collapse` the shipped nvidia-mps-collapse.logrotate with its postrotate
script, mps-log-collapse (logrotate `copy`, then the copied blocks removed from the
log's front with fallocate --collapse-range; the log directory is in the system's
temporary directory, so that must be on ext4 or XFS: `truncate fallbacks` counts the
rotations where the script fell back to truncating); `rename` is create-style rotation (`create`, no compression), which tools
that reopen their logs use. In rename mode the writer reopens the name after each
rotation, as such a program does on its signal. `delete` is `rename` keeping 3 rotated
files (`rotate 3`): older ones are deleted, and ext4 gives their inode numbers to new
files. `none` rotates nothing: the reader's CPU at that rate alone.

Writers (`--writers`): `keep` as above; `reopen` reopens the log when logrotate's
postrotate sends it SIGHUP (as MPS would be made to); `split` reopens on SIGHUP too and
writes each line in two write() calls, the second half at the start of its next burst
(every 2 ms), so the file ends mid-line most of the time, as with stdio flushing a full
buffer; it finishes its line in the old file before it reopens (fclose flushes). `lost`
counts every line never read whole (in rename and collapse modes all of them are the
follower's), `cut` the lines handed out that are not a whole line as written (half a
line, or two halves run together). `--rate` and `--writers` take several values: each
mode runs with each in turn, one row each, the load average before it in the row.

    python3 bench/rotation_bench.py [--seconds 60] [--rate 500 5000] [--writers reopen split] \
        [--modes copytruncate:1 rename:0.1 delete:0.1 collapse:0.1 ...]

Numbers, not a pass/fail; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from exporter.logs.follower import FileFollower  # noqa: E402
from exporter.families import FamilyBuilder  # noqa: E402
from exporter.logs import wake  # noqa: E402
from exporter.logs.render import render_log_metrics  # noqa: E402
from exporter.logs.pipeline import POLL_SECONDS, LogPipeline  # noqa: E402
from report import load_average, print_rows  # noqa: E402

RENAME_CONFIG = """{path} {{
    size 1
    rotate {keep}
    missingok
    create
    nocompress{hup}
}}
"""
# A writer that reopens its log on SIGHUP is sent one by logrotate, after the rotation,
# as MPS would be made to (the writer puts its pid in place of WRITER_PID).
HUP = "\n    postrotate\n        kill -HUP WRITER_PID\n    endscript"
HUP_LINE = "        kill -HUP WRITER_PID\n"
DELETE_KEEP = 3  # `delete` mode: rename rotation that keeps 3 rotated files, deleting older ones
LINE = re.compile(r"NEW UI (\d+)$")
WHOLE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.000 Control  1419\] NEW UI \d+$")
WRITERS = ("keep", "reopen", "split")


def rotate_config(mode: str, log_dir: str, path: str, writer: str) -> str:
    """The logrotate configuration of a mode; a reopening writer is sent SIGHUP after each rotation."""
    hup = writer != "keep"
    if mode == "copytruncate":
        return shipped_config(log_dir)
    if mode == "collapse":
        config = shipped_config(log_dir, "nvidia-mps-collapse.logrotate")
        return config.replace("    endscript", HUP_LINE + "    endscript", 1) if hup else config
    return RENAME_CONFIG.format(path=path, keep=DELETE_KEEP if mode == "delete" else 10000, hup=HUP if hup else "")


def shipped_config(log_dir: str, name: str = "nvidia-mps.logrotate") -> str:
    with open(ROOT / "deploy" / "systemd" / name, encoding="utf-8") as f:
        config = f.read().replace("/var/log/nvidia-mps/", f"{log_dir}/")
    config = config.replace("/usr/local/libexec/mps-log-collapse", str(ROOT / "deploy" / "systemd" / "mps-log-collapse"))
    config = re.sub(r"\brotate \d+", "rotate 10000", config)
    if os.geteuid() != 0:
        config = re.sub(r"^\s*su .*$", "", config, flags=re.M)
    return config


def write_and_rotate(path: str, conf: str, mode: str, period: float, seconds: float, rate: int,
                     writer: str = "keep") -> None:
    """The writer process (MPS and logrotate stand-ins): prints {"written", "rotations",
    "at", "spans"}, `at` the time.monotonic_ns() of each line's write (one clock for both
    processes), `spans` when each logrotate run began and ended.

    Writers: `keep` keeps one O_APPEND descriptor (in rename and delete modes it reopens
    the name after each rotation, told by the rotating thread); `reopen` reopens the name
    when logrotate's postrotate sends it SIGHUP; `split` does the same and writes each
    line in two write() calls, the second half at the start of the next burst (a line cut
    by a stdio buffer's flush: the file ends mid-line most of the time), completing its
    line in the old file before it reopens (fclose flushes)."""
    logrotate = shutil.which("logrotate") or "/usr/sbin/logrotate"
    state = os.path.join(os.path.dirname(conf), "state")
    with open(conf, encoding="utf-8") as f:
        config = f.read().replace("WRITER_PID", str(os.getpid()))
    with open(conf, "w", encoding="utf-8") as f:
        f.write(config)
    stop = threading.Event()
    reopen = threading.Event()
    if writer != "keep":
        signal.signal(signal.SIGHUP, lambda *_: reopen.set())
    rotations = [0]
    fallbacks = [0]  # collapse mode: rotations where the script fell back to truncating

    spans: List[Tuple[int, int]] = []  # time.monotonic_ns() when each logrotate run began and ended

    def rotator() -> None:
        while not stop.wait(period):
            began = time.monotonic_ns()
            done = subprocess.run([logrotate, "--force", "--state", state, conf], capture_output=True, timeout=30)
            fallbacks[0] += b"collapse-range failed" in done.stderr
            spans.append((began, time.monotonic_ns()))
            rotations[0] += 1
            if writer == "keep" and mode in ("rename", "delete"):
                reopen.set()

    rotating = threading.Thread(target=rotator)
    if mode != "none":
        rotating.start()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start = time.monotonic()
    n = 0
    at: List[int] = []
    pending = b""  # the split writer's second half of its last line, not written yet
    while time.monotonic() - start < seconds:
        due = int((time.monotonic() - start) * rate)
        if pending:
            os.write(fd, pending)
            at.append(time.monotonic_ns())
            pending = b""
        while n < due:
            if reopen.is_set():  # the program reopens its log
                reopen.clear()
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            line = f"[{stamp}.000 Control  1419] NEW UI {n}\n".encode()
            n += 1
            if writer == "split":
                cut = len(line) // 2  # neither half looks like a whole line
                os.write(fd, line[:cut])
                if n < due:
                    os.write(fd, line[cut:])
                    at.append(time.monotonic_ns())
                else:
                    pending = line[cut:]
            else:
                os.write(fd, line)
                at.append(time.monotonic_ns())
        if pending and reopen.is_set():
            os.write(fd, pending)  # fclose flushes the line into the old file
            at.append(time.monotonic_ns())
            pending = b""
        time.sleep(0.002)
    if pending:
        os.write(fd, pending)
        at.append(time.monotonic_ns())
    stop.set()
    if rotating.is_alive():
        rotating.join()
    os.close(fd)
    print(json.dumps({"written": n, "rotations": rotations[0], "fallbacks": fallbacks[0], "at": at, "spans": spans}))


class RecordingFollower(FileFollower):
    """The pipeline's control.log follower, noting the number of each line it hands out."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.seen: List[int] = []
        self.read_at: List[int] = []  # time.monotonic_ns() when each line of `seen` was handed out
        self.cut: List[str] = []  # lines handed out that are not a whole line the writer wrote

    def poll_text(self) -> Tuple[str, int]:
        text, truncated = super().poll_text()  # what the pipeline reads: the batch, one text
        now = time.monotonic_ns()
        for line in text.split("\n")[:-1]:  # each line ends with a newline
            m = LINE.search(line) if WHOLE.match(line) else None
            if m:
                self.seen.append(int(m.group(1)))
                self.read_at.append(now)
            else:
                self.cut.append(line)
        return text, truncated


def run(mode: str, period: float, seconds: float, rate: int, scrape_probe: bool = False,
        writer: str = "keep") -> Dict[str, object]:
    if not (shutil.which("logrotate") or os.path.exists("/usr/sbin/logrotate")):
        sys.exit("logrotate is not installed: apt-get install logrotate")
    with tempfile.TemporaryDirectory(prefix="mps-rotation-") as tmp:
        log_dir = os.path.join(tmp, "log")
        os.mkdir(log_dir)
        path = os.path.join(log_dir, "control.log")
        open(path, "a").close()
        conf = os.path.join(tmp, "rotate.conf")
        with open(conf, "w", encoding="utf-8") as f:
            f.write(rotate_config(mode, log_dir, path, writer))
        load = load_average()
        pipe = LogPipeline("bench", log_dir)
        follower = RecordingFollower(path)
        pipe._followers["control"] = follower  # the bench's one intrusion: which lines came out
        pipe.start()
        thread = pipe._thread
        assert thread is not None and thread.ident is not None
        clock = time.pthread_getcpuclockid(thread.ident)
        probe = ScrapeProbe(pipe)
        if scrape_probe:
            probe.start()
        cpu0 = time.clock_gettime(clock)
        process = subprocess.run([sys.executable, __file__, "--write", path, conf, mode, str(period), str(seconds),
                                 str(rate), writer], capture_output=True, text=True, check=True)
        done = json.loads(process.stdout)
        time.sleep(4 * POLL_SECONDS)  # the last lines, read by the next look at the files
        cpu = time.clock_gettime(clock) - cpu0
        inotify = pipe._watch is not None and pipe._watch.watching
        probe.stop()
        pipe.stop()
        written = int(done["written"])
        counts = Counter(follower.seen)
        in_files = numbers_in_files(log_dir)
        twice = sum(c - 1 for c in counts.values() if c > 1)
        delays = sorted((t - done["at"][n]) / 1e6 for n, t in zip(follower.seen, follower.read_at))
        # The first rotation is left out: it finds the reader polling, as no rotation had been seen yet.
        spans = [tuple(span) for span in done["spans"][1:]]
        rotating = sorted((t - done["at"][n]) / 1e3 for n, t in zip(follower.seen, follower.read_at)
                          if _within(done["at"][n], spans))
        saved = sorted((t - done["at"][n]) / 1e3 for n, t in zip(follower.seen, follower.read_at) if n not in in_files)
        scrapes = sorted(late for at, late in probe.samples if _within(at, spans))
        row: Dict[str, object] = {
                "mode": mode, "writer": writer, "lines/s": rate, "rotate every, s": period, "load before": load,
                "rotations": done["rotations"], "lines written": written,
                "lines read": len(follower.seen), "lost": written - len(counts), "read twice": twice,
                "cut": len(follower.cut),
                "lost by the follower": len(in_files - set(counts)),
                "lost by the rotation (in no file)": len(set(range(written)) - in_files - set(counts)),
                "read, in no file now": len(set(counts) - in_files),
                "rotation gaps": follower.rotation_gaps,
                "truncate fallbacks": done.get("fallbacks", 0), "inotify": "yes" if inotify else "no",
                "reader CPU, ms/s": f"{1000 * cpu / (seconds + 4 * POLL_SECONDS):.1f}",
                "write to read, ms p50 / p99": f"{_quantile(delays, 0.5):.2f} / {_quantile(delays, 0.99):.2f}",
                "during rotations: lines, write to read us p50 / p99 / max": f"{len(rotating)}: {_quantile(rotating, 0.5):.0f}"
                f" / {_quantile(rotating, 0.99):.0f} / {rotating[-1] if rotating else float('nan'):.0f}",
                "read, in no file now: write to read us p50 / max":
                    f"{_quantile(saved, 0.5):.0f} / {saved[-1] if saved else float('nan'):.0f}"}
        if scrape_probe:
            row["during rotations: scrape probe late, ms p50 / p99 / max (n)"] = (
                f"{_quantile(scrapes, 0.5):.2f} / {_quantile(scrapes, 0.99):.2f} / "
                f"{scrapes[-1] if scrapes else float('nan'):.2f} ({len(scrapes)})")
        return row


class ScrapeProbe:
    """A scrape stand-in in the reader's process: every PERIOD it renders the log
    pipeline's metrics from its snapshot (what a scrape does with the logs) and stats the
    log directory. `samples`: (time.monotonic_ns() it was due, ms from then to the end of
    the render): a reader that holds the GIL too long shows here."""

    PERIOD = 0.005

    def __init__(self, pipe: LogPipeline) -> None:
        self.pipe = pipe
        self.samples: List[Tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            due = time.monotonic_ns() + int(self.PERIOD * 1e9)
            if self._stop.wait(self.PERIOD):
                return
            render_log_metrics(FamilyBuilder(), "bench", self.pipe.snapshot(), time.time())
            os.stat(self.pipe.log_directory)
            self.samples.append((due, (time.monotonic_ns() - due) / 1e6))


def _fs_type(path: str) -> str:
    done = subprocess.run(["stat", "-f", "-c", "%T, block %S", path], capture_output=True, text=True)
    return done.stdout.strip() or "file system unknown"


def _within(at: int, spans: List[Tuple[int, ...]]) -> bool:
    i = bisect.bisect_right(spans, (at, 1 << 62)) - 1
    return i >= 0 and spans[i][0] <= at <= spans[i][1]


def _quantile(values: List[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def numbers_in_files(log_dir: str) -> Set[int]:
    """Every line number found in the log directory's files, compressed ones included."""
    found: Set[int] = set()
    for name in os.listdir(log_dir):
        path = os.path.join(log_dir, name)
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:  # type: ignore[operator]
            for line in f:
                m = LINE.search(line.rstrip("\n"))
                if m:
                    found.add(int(m.group(1)))
    return found


def main() -> None:
    if sys.argv[1:2] == ["--write"]:  # the writer process
        path, conf, mode, period, seconds, rate, writer = sys.argv[2:9]
        write_and_rotate(path, conf, mode, float(period), float(seconds), int(rate), writer)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rate", type=int, nargs="+", default=[500], help="lines written per second (each in turn)")
    ap.add_argument("--writers", nargs="+", choices=WRITERS, default=["keep"],
                    help="keep: one descriptor (rename/delete: reopened after each rotation); reopen: reopens on "
                         "SIGHUP from logrotate's postrotate; split: reopens on SIGHUP, each line in two write() calls")
    ap.add_argument("--modes", nargs="+", default=["copytruncate:1", "copytruncate:0.1", "rename:1", "rename:0.1"],
                    help="MODE:PERIOD, MODE copytruncate, collapse, rename, delete (rename keeping "
                         f"{DELETE_KEEP} rotated files) or none, PERIOD seconds between rotations")
    ap.add_argument("--poll-only", action="store_true",
                    help="no inotify: the pipeline looks at the files every POLL_SECONDS only (as before issue 26)")
    ap.add_argument("--scrape-probe", action="store_true",
                    help="a thread renders the log metrics every 5 ms beside the reader (GIL and CPU contention)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # a gap's warning, once per rotation: the table counts them
    if args.poll_only:
        wake._libc = lambda: None  # what the pipeline does where inotify cannot be had
    print(f"load average before: {load_average()}; cores: {os.cpu_count()}; "
          f"{'/'.join(map(str, args.rate))} lines/s for {args.seconds:g} s; the log pipeline reads on each write (inotify), "
          f"else every {POLL_SECONDS} s{'; scrape probe every 5 ms' if args.scrape_probe else ''}; "
          f"log directory in {tempfile.gettempdir()} ({_fs_type(tempfile.gettempdir())})\n")
    rows = []
    for spec in args.modes:
        mode, _, period = spec.partition(":")
        for rate in args.rate:
            for writer in args.writers:
                rows.append(run(mode, float(period or 1), args.seconds, rate, args.scrape_probe, writer))
                print("done: " + json.dumps(rows[-1]), flush=True)  # a long matrix shows its progress
    print()
    print_rows(rows)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
