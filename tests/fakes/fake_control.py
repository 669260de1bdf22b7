"""A fake `nvidia-cuda-mps-control` at the subprocess boundary.

`FakeControlDaemon` plugs in as `ControlClient.runner`. It answers in the exact
formats of the capture (tests/data/captures/h200-driver580-a/control/*.txt) and
records every command line it receives, so tests can prove that only read
commands reach the daemon.

`transcript_outputs()` reads a capture transcript ("> cmd" then its output) so
parser tests run on the real bytes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from tests.support.data import CAPTURE  # noqa: E402,F401  (re-exported to the tests)

PS_HEADER = "PID       ID        SERVER         DEVICE                    NAMESPACE      COMMAND        "


def transcript_outputs(path: Path) -> List[Tuple[str, str]]:
    """[(command, output)] from a capture transcript; `rc=N` lines dropped."""
    pairs: List[Tuple[str, str]] = []
    for line in path.read_text().splitlines():
        if line.startswith("> "):
            pairs.append((line[2:].strip(), ""))
        elif pairs and not re.match(r"^rc=\d+$", line):
            cmd, out = pairs[-1]
            pairs[-1] = (cmd, out + line + "\n")
    return pairs


@dataclass
class FakeServer:
    pid: int
    status: str = "ACTIVE"
    active_thread_percentage: float = 100.0
    # device as it was set (an ordinal, or "GPU-<uuid>") -> "2G", answered only when asked
    # by that key: a daemon keying a server's limit as set. R580's answers alike both ways
    # (tests/gpu/reports/2026-11-29-h200-pinned-limit-keys): its tests give both keys.
    pinned_limits: Dict[Union[int, str], str] = field(default_factory=dict)


@dataclass
class FakeClient:
    pid: int
    server_pid: int
    device_uuid: str
    client_id: int = 0
    namespace: str = "4026531836"
    command: str = "python3"


@dataclass
class FakeControlDaemon:
    servers: List[FakeServer] = field(default_factory=list)
    clients: List[FakeClient] = field(default_factory=list)
    running: bool = True
    default_active_thread_percentage: float = 100.0
    default_pinned_limits: Dict[Union[int, str], str] = field(default_factory=dict)
    default_client_priority: Optional[int] = 0  # None: a daemon without get_default_client_priority
    # Verbs this daemon's driver does not know: each answered `Unknown command "<verb>"`, as
    # driver 580 answers `help` (tests/data/captures/h200-driver580-a/control).
    unknown_commands: FrozenSet[str] = frozenset()
    version: str = "13000"
    hang_seconds: float = 0.0  # > timeout: simulates a hung daemon
    latency_seconds: float = 0.0  # the capture measured ~1.9 ms per command
    vanish_after_list: Sequence[int] = ()  # servers that exit right after get_server_list
    received: List[str] = field(default_factory=list)
    envs: List[Dict[str, str]] = field(default_factory=list)
    # Where MPS would echo each command and its answer (None: nowhere), as driver 580
    # does: `Accepting connection...`, `NEW UI`, `Cmd:<line>`, one line per line of the
    # answer, `UI closed`; stamped by `clock` and `pid` (the daemon's).
    control_log: Optional[Path] = None
    clock: Callable[[], float] = time.time
    pid: int = 546
    log_lines: int = 0  # lines echoed into control_log

    # --- runner interface
    def __call__(self, argv: Sequence[str], stdin_text: str, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
        if list(argv[1:]) == ["-v"]:
            if not self.version:  # R555 and older print no version (docs/drivers.md)
                return 0, ""
            return 0, f"CUDA MPS Control for Linux/Unix/QNX. Binary version: {self.version}\nCopyright (C) 2003 - 2025 NVIDIA Corporation.\n"
        self.received.append(stdin_text)
        self.envs.append(dict(env))
        if self.hang_seconds:
            from mps_exporter.sources.control import ControlError

            time.sleep(min(self.hang_seconds, timeout))
            raise ControlError(f"{argv[0]} did not answer within {timeout:g}s (killed)")
        if self.latency_seconds:
            time.sleep(self.latency_seconds)
        if not self.running:
            return 1, "Cannot find MPS control daemon process\n"
        out = self.answer(stdin_text.strip())
        self.echo(["Accepting connection...", "NEW UI", "Cmd:" + stdin_text.strip(), *out.splitlines(), "UI closed"])
        return 0, out

    def echo(self, messages: Sequence[str]) -> None:
        """Append these messages to control_log, as the daemon logs them."""
        if self.control_log is None:
            return
        now = self.clock()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
        with open(self.control_log, "a", encoding="utf-8") as f:
            f.writelines(f"[{stamp} Control {self.pid:>5}] {m}\n" for m in messages)
        self.log_lines += len(messages)

    # --- the daemon's replies, formatted as in the capture
    def _server(self, pid: int) -> Optional[FakeServer]:
        return next((s for s in self.servers if s.pid == pid), None)

    def answer(self, line: str) -> str:
        verb, *args = line.split()
        if verb in self.unknown_commands:
            return f'Unknown command "{verb}"\n'
        nums: List[Any] = [int(a) if a.isdigit() else a for a in args]
        if verb == "get_server_list":
            out = "".join(f"{s.pid}\n" for s in self.servers)
            if self.vanish_after_list:
                self.servers = [s for s in self.servers if s.pid not in self.vanish_after_list]
                self.clients = [c for c in self.clients if c.server_pid not in self.vanish_after_list]
            return out
        if verb == "ps":
            rows = [PS_HEADER] + [
                f"{c.pid:<10}{c.client_id:<10}{c.server_pid:<15}{c.device_uuid[:22]:<26}{c.namespace:<15}{c.command:<15}"
                for c in self.clients]
            return "\n".join(rows) + "\n"
        if verb == "get_default_active_thread_percentage":
            return f"{self.default_active_thread_percentage:.1f}\n"
        if verb == "get_default_client_priority" and self.default_client_priority is not None:
            return f"{self.default_client_priority}\n"
        if verb == "get_default_device_pinned_mem_limit":
            limit = self.default_pinned_limits.get(nums[0])
            return f"{limit}\n" if limit else "No default pinned memory limit set for the device!\n"
        if verb in ("get_server_status", "get_client_list", "get_active_thread_percentage", "get_device_pinned_mem_limit",
                    "get_device_client_list"):
            server = self._server(nums[0])
            if server is None:
                return f"Server {nums[0]} not found\n"
            if verb == "get_server_status":
                return f"{server.status}\n"
            if verb == "get_client_list":
                return "".join(f"{c.pid}\n" for c in self.clients if c.server_pid == server.pid)
            if verb == "get_device_client_list":  # a heading per device as driver 580 prints it, its clients
                mine = [c for c in self.clients if c.server_pid == server.pid]
                uuids = list(dict.fromkeys(c.device_uuid for c in mine))
                return "".join(f"[{i}] 00:00.0, NVIDIA H200\n" + "".join(f"{c.pid}.1\n" for c in mine
                                                                       if c.device_uuid == uuid)
                               for i, uuid in enumerate(uuids))
            if verb == "get_active_thread_percentage":
                return f"{server.active_thread_percentage:.1f}\n"
            limit = server.pinned_limits.get(nums[1])
            return f"{limit}\n" if limit else "No pinned memory limit set for the device!\n"
        return f'Unknown command "{verb}"\n'

    @classmethod
    def busy_capture(cls) -> "FakeControlDaemon":
        """The state of control/ctl_busy.txt: server 1589 with clients 1647-1649."""
        uuid = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
        return cls(servers=[FakeServer(1589)],
                   clients=[FakeClient(1649, 1589, uuid, 7), FakeClient(1648, 1589, uuid, 8),
                            FakeClient(1647, 1589, uuid, 6)])


@dataclass
class FakeDaemons:
    """Several control daemons, one per pipe directory, behind one runner: a command
    goes to the daemon of its CUDA_MPS_PIPE_DIRECTORY (none there: not running)."""

    by_pipe: Dict[str, FakeControlDaemon] = field(default_factory=dict)

    def __call__(self, argv: Sequence[str], stdin_text: str, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
        daemon = self.by_pipe.get(env.get("CUDA_MPS_PIPE_DIRECTORY", ""))
        if daemon is None:
            return 1, "Cannot find MPS control daemon process\n"
        return daemon(argv, stdin_text, env, timeout)
