"""Hostile MPS log lines and a harness around a real `mps-exporter serve`, shared by
bench/hostile_bench.py and bench/soak.py.

Lines are the recorded session's (tests/data/captures/h200-driver580-a), shifted
to new PIDs per round so the state machine keeps working, then mutated the ways a
broken or malicious writer would: characters replaced, inserted and deleted,
invalid UTF-8 and NUL bytes, numbers past int()'s 4300-digit limit, random exit
statuses, dates in the year 9999, lines of 100 KiB and 1 MiB. A generated line
never holds a newline: every line written ends with exactly one, so "lines
counted" must equal "lines written".
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "data" / "captures" / "h200-driver580-a"
FILES = ("control", "server")
_NUMBER = re.compile(rb"(?<![\w.])(\d{3,5})(?![\w.])")
_LONG_BRANCH = 0.3 * 0.01 / 0.72  # share of lines that reach the long-line branch of _mutate


def real_lines() -> Dict[str, List[bytes]]:
    return {f: (CAPTURE / f"{f}.log").read_bytes().splitlines() for f in FILES}


def _shift(line: bytes, delta: int) -> bytes:
    """The same line for another run: header PID and standalone numbers moved by delta
    (not the timestamp's)."""
    close = line.find(b"]")
    head, msg = line[:close], line[close:]
    role, _, pid = head.rpartition(b" ")
    if not pid.isdigit():
        return line
    return role + b" " + str(int(pid) + delta).encode() + _NUMBER.sub(lambda m: str(int(m.group(1)) + delta).encode(), msg)


def _mutate(line: bytes, rng: random.Random, long_share: float = _LONG_BRANCH) -> bytes:
    """70 % of lines stay real (the state machine gets real work), the rest is broken
    one of the ways a writer can break a line (never adding a newline)."""
    if rng.random() < 0.7:
        return line
    op = rng.random() * 0.72
    if op < 0.30:  # a few characters replaced, inserted or deleted
        b = bytearray(line)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(b) + 1)
            k = rng.random()
            if k < 0.4 and i < len(b):
                b[i] = rng.randrange(256)
            elif k < 0.7:
                b[i:i] = bytes([rng.randrange(256)])
            elif i < len(b):
                del b[i]
        return bytes(b).replace(b"\n", b" ")
    if op < 0.40:  # a digit run replaced by a long number (some past 4300 digits)
        return _NUMBER.sub(lambda m: b"9" * rng.choice((11, 30, 5000)), line, count=1)
    if op < 0.50:  # invalid UTF-8 and NULs
        return line[: len(line) // 2] + rng.choice((b"\xff\xfe", b"\x00\x00", b"\xc3", b"\xed\xa0\x80")) + line[len(line) // 2:]
    if op < 0.60:  # a random exit status (labels must stay bounded)
        return b"[2026-11-21 04:22:16.630 Control   546] Server %d exited with status %d" % (
            rng.randrange(1, 99999), rng.randrange(-(2 ** 31), 2 ** 31))
    if op < 0.65:  # dated 9999, or 1970: waits must not be summed
        return b"[" + rng.choice((b"9999-12-31", b"1970-01-01")) + line[11:]
    if op < 0.70:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200))).replace(b"\n", b"")
    if op < 0.71:  # a long line (over the 64 KiB cap) for a share of them, else an empty one
        if rng.random() < long_share / _LONG_BRANCH:
            return line + b"x" * rng.choice((100_000, 1 << 20 if rng.random() < 0.05 else 70_000))
    return b""


def hostile_lines(seed: int = 1, long_share: float = _LONG_BRANCH) -> Iterator[Tuple[str, bytes]]:
    """(file, line) forever: the session's lines, new PIDs per round, mutated;
    about long_share of all lines are over the 64 KiB cap."""
    rng = random.Random(seed)
    lines = real_lines()
    rounds = 0
    while True:
        delta = (rounds % 5000) * 10000
        for file in FILES:
            for line in lines[file]:
                yield file, _mutate(_shift(line, delta), rng, long_share)
        rounds += 1


class Writer:
    """Appends lines to control.log and server.log; counts the newlines written."""

    def __init__(self, directory: Path, seed: int = 1, long_share: float = _LONG_BRANCH) -> None:
        self.directory = directory
        self.lines = hostile_lines(seed, long_share)
        self.written = {f: 0 for f in FILES}
        self.bytes = 0

    def write(self, n: int) -> None:
        out: Dict[str, List[bytes]] = {f: [] for f in FILES}
        for _ in range(n):
            file, line = next(self.lines)
            out[file].append(line)
        for file, rows in out.items():
            if not rows:
                continue
            data = b"\n".join(rows) + b"\n"
            with open(self.directory / f"{file}.log", "ab") as fh:
                fh.write(data)
            self.written[file] += len(rows)
            self.bytes += len(data)

    def write_special(self, file: str, line: bytes) -> None:
        with open(self.directory / f"{file}.log", "ab") as fh:
            fh.write(line + b"\n")
        self.written[file] += 1
        self.bytes += len(line) + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Exporter:
    """`mps-exporter serve` with only the logs collector, on a free port."""

    def __init__(self, log_directory: Path, stderr_path: Path, extra: Optional[List[str]] = None) -> None:
        self.port = free_port()
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        cmd = [sys.executable, "-m", "mps_exporter.cli", "--web.listen-address", f"127.0.0.1:{self.port}",
               "--mps.log-directory", str(log_directory), "--mps.log-timezone", "UTC",
               "--no-collector.nvml", "--no-collector.dcgm", "--no-collector.control", "--no-collector.proc"]
        self.proc = subprocess.Popen(cmd + (extra or []), stdout=self._stderr, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.scrape()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"exporter did not start: {stderr_path.read_text()}") from None
                time.sleep(0.2)

    def scrape(self, timeout: float = 10) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout) as r:
            return str(r.read().decode())

    def proc_status(self) -> Dict[str, int]:
        """VmRSS, VmHWM (peak RSS) in KiB, Threads, and open fds."""
        out: Dict[str, int] = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for row in f:
                key, _, value = row.partition(":")
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = int(value.split()[0])
        out["fds"] = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return out

    def stop(self) -> int:
        self.proc.terminate()
        try:
            rc = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._stderr.close()
        return rc


def samples(text: str) -> Dict[str, float]:
    """'name{labels}' -> value for every sample of an exposition."""
    out: Dict[str, float] = {}
    for row in text.splitlines():
        if row and not row.startswith("#"):
            key, _, value = row.rpartition(" ")
            out[key] = float(value)
    return out


def lines_counted(s: Dict[str, float], file: str) -> int:
    return int(sum(v for k, v in s.items() if k.startswith("mps_log_lines_total{") and f'file="{file}"' in k))


def counters_went_down(before: Dict[str, float], after: Dict[str, float]) -> List[str]:
    return [k for k, v in before.items()
            if (k.split("{")[0].endswith(("_total", "_count", "_sum", "_bucket"))) and after.get(k, v) < v]


def percentile(values: List[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else float("nan")
