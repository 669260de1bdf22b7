"""Oracles of the truth check: what nvidia-smi, the control daemon and the MPS
logs say, parsed by code that shares nothing with the exporter.

Pure functions (text -> data), so they are tested on the recorded capture
without a GPU (tests/gpu/test_oracles.py). The driver (truth_check.py) runs the
tools and feeds their output here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, List, Optional, Tuple

MIB = 2**20


# ------------------------------------------------------------- nvidia-smi
@dataclass
class SmiGpu:
    index: int
    uuid: str
    memory_total_mib: int
    memory_used_mib: int


def parse_smi_gpus(csv_text: str) -> List[SmiGpu]:
    """`nvidia-smi --query-gpu=index,uuid,memory.total,memory.used --format=csv,noheader,nounits`"""
    gpus = []
    for line in csv_text.strip().splitlines():
        index, uuid, total, used = [c.strip() for c in line.split(",")]
        gpus.append(SmiGpu(int(index), uuid, int(total), int(used)))
    return gpus


def parse_smi_apps(csv_text: str) -> Dict[Tuple[str, int], int]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits`
    -> {(gpu uuid, pid): MiB}. Rows whose memory nvidia-smi cannot tell ("[N/A]") are left out."""
    apps = {}
    for line in csv_text.strip().splitlines():
        if not line.strip() or "No running" in line:
            continue
        uuid, pid, used = [c.strip() for c in line.split(",")]
        if used.isdigit():
            apps[(uuid, int(pid))] = int(used)
    return apps


# ------------------------------------------------------------ control daemon
def parse_pids(text: str) -> List[int]:
    """`get_server_list` / `get_client_list`."""
    return [int(line) for line in text.split() if line.isdigit()]


def parse_size_text(text: str) -> Optional[int]:
    """`get_*pinned_mem_limit` replies: "2G", "512M", "0x80000000", "" (none set)."""
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", text, re.IGNORECASE)
    if m:
        scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
        return int(float(m.group(1)) * scale)
    if re.fullmatch(r"0x[0-9a-fA-F]+", text):
        return int(text, 16)
    return None


def env_pinned_limit(value: str, device: int) -> Optional[int]:
    """A client's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=3G,1=1G") for one device ordinal."""
    for item in value.split(","):
        dev, _, size = item.partition("=")
        if dev.strip() == str(device):
            return parse_size_text(size)
    return None


# ------------------------------------------------------------------ MPS logs
_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) +(\w+) +(-?\d+)\] (.*)$")


@dataclass
class LogLine:
    time: datetime  # naive: the log's own clock
    source: str  # Control / Server
    pid: int
    text: str


def parse_log(text: str) -> List[LogLine]:
    lines = []
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if m:
            lines.append(LogLine(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f"), m.group(2), int(m.group(3)),
                                 m.group(4)))
    return lines


@dataclass
class QueueWait:
    client_pid: int
    user: int
    pushed: datetime
    admitted: Optional[datetime]  # None: still pending at the end of the log
    user_switch: bool  # a server of another user was running when it was pushed

    @property
    def seconds(self) -> Optional[float]:
        return None if self.admitted is None else (self.admitted - self.pushed).total_seconds()


_NEW_CLIENT = re.compile(r"^NEW CLIENT (\d+) from user (\d+): (.*)$")
_STARTING = re.compile(r"^Starting new server (\d+) for user (\d+)$")
_EXITED = re.compile(r"^Server (\d+) exited with status (-?\d+)")


def queue_waits(control_log: List[LogLine]) -> List[QueueWait]:
    """Every "push client to pending list", with the next "Server already exists" of the
    same PID as its admission. user_switch: a server of another user was running."""
    running: Dict[int, int] = {}  # server pid -> uid
    open_waits: Dict[int, QueueWait] = {}
    waits: List[QueueWait] = []
    for line in control_log:
        m = _STARTING.match(line.text)
        if m:
            running[int(m.group(1))] = int(m.group(2))
            continue
        m = _EXITED.match(line.text)
        if m:
            running.pop(int(m.group(1)), None)
            continue
        m = _NEW_CLIENT.match(line.text)
        if not m:
            continue
        pid, uid, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        if "push client to pending list" in rest and pid not in open_waits:
            other = any(u != uid for u in running.values())
            open_waits[pid] = QueueWait(pid, uid, line.time, None, other)
            waits.append(open_waits[pid])
        elif "Server already exists" in rest and pid in open_waits:
            open_waits.pop(pid).admitted = line.time
    return waits


