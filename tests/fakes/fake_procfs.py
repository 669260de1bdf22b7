"""Write a /proc-shaped directory tree for the /proc source to read."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable

BOOT_TIME = 1795230000  # btime of the fake machine
CLK_TCK = 100


@dataclass
class FakeProcess:
    pid: int
    uid: int = 0
    comm: str = "python3"
    start_ticks: int = 1000  # clock ticks after boot
    cgroup: str = "0::/user.slice/user-0.slice/session-1.scope\n"
    environ: Dict[str, str] = field(default_factory=dict)


def write_proc(root: Path, processes: Iterable[FakeProcess]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  1 2 3 4\nbtime {BOOT_TIME}\nprocesses 10\n")
    for p in processes:
        d = root / str(p.pid)
        stat = d / "stat"
        if stat.exists() and stat.read_text().split()[21] != str(p.start_ticks):
            # Another process under a PID seen before: procfs gives it a new /proc/PID
            # inode. The old directory is moved aside until the new one exists, so that
            # the file system cannot hand its inode number straight back.
            gone = root / f".gone-{p.pid}"
            d.rename(gone)
            d.mkdir()
            shutil.rmtree(gone)
        d.mkdir(exist_ok=True)
        (d / "status").write_text(f"Name:\t{p.comm}\nState:\tS (sleeping)\nUid:\t{p.uid}\t{p.uid}\t{p.uid}\t{p.uid}\n")
        (d / "comm").write_text(p.comm + "\n")
        # 52 fields; field 22 is starttime. comm in parentheses may contain spaces.
        fields = ["S"] + ["0"] * 18 + [str(p.start_ticks)] + ["0"] * 30
        (d / "stat").write_text(f"{p.pid} ({p.comm}) " + " ".join(fields) + "\n")
        (d / "cgroup").write_text(p.cgroup)
        env = {"PATH": "/usr/bin", "SECRET_TOKEN": "do-not-export", **p.environ}
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    return root