def count_text(lines: List[LogLine], pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(1 for line in lines if rx.search(line.text))


def fatal_error_reports(server_log: List[LogLine]) -> int:
    """One fatal GPU error = one "Client {...} encountered a fatal GPU error." line."""
    return count_text(server_log, r"encountered a fatal GPU error")


def connected_client_pids(server_log: List[LogLine]) -> set:
    return {int(m.group(1)) for line in server_log
            for m in [re.match(r"^Client \{PID: (\d+), Context ID: \d+\} connected", line.text)] if m}


def command_counts(control_log: List[LogLine]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for line in control_log:
        if line.text.startswith("Cmd:"):
            verb = line.text[4:].split()[0] if line.text[4:].split() else ""
            counts[verb] = counts.get(verb, 0) + 1
    return counts


def server_exit_statuses(control_log: List[LogLine]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for line in control_log:
        m = _EXITED.match(line.text)
        if m:
            counts[m.group(2)] = counts.get(m.group(2), 0) + 1
    return counts


_REFUSAL = re.compile(r"^Failed to accept new client\. (?:Maximum number of clients \((\d+)\) reached"
                      r"|Reached maximum number of device connections)")


def client_refusals(server_log: List[LogLine]) -> List[int]:
    """The limit number of each "Failed to accept new client ... (N) reached" line; 0 for
    each "... Reached maximum number of device connections." (clients that raised
    CUDA_DEVICE_MAX_CONNECTIONS; the line names no number)."""
    return [int(m.group(1) or 0) for line in server_log for m in [_REFUSAL.match(line.text)] if m]


_ACTIVE = re.compile(r"^Status of client \{PID: (\d+), Context ID: \d+\} is ACTIVE")
_GONE = re.compile(r"^Client process (\d+) disconnected")


def active_at_refusals(server_log: List[LogLine]) -> List[int]:
    """At each refusal line, the client processes of that server with a context MPS made
    ACTIVE and not disconnected since: what MPS had admitted when it refused."""
    active: Dict[int, set] = {}
    out = []
    for line in server_log:
        m = _ACTIVE.match(line.text)
        if m:
            active.setdefault(line.pid, set()).add(int(m.group(1)))
        m = _GONE.match(line.text)
        if m:
            active.get(line.pid, set()).discard(int(m.group(1)))
        if _REFUSAL.match(line.text):
            out.append(len(active.get(line.pid, ())))
    return out


def exits_with_clients(control_log: List[LogLine], server_log: List[LogLine]) -> List[int]:
    """Servers whose "Server S exited" line comes while server.log has a client of S
    connected (a "Client {PID: P, ...} connected" of S and no "Client process P
    disconnected" of S before the exit). Merges both logs by time."""
    events = sorted([(l.time, 1, l) for l in control_log] + [(l.time, 0, l) for l in server_log],
                    key=lambda e: (e[0], e[1]))
    attached: Dict[int, set] = {}
    out = []
    for _, is_control, line in events:
        if is_control:
            m = _EXITED.match(line.text)
            if m and attached.pop(int(m.group(1)), None):
                out.append(int(m.group(1)))
            continue
        m = re.match(r"^Client \{PID: (\d+), Context ID: \d+\} connected", line.text)
        if m:
            attached.setdefault(line.pid, set()).add(int(m.group(1)))
        m = re.match(r"^Client process (\d+) disconnected", line.text)
        if m:
            attached.get(line.pid, set()).discard(int(m.group(1)))
    return out


# --------------------------------------------------------------- statistics
def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


@dataclass
class Samples:
    values: List[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    def p(self, q: float) -> float:
        return percentile(self.values, q)
